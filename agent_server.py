"""External agents: a token-recording OpenAI-compatible chat endpoint over a rank's engine, and the agent processes
that talk to it.

Any agent that speaks OpenAI chat completions (mini-swe-agent, a CLI, a script) gets `GET /v1/models` and
`POST /v1/chat/completions` (non-streaming, n=1, tools). Each request is keyed by its bearer token: one session per
agent. A session records what the policy sampled as segments, token-in-token-out: a request whose messages extend
the session's stored ones, with every assistant turn equal to what the endpoint returned, keeps the stored ids and
appends only the chat template's ids for the new messages (loss mask 0; chat.template_suffix_ids, as the multi-turn
loop does); any other history (compaction, an edited turn, a dropped reply) closes the segment and starts a new one
whose prompt is the template's rendering of the messages. Sampled ids are never decoded and encoded again.
`GET /kiln/sessions/{key}` returns a session's segments with check_tito's findings.

The engine is driven by the rank's main thread in ticks (`AgentServer.step`): the requests waiting from all
sessions go to one `engine.generate`, and under torchrun every rank makes the same number of engine calls (a rank
with nothing to generate makes a one-token call), as the multi-turn loop does. HTTP handler threads only queue.
"""
from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import shlex
import signal
import string
import subprocess
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import chat
import collectives
from engines import Engine, Sampling

TICK_SECONDS = 0.02  # how long a tick waits for a first request: the batching window when requests trickle in
AGENT_FIELDS = ("instance_id", "repo", "version", "base_commit", "image")  # of a swebench row's truth; no answers
AGENT_EXTRA_INFO = ("index", "split", "difficulty", "repo", "version")  # extra_info can hold solutions: not those


@dataclass
class Segment:
    """Token-in-token-out record of one stretch of a session: the prompt ids, then sampled ids (loss mask 1, engine
    logprobs) and the template's ids for the messages between turns (mask 0). `messages` is what the template renders
    (assistant turns as sampled text); `wire` is the conversation as the client holds it (assistant turns as returned:
    content and tool calls), what a next request must extend."""

    messages: list[dict]
    tools: list[dict] | None
    prompt_ids: list[int]
    wire: list[dict]
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    extendable: bool = True  # the last turn ended with the end-of-turn token: the template can continue after it

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def record(self, tokenizer, eot: str) -> dict:
        """What GET /kiln/sessions returns for it."""
        return {"prompt_ids": self.prompt_ids, "completion_ids": self.completion_ids, "loss_mask": self.loss_mask,
                "logprobs": self.logprobs, "finish_reason": self.finish_reason, "messages": self.messages,
                "tools": self.tools, "tito": chat.check_tito(tokenizer, self, self.messages, self.tools, eot)}


@dataclass(eq=False)  # two identical requests (a client's retry) are still two requests
class Request:
    key: str
    messages: list[dict]  # as sent
    tools: list[dict] | None
    max_tokens: int | None
    stop: list[str]
    sampling: tuple[float, float]  # (temperature, top_p) it asked for
    reply: Future = field(default_factory=Future)  # (HTTP status, JSON body)


class BadRequest(ValueError):
    """A request the endpoint refuses with HTTP 400 (or `status`), naming what is wrong."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request"):
        super().__init__(message)
        self.status, self.code = status, code


def wire_form(message: dict) -> dict:
    """A message as compared for prefix extension: role, content ("" for none) and, for assistant turns, the tool
    calls' names and arguments (parsed); wire-only fields (ids, names, provider extras) are left out."""
    content = message.get("content")
    form = {"role": message.get("role"), "content": "" if content is None else content}
    if message.get("role") == "assistant":
        form["tool_calls"] = [(c["function"]["name"], _arguments(c["function"].get("arguments")))
                              for c in message.get("tool_calls") or []]
    return form


