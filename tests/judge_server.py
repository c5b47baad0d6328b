"""Real OpenAI-compatible HTTP servers on 127.0.0.1 for the judge tests: a scripted one (replies, statuses, stalls,
resets, malformed bodies, chosen per request) and one that answers with a Hugging Face model through kiln's HFEngine.
"""
import json
import socket
import struct
import sys
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engines  # noqa: E402


def request_kind(payload: dict) -> str:
    """'verdict' for judge.equivalent's requests (their rubric asks for TRUE or FALSE), else 'rubric'."""
    return "verdict" if "TRUE or FALSE" in payload["messages"][0]["content"] else "rubric"


class Script:
    """What the scripted server does, per request: the first `[[key]]` found in the request's last message picks a
    list of actions for the request's kind, consumed one per request (the last one repeats). Actions:
    a str (reply with that text), ("status", code[, retry_after]), ("sleep", seconds, text), ("reset",),
    ("malformed",). Without a key: the default reply of the kind (TRUE / 0.75)."""

    def __init__(self, actions: dict | None = None, default: dict | None = None):
        self.actions = {k: list(v) for k, v in (actions or {}).items()}
        self.default = default or {"verdict": "TRUE", "rubric": "0.75"}
        self.requests = []  # (time, kind, key, payload) of every chat request, in arrival order
        self.lock = threading.Lock()

    def next_action(self, payload: dict):
        kind = request_kind(payload)
        text = json.dumps(payload["messages"][-1]["content"])
        key = next((k for (k, knd) in self.actions if knd == kind and f"[[{k}]]" in text), None)
        with self.lock:
            self.requests.append((time.monotonic(), kind, key, payload))
            if key is None:
                return self.default[kind]
            queue = self.actions[(key, kind)]
            return queue.pop(0) if len(queue) > 1 else queue[0]

    def count(self, key=None, kind=None) -> int:
        return sum((key is None or k == key) and (kind is None or kd == kind) for _, kd, k, _ in self.requests)


def chat_reply(text: str, model: str) -> bytes:
    return json.dumps({"id": "x", "object": "chat.completion", "model": model, "choices": [
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}).encode()


def make_handler(model: str, answer):
    """A request handler serving GET /v1/models and POST /v1/chat/completions; answer(payload) -> action."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go out in two writes: Nagle would hold the body ~40 ms

        def log_message(self, *args):
            pass

        def send(self, code: int, body: bytes, headers: dict | None = None):
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (its deadline passed)
                self.close_connection = True

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                self.send(200, json.dumps({"object": "list", "data": [{"id": model, "object": "model"}]}).encode())
            else:
                self.send(404, b"{}")

        def do_POST(self):
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path.rstrip("/") != "/v1/chat/completions":
                return self.send(404, b"{}")
            action = answer(payload)
            if isinstance(action, str):
                return self.send(200, chat_reply(action, model))
            if action[0] == "status":
                headers = {"Retry-After": str(action[2])} if len(action) > 2 else {}
                return self.send(action[1], b'{"error": "scripted"}', headers)
            if action[0] == "sleep":
                time.sleep(action[1])
                return self.send(200, chat_reply(action[2], model))
            if action[0] == "malformed":
                return self.send(200, b'{"choices": [{"message": ')
            if action[0] == "reset":  # RST instead of a reply
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()
                return None
            raise ValueError(action)

    return Handler


class Server(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's default backlog of 5 drops connections in a burst of 32 (each then waits ~1 s for the SYN to be
    # sent again); vLLM's server (uvicorn) listens with 2048.
    request_queue_size = 128


@contextmanager
def serve(handler):
    """Run a threading HTTP server with `handler` on a free 127.0.0.1 port; yields its /v1 base URL."""
    server = Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def scripted_judge(script: Script):
    with serve(make_handler("scripted", script.next_action)) as url:
        yield url


def engine_answer(engine, tokenizer, max_new_tokens_cap: int = 64):
    """answer(payload) for a server backed by kiln's HFEngine: the chat template renders the messages (image_url parts
    become the template's image placeholders), the engine decodes greedily up to the request's max_tokens."""
    calls = defaultdict(int)
    lock = threading.Lock()

    def answer(payload: dict) -> str:
        messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                     [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]}
                    for m in payload["messages"]]
        ids = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(ids, add_special_tokens=False)["input_ids"]
        sampling = engines.Sampling(max_new_tokens=min(payload.get("max_tokens", 16), max_new_tokens_cap),
                                    temperature=0.0, stop_token_ids=[tokenizer.eos_token_id])
        with lock:  # one decoding at a time on the shared model
            calls[request_kind(payload)] += 1
            completion = engine.generate([ids], sampling)[0]
        return tokenizer.decode(completion.token_ids, skip_special_tokens=True)

    answer.calls = calls
    return answer