def template_form(message: dict) -> dict:
    """A client's message as the chat template renders it (tool calls with parsed arguments)."""
    form = {"role": message["role"], "content": "" if message.get("content") is None else message["content"]}
    if message.get("tool_calls"):
        form["tool_calls"] = [{"type": "function", "function": {
            "name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}}
            for c in message["tool_calls"]]
    return form


def _arguments(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def parse_request(key: str, body: dict, fixed: Sampling | None) -> Request:
    """The fields kiln honours, checked; BadRequest names the first problem."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool") for m in messages):
        raise BadRequest("messages must be a non-empty list of {role: system|user|assistant|tool, content}")
    for i, m in enumerate(messages):
        for call in m.get("tool_calls") or []:
            if not isinstance(call, dict) or not isinstance(call.get("function"), dict) or not isinstance(
                    call["function"].get("name"), str):
                raise BadRequest(f"messages[{i}].tool_calls: each needs function.name and function.arguments")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported: send non-streaming requests")
    if body.get("n") not in (None, 1):
        raise BadRequest(f"n={body.get('n')}: only n=1 is supported (send n requests)")
    tools = body.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and isinstance(t.get("function", {}).get("name"), str) for t in tools)):
        raise BadRequest("tools must be a list of {type: function, function: {name, parameters}}")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a string or a list of non-empty strings")
    if fixed is not None:  # training: the trainer scores tokens under its own temperature, whatever the agent asks
        sampling = (fixed.temperature, fixed.top_p)
    else:
        temperature, top_p = body.get("temperature"), body.get("top_p")
        temperature, top_p = 1.0 if temperature is None else temperature, 1.0 if top_p is None else top_p
        if not isinstance(temperature, (int, float)) or not isinstance(top_p, (int, float)) or temperature < 0 or not (
                0 < top_p <= 1):
            raise BadRequest(f"temperature must be >= 0 and top_p in (0, 1], got {temperature!r}, {top_p!r}")
        sampling = (float(temperature), float(top_p))
    return Request(key, messages, tools, max_tokens, stop, sampling)


class AgentServer:
    """The endpoint on one rank: an HTTP server on its own threads (127.0.0.1 unless `host`), sessions, and `step`,
    which the rank's main thread calls in a loop to generate. `fixed_sampling`: every request samples with `sampling`
    (training: what the trainer scores); otherwise requests choose temperature and top_p. max_tokens defaults to
    sampling.max_new_tokens (with fixed_sampling also caps it); prompt plus reply stay within max_total_tokens."""

    def __init__(self, engine: Engine, tokenizer, sampling: Sampling, eot: str | None = None,
                 max_total_tokens: int = 32768, fixed_sampling: bool = True, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "kiln"):
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        self.eot = eot or chat.end_of_turn(tokenizer)
        self.eot_id = tokenizer.convert_tokens_to_ids(self.eot)
        self.max_total_tokens, self.fixed_sampling, self.model_name = max_total_tokens, fixed_sampling, model_name
        self.sessions: dict[str, list[Segment]] = {}
        self.ended: set[str] = set()
        self.lock = threading.Lock()  # sessions and ended: read by handler threads, written by the main thread
        self.pending: queue.Queue[Request] = queue.Queue()
        self.waiting: list[Request] = []  # taken from the queue, not generated yet
        self.requests = self.generate_calls = 0
        self.http = ThreadingHTTPServer((host, port), _Handler)
        self.http.daemon_threads = True
        self.http.kiln = self
        self.thread = threading.Thread(target=self.http.serve_forever, name="kiln-agent-server", daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self.http.server_address[:2]
        return f"http://{host}:{port}/v1"

    def __enter__(self) -> AgentServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving; requests still waiting get a 503."""
        if self.thread.is_alive():  # shutdown waits for serve_forever, which never started otherwise
            self.http.shutdown()
        self.http.server_close()
        for request in self.waiting + _drain(self.pending):
            _answer(request, 503, _error("the endpoint shut down", "unavailable"))
        self.waiting = []

    def end_session(self, key: str) -> list[Segment]:
        """Close a session for good (its agent is done or gone) and return its segments; later requests with that
        key get a 410."""
        with self.lock:
            self.ended.add(key)
            return self.sessions.pop(key, [])

    def session_record(self, key: str) -> dict | None:
        with self.lock:  # the main thread appends to segments under the same lock
            if key not in self.sessions:
                return None
            return {"id": key, "segments": [s.record(self.tokenizer, self.eot) for s in self.sessions[key]]}

    def submit(self, request: Request) -> None:
        with self.lock:
            if request.key in self.ended:
                raise BadRequest("this session has ended", status=410, code="session_ended")
        self.pending.put(request)

    def step(self, busy: bool = True) -> bool:
        """One tick: wait up to TICK_SECONDS for a request, then generate for the waiting requests of distinct
        sessions that share the oldest one's sampling, in one engine call. Collective under torchrun: every rank
        calls the engine when any rank has work (a rank without makes a one-token call). `busy`: this rank still
        expects requests (its agents run). Returns whether any rank is busy or has requests waiting."""
        if not self.waiting:
            try:
                self.waiting.append(self.pending.get(timeout=TICK_SECONDS))
            except queue.Empty:
                pass
        self.waiting += _drain(self.pending)
        batch, sessions = [], set()
        for request in self.waiting:
            if request.sampling == self.waiting[0].sampling and request.key not in sessions:
                batch.append(request)
                sessions.add(request.key)
        self.waiting = [r for r in self.waiting if r not in batch]
        prepared = [p for p in (self._prepare(r) for r in batch) if p is not None]
        busy_anywhere, generating_anywhere = collectives.any_ranks(busy or bool(self.waiting) or bool(prepared),
                                                                   bool(prepared))
        if generating_anywhere:
            self._generate(prepared)
        return busy_anywhere

    def _prepare(self, request: Request):
        """The request's segment (extended, or a new one) and the ids to generate from; answers refusals at once."""
        try:
            segment, new_ids, new_messages, forked = self._continue(request)
            room = self.max_total_tokens - len(segment.ids) - len(new_ids)
            if room < 1:
                raise BadRequest(f"the conversation is {len(segment.ids) + len(new_ids)} tokens, no room for a reply "
                                 f"within {self.max_total_tokens} (context_length_exceeded)",
                                 code="context_length_exceeded")
        except BadRequest as e:
            _answer(request, e.status, _error(str(e), e.code))
            return None
        except Exception as e:  # a bug here must not leave the agent waiting for an answer
            _answer(request, 500, _error(f"kiln could not prepare the request: {type(e).__name__}: {e}",
                                         "server_error"))
            return None
        budget = min(request.max_tokens or self.sampling.max_new_tokens, room)
        if self.fixed_sampling:  # training: the trainer's reply budget holds whatever the agent asks
            budget = min(budget, self.sampling.max_new_tokens)
        return request, segment, new_ids, new_messages, forked, budget

    def _continue(self, request: Request) -> tuple[Segment, list[int], list[dict], bool]:
        """Prefix extension of the session's last segment, or a new segment (the last one stays as it is)."""
        with self.lock:
            segments = self.sessions.setdefault(request.key, [])
            last = segments[-1] if segments else None
        wire = [wire_form(m) for m in request.messages]
        if request.messages[-1]["role"] == "assistant":
            raise BadRequest("the last message is an assistant turn: continuing a reply is not supported")
        if (last is not None and last.extendable and last.tools == request.tools and len(wire) > len(last.wire)
                and wire[: len(last.wire)] == last.wire
                and all(m["role"] != "assistant" for m in wire[len(last.wire):])):
            new = [template_form(m) for m in request.messages[len(last.wire):]]
            try:
                ids = chat.template_suffix_ids(self.tokenizer, last.messages, new, request.tools, self.eot)
            except ValueError as e:
                raise BadRequest(f"messages: {e}") from None
            return last, ids, new, False
        messages = [template_form(m) for m in request.messages]
        try:
            text = chat.render(self.tokenizer, messages, request.tools, add_generation_prompt=True)
            plain = chat.tool_spans(self.tokenizer, messages, request.tools, True, text)
        except Exception as e:  # a template error on the client's messages is the client's to fix
            raise BadRequest(f"the chat template cannot render these messages: {e}") from None
        prompt_ids = chat.encode_text(self.tokenizer, text, plain)[0]
        return Segment(messages, request.tools, prompt_ids, wire), [], [], True

    def _generate(self, prepared: list) -> None:
        if not prepared:  # another rank generates: one throwaway token keeps this rank's collectives in step
            self.engine.generate([[self.tokenizer.pad_token_id]], dataclasses.replace(self.sampling, max_new_tokens=1))
            return
        temperature, top_p = prepared[0][0].sampling
        sampling = dataclasses.replace(self.sampling, temperature=temperature, top_p=top_p,
                                       max_new_tokens=max(p[-1] for p in prepared))
        prompts = [segment.ids + new_ids for _, segment, new_ids, _, _, _ in prepared]
        try:
            completions = self.engine.generate(prompts, sampling)
        except Exception as e:  # the agents get an answer, the rank the error
            for request, *_ in prepared:
                _answer(request, 500, _error(f"generation failed: {type(e).__name__}: {e}", "server_error"))
            raise
        self.generate_calls += 1
        for (request, segment, new_ids, new_messages, forked, budget), completion in zip(prepared, completions):
            self.requests += 1
            _answer(request, 200, self._record(request, segment, new_ids, new_messages, forked, completion, budget))

    def _record(self, request: Request, segment: Segment, new_ids: list[int], new_messages: list[dict], forked: bool,
                completion, budget: int) -> dict:
        """Append the turn to its segment (a new segment to its session) and build the response."""
        ids, logprobs = completion.token_ids[:budget], completion.logprobs[:budget]
        ended = bool(ids) and ids[-1] == self.eot_id
        stopped = ended or (completion.finish_reason == "stop" and len(ids) == len(completion.token_ids))
        text = self.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)  # as sampled
        shown = text  # what the reply says
        cut = _stop_cut(self.tokenizer, ids[:-1] if stopped else ids, request.stop) if request.stop else None
        if cut is not None:  # a stop string: the reply ends before it, the ids at the token that completed it
            ids, logprobs, shown, stopped, ended = ids[:cut[0]], logprobs[:cut[0]], cut[1], True, False
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        known = {t["function"]["name"] for t in request.tools or []}
        calls = [c for c in chat.parse_tool_calls(text, known) if isinstance(c, dict)] if ended else []
        finish = "tool_calls" if calls else ("stop" if stopped else "length")
        content = chat.TOOL_CALL.sub("", text).strip() if calls else shown
        tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                       "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in calls]
        reply = {"role": "assistant", "content": content} | ({"tool_calls": tool_calls} if tool_calls else {})
        prompt_ids = segment.ids + new_ids
        with self.lock:
            if forked:
                self.sessions.setdefault(request.key, []).append(segment)
            segment.messages += new_messages + [{"role": "assistant", "content": text}]
            segment.wire = [wire_form(m) for m in request.messages] + [wire_form(reply)]
            segment.completion_ids += new_ids + ids
            segment.loss_mask += [0] * len(new_ids) + [1] * len(ids)
            segment.logprobs += [0.0] * len(new_ids) + list(logprobs)
            segment.finish_reason, segment.extendable = finish, ended
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "prompt_token_ids": prompt_ids,
                "choices": [{"index": 0, "message": reply, "finish_reason": finish, "logprobs": None,
                             "token_ids": ids}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                          "total_tokens": len(prompt_ids) + len(ids)}}


def _stop_cut(tokenizer, ids: list[int], stops: list[str]) -> tuple[int, str] | None:
    """(tokens to keep, text before the stop string) at the earliest stop string in the decoded ids, or None."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    found = [(text.find(s), s) for s in stops if s in text]
    if not found:
        return None
    at, stop = min(found)
    for k in range(1, len(ids) + 1):
        if len(tokenizer.decode(ids[:k], skip_special_tokens=False)) >= at + len(stop):
            return k, text[:at]
    return len(ids), text[:at]


def _drain(q: queue.Queue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def _answer(request: Request, status: int, body: dict) -> None:
    if not request.reply.done():
        request.reply.set_result((status, body))


def _error(message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args) -> None:  # noqa: A002 -- the base class's name; requests are not logged
        return None

    def do_GET(self) -> None:  # noqa: N802 -- http.server's name
        server: AgentServer = self.server.kiln
        if self.path.rstrip("/") == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                                                "owned_by": "kiln"}]})
        match = re.fullmatch(r"/kiln/sessions/([^/]+)", self.path)
        record = server.session_record(match.group(1)) if match else None
        if record is None:
            return self._send(404, _error(f"no such path or session: {self.path}", "not_found"))
        return self._send(200, record)

    def do_POST(self) -> None:  # noqa: N802
        server: AgentServer = self.server.kiln
        if self.path.rstrip("/") != "/v1/chat/completions":
            return self._send(404, _error(f"no such path: {self.path}", "not_found"))
        auth = self.headers.get("Authorization", "")
        key = auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else ""
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
            if not key:
                raise BadRequest("no session: send Authorization: Bearer <session key>", 401, "invalid_api_key")
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            request = parse_request(key, body, server.sampling if server.fixed_sampling else None)
            server.submit(request)
        except json.JSONDecodeError as e:
            return self._send(400, _error(f"the body is not JSON: {e}", "invalid_json"))
        except BadRequest as e:
            return self._send(e.status, _error(str(e), e.code))
        status, reply = request.reply.result()
        self._send(status, reply)

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


# Agent processes: one per trajectory, in its own process group, given the endpoint, its session key, the row (no
# answers) and a path for its result.


def agent_view(row: dict) -> dict:
    """What an agent may see of a row: its prompt, source and the descriptive keys of its extra info (AGENT_EXTRA_INFO);
    of a swebench row also the instance (id, repo, version, base commit, image; the problem statement is the prompt's
    user message). Never the answers, solutions, tests or gold patch."""
    view = {k: row[k] for k in ("data_source", "ability", "prompt") if k in row}
    view["extra_info"] = {k: v for k, v in row.get("extra_info", {}).items() if k in AGENT_EXTRA_INFO}
    if row.get("data_source") == "swebench":
        truth = json.loads(row["reward_model"]["ground_truth"])
        view["instance"] = {k: truth[k] for k in AGENT_FIELDS} | {
            "problem_statement": next(m["content"] for m in row["prompt"] if m["role"] == "user")}
    return view


PLACEHOLDERS = ("base_url", "api_key", "row_json", "row_file", "result")
# Not passed on to agents: the trainer's secrets, and torchrun's variables (an agent using torch is not a rank).
WITHHELD_ENV = re.compile(r"WANDB_.*|KILN_JUDGE_.*|RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK|"
                          r"GROUP_WORLD_SIZE|ROLE_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*|TORCH_NCCL_.*")


def check_agent_cmd(command: str) -> None:
    """ValueError unless every placeholder of the command is one of PLACEHOLDERS (checked before anything loads)."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(command) if name is not None}
    except ValueError as e:
        raise ValueError(f"--agent-cmd {command!r}: {e} (write literal braces as {{{{ and }}}})") from None
    unknown = names - set(PLACEHOLDERS)
    if unknown:
        raise ValueError(f"--agent-cmd: unknown placeholder {{{sorted(unknown)[0]}}}; known: "
                         + ", ".join(f"{{{p}}}" for p in PLACEHOLDERS))


@dataclass
class AgentProcess:
    key: str
    row: dict
    group: int
    result: Path
    process: subprocess.Popen
    started: float = field(default_factory=time.monotonic)
    status: str = "running"  # "ok", "failed" (exit code != 0), "timeout" (killed at the wall limit)
    seconds: float = 0.0

    def poll(self, max_seconds: float) -> bool:
        """Whether it still runs; past `max_seconds` its whole process group is killed."""
        if self.status != "running":
            return False
        code = self.process.poll()
        self.seconds = time.monotonic() - self.started
        if code is None and self.seconds > max_seconds:
            kill_group(self.process)
            self.status = "timeout"
        elif code is not None:
            self.status = "ok" if code == 0 else "failed"
        return self.status == "running"

    def completion(self) -> str:
        """The result the agent left ("" if none)."""
        try:
            return self.result.read_text(errors="surrogateescape")
        except OSError:
            return ""


def start_agent(command: str, base_url: str, row: dict, group: int, workdir: Path, log) -> AgentProcess:
    """Run `command` (placeholders filled in, shell-quoted) with bash in a new process group, stdout and stderr to
    `log`. Its environment is the trainer's less WITHHELD_ENV, plus OPENAI_BASE_URL, OPENAI_API_KEY, KILN_ROW_FILE and
    KILN_RESULT_FILE."""
    key = f"kiln-{uuid.uuid4().hex}"
    row_file, result = workdir / f"{key}.row.json", workdir / f"{key}.result"
    row_json = json.dumps(agent_view(row))
    row_file.write_text(row_json)
    values = {"base_url": base_url, "api_key": key, "row_json": row_json, "row_file": str(row_file),
              "result": str(result)}
    line = command.format(**{k: shlex.quote(v) for k, v in values.items()})
    env = {k: v for k, v in os.environ.items() if not WITHHELD_ENV.fullmatch(k)} | {
        "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": key, "KILN_ROW_FILE": str(row_file),
        "KILN_RESULT_FILE": str(result)}
    process = subprocess.Popen(["bash", "-c", line], env=env, stdin=subprocess.DEVNULL, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    return AgentProcess(key, row, group, result, process)


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process's group (the agent and everything it started) and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
