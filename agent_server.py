"""External agents: a token-recording endpoint over a rank's engine that speaks OpenAI chat completions, the OpenAI
Responses API and the Anthropic Messages API, streaming or not, and the agent processes that talk to it.

Any agent that speaks OpenAI chat completions (mini-swe-agent, qwen-code, a script) gets `GET /v1/models` and
`POST /v1/chat/completions` (n=1, tools, `stream: true` with `stream_options.include_usage`); one that speaks the
Responses API (codex) gets `POST /v1/responses` (message, function and custom tool call items and their outputs, the
whole history in every request: no previous_response_id); one that speaks Anthropic's (claude-code, the anthropic SDK)
gets `POST /v1/messages` (text, tool_use and tool_result blocks, its SSE events). All three are translated to one
chat form and recorded alike. A streamed reply is generated whole, then sent as SSE chunks: the same ids as without streaming. Each request
is keyed by its bearer token (or `x-api-key`): one session per agent.

A session records what the policy sampled as segments, token-in-token-out. A request continues a segment when its
messages extend that segment's conversation as the client holds it (assistant turns as the endpoint returned them) up
to one of the segment's replies: the stored ids are kept and only the chat template's ids for the new messages are
appended (loss mask 0; chat.template_suffix_ids). Sampled ids are never decoded and encoded again. Every segment of
the session is tried, not only the last one, so:
- a reply cut by max_tokens or a stop string can be continued (the template's closing tokens enter with mask 0);
- a request that continues an earlier reply of a segment (the later turns dropped) opens a "branch" segment whose
  prompt is that segment's ids up to that reply, exactly as recorded (trained once, where they were sampled);
- the same request again (a client's retry) replaces the reply it got before, which nobody continued;
- a side query with another system prompt or other tools (qwen-code's compression and JSON classifiers) opens or
  extends a "side" segment beside the main thread; side segments train only with train_side_queries;
- any other history (a rewritten, compressed conversation) opens a "rewrite" segment whose prompt is the template's
  rendering of the messages.
`GET /kiln/sessions/{key}` returns a session's segments, why each was opened, and check_tito's findings.

The engine is driven by the rank's main thread (`AgentServer.step`): a request is generated as soon as it arrives,
with every other request waiting at that moment, in one `engine.generate`; ranks do not wait for each other (but a
tensor-parallel engine's peers, which call it together, a peer with nothing waiting calling with no prompts), as in
the multi-turn loop. HTTP handler threads only queue.
"""
from __future__ import annotations

import bisect
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
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import chat
import collectives
import engines
from engines import Engine, Sampling

TICK_SECONDS = 0.02  # how long a tick waits for a first request: the batching window when requests trickle in
STREAM_WAIT_SECONDS = 2.0  # a stream's headers wait this long for its reply, so that early refusals keep their status
KEEPALIVE_SECONDS = 5.0  # then a stream waiting for its reply sends a keep-alive this often (clients' idle watchdogs)
SSE_PIECE = 24  # characters of text (or tool arguments) per streamed delta
AGENT_FIELDS = ("instance_id", "repo", "version", "base_commit", "image")  # of a swebench row's truth; no answers
AGENT_EXTRA_INFO = ("index", "split", "difficulty", "repo", "version")  # extra_info can hold solutions: not those
OPENED = ("first", "branch", "side", "rewrite")  # why a segment was opened; see the module docstring
CUSTOM_TOOL_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}


@dataclass
class Turn:
    """One reply of a segment: the request that asked for it (its length in wire messages) and where the turn's ids
    (the template's ids for the new messages, then the sampled ones) and messages begin."""

    request_len: int
    ids_start: int
    messages_start: int
    ended: bool  # the reply ended with the end-of-turn token it sampled (else the template's closes it, mask 0)
    finish: str  # the reply's; "max_total_tokens" once a request continuing it found no room for a reply


@dataclass
class Segment:
    """Token-in-token-out record of one stretch of a session: the prompt ids, then sampled ids (loss mask 1, engine
    logprobs) and the template's ids for the messages between turns (mask 0). `messages` is what the template renders
    (assistant turns as sampled text); `wire` is the conversation as the client holds it (assistant turns as returned:
    content and tool calls); each of its turns ends where a next request may continue."""

    messages: list[dict]
    tools: list[dict] | None
    prompt_ids: list[int]
    wire: list[dict]
    opened: str = "first"  # one of OPENED
    trains: bool = True
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    open_turns: list[int] = field(default_factory=list)  # assistant messages whose end-of-turn token was not sampled
    prompt_ended: bool = True  # a branch's prompt ends on a reply that sampled its end-of-turn token

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def finish_reason(self) -> str:
        return self.turns[-1].finish if self.turns else ""

    def rewind(self) -> None:
        """Drop the last turn (a retried request's first reply, which the client never continued)."""
        turn = self.turns.pop()
        del self.completion_ids[turn.ids_start:], self.loss_mask[turn.ids_start:], self.logprobs[turn.ids_start:]
        del self.messages[turn.messages_start:]
        self.wire = self.wire[: self.turns[-1].request_len + 1] if self.turns else self.wire[: turn.request_len]
        self.open_turns = [i for i in self.open_turns if i < turn.messages_start]

    def branch(self, turn: int) -> Segment:
        """A new segment whose prompt is this one's ids and messages up to the end of reply `turn` (< the last)."""
        following = self.turns[turn + 1]
        return Segment([dict(m) for m in self.messages[: following.messages_start]], self.tools,
                       self.prompt_ids + self.completion_ids[: following.ids_start],
                       self.wire[: self.turns[turn].request_len + 1], opened="branch",
                       open_turns=[i for i in self.open_turns if i < following.messages_start],
                       prompt_ended=self.turns[turn].ended)

    def record(self, tokenizer, eot: str) -> dict:
        """What GET /kiln/sessions returns for it."""
        return {"prompt_ids": self.prompt_ids, "completion_ids": self.completion_ids, "loss_mask": self.loss_mask,
                "logprobs": self.logprobs, "finish_reason": self.finish_reason, "messages": self.messages,
                "tools": self.tools, "opened": self.opened, "trains": self.trains, "turns": len(self.turns),
                "open_turns": self.open_turns,
                "tito": chat.check_tito(tokenizer, self, self.messages, self.tools, eot, self.open_turns)}


@dataclass(eq=False)  # two identical requests (a client's retry) are still two requests
class Request:
    key: str
    messages: list[dict]  # as sent (OpenAI chat form; an Anthropic request is translated)
    tools: list[dict] | None
    max_tokens: int | None
    stop: list[str]
    sampling: tuple[float, float]  # (temperature, top_p) it asked for
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    return_token_ids: bool = False  # the reply carries the prompt's ids (vLLM's field of the same name)
    wire: list[dict] = field(default_factory=list)  # the messages' wire_form, taken on the handler's thread
    reply: Future = field(default_factory=Future)  # (HTTP status, Reply or an error body)


@dataclass
class Reply:
    """A generated turn, whatever API asked for it: the message in OpenAI form and the ids behind it."""

    content: str
    tool_calls: list[dict]  # [{id, type: function, function: {name, arguments (JSON text)}}]
    finish: str  # "stop", "length" or "tool_calls"
    stop: str | None  # the stop string that ended it
    prompt_ids: list[int]
    token_ids: list[int]
    with_prompt_ids: bool = False  # sent back only when asked: 64K ids are ~20 ms of JSON each way, every turn

    @property
    def message(self) -> dict:
        return {"role": "assistant", "content": self.content} | ({"tool_calls": self.tool_calls}
                                                                 if self.tool_calls else {})


@dataclass
class Prepared:
    """A request ready for the engine: its segment (continued, or new), the template's ids and messages it adds, the
    reply budget, and the ids to generate from (the segment's, then the new ones)."""

    request: Request
    segment: Segment
    new_ids: list[int]
    new_messages: list[dict]
    new_segment: bool
    budget: int
    prompt: list[int]


class BadRequest(ValueError):
    """A request the endpoint refuses with HTTP 400 (or `status`), naming what is wrong."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request"):
        super().__init__(message)
        self.status, self.code = status, code


def text_of(content) -> str:
    """A message's content as text: a string, or the text of its parts (OpenAI content parts, Anthropic blocks)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")


def wire_form(message: dict) -> dict:
    """A message as compared for prefix extension: role, content as text and, for assistant turns, the tool calls'
    names and arguments (parsed); wire-only fields (ids, names, provider extras, cache hints) are left out."""
    form = {"role": message.get("role"), "content": text_of(message.get("content"))}
    if message.get("role") == "assistant":
        form["tool_calls"] = [(c["function"]["name"], _arguments(c["function"].get("arguments")))
                              for c in message.get("tool_calls") or []]
    return form


def template_form(message: dict) -> dict:
    """A client's message as the chat template renders it (text content, tool calls with parsed arguments)."""
    form = {"role": message["role"], "content": text_of(message.get("content"))}
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
    """The fields kiln honours of a chat completions body, checked; BadRequest names the first problem."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and m.get("role") in ("system", "developer", "user", "assistant", "tool")
            for m in messages):
        raise BadRequest("messages must be a non-empty list of {role: system|user|assistant|tool, content}")
    messages = [m | {"role": "system"} if m["role"] == "developer" else m for m in messages]
    for i, m in enumerate(messages):
        for call in m.get("tool_calls") or []:
            if not isinstance(call, dict) or not isinstance(call.get("function"), dict) or not isinstance(
                    call["function"].get("name"), str):
                raise BadRequest(f"messages[{i}].tool_calls: each needs function.name and function.arguments")
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
    options = body.get("stream_options") or {}
    return Request(key, messages, tools, max_tokens, stop, sampling, stream=bool(body.get("stream")),
                   include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
                   return_token_ids=bool(body.get("return_token_ids")), wire=[wire_form(m) for m in messages])


def anthropic_to_chat(body: dict) -> dict:
    """An Anthropic Messages body as the chat completions body it means: `system` a system message, text blocks
    content, tool_use blocks tool calls (their input as JSON arguments), each tool_result block a tool message (before
    the user's text, as Anthropic orders them), tools as functions, stop_sequences as stop. BadRequest names the
    first problem."""
    if not isinstance(body.get("max_tokens"), int):
        raise BadRequest("max_tokens is required (a positive integer)")
    messages = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": text_of(system)})
    for i, m in enumerate(body.get("messages") or []):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise BadRequest(f"messages[{i}]: role must be user, assistant or system")
        blocks = [{"type": "text", "text": m["content"]}] if isinstance(m.get("content"), str) else m.get("content")
        if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
            raise BadRequest(f"messages[{i}].content must be a string or a list of content blocks")
        texts = [b.get("text", "") for b in blocks if b.get("type") == "text"]
        if m["role"] == "system":  # a system message between turns (claude-code sends them)
            messages.append({"role": "system", "content": "".join(texts)})
            continue
        if m["role"] == "assistant":
            calls = [{"id": b.get("id"), "type": "function",
                      "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input", {}))}}
                     for b in blocks if b.get("type") == "tool_use"]
            messages.append({"role": "assistant", "content": "".join(texts)} | ({"tool_calls": calls} if calls else {}))
            continue
        for b in blocks:
            if b.get("type") == "tool_result":
                messages.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                                 "content": text_of(b.get("content"))})
        if texts or not any(b.get("type") == "tool_result" for b in blocks):
            messages.append({"role": "user", "content": "".join(texts)})
    tools = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                               "parameters": t.get("input_schema", {})}}
             for t in body.get("tools") or [] if isinstance(t, dict)]
    return {"messages": messages, "tools": tools or None, "max_tokens": body["max_tokens"],
            "stop": body.get("stop_sequences"), "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "stream": body.get("stream"), "return_token_ids": body.get("return_token_ids")}


def responses_to_chat(body: dict) -> dict:
    """An OpenAI Responses body as the chat completions body it means: `instructions` and the developer or system
    messages that open `input` one system message; message items their role's messages (input_text/output_text parts
    as text); function_call and custom_tool_call items the tool calls of one assistant turn with the message just
    before them (a custom tool's input as the argument `input`); their outputs tool messages; reasoning items, which
    kiln never sends, are left out. function and custom tools become functions (a custom tool takes one string,
    `input`); hosted tools (web_search, ...) and namespaces, which nothing here runs, are refused. kiln keeps no
    responses: previous_response_id and store: true are refused. BadRequest names the first problem."""
    if body.get("previous_response_id") is not None:
        raise BadRequest("previous_response_id: kiln keeps no responses; send the whole conversation as input")
    if body.get("store") is True:
        raise BadRequest("store: true: kiln keeps no responses; send store: false and the whole input each time")
    items = body.get("input")
    items = [{"type": "message", "role": "user", "content": items}] if isinstance(items, str) else items
    if not isinstance(items, list) or not items or not all(isinstance(item, dict) for item in items):
        raise BadRequest("input must be a string or a non-empty list of items")
    messages = [{"role": "system", "content": text_of(body["instructions"])}] if body.get("instructions") else []
    joins = False  # whether a call item joins the last message: an assistant turn only its own items followed
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ("system", "developer", "user", "assistant"):
                raise BadRequest(f"input[{i}]: a message's role must be system, developer, user or assistant")
            role = "system" if item["role"] == "developer" else item["role"]
            text = _item_text(item.get("content"))
            if role == "system" and messages and all(m["role"] == "system" for m in messages):
                messages[0]["content"] += "\n\n" + text  # what opens the input is one system prompt
            else:
                messages.append({"role": role, "content": text})
            joins = role == "assistant"
        elif kind in ("function_call", "custom_tool_call"):
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise BadRequest(f"input[{i}]: a {kind} needs name and call_id")
            arguments = item.get("arguments") if kind == "function_call" else json.dumps({"input": item.get("input")})
            if not joins:
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                        "arguments": arguments or "{}"}})
            joins = True
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _item_text(item.get("output"))})
            joins = False
        elif kind != "reasoning":  # reasoning: kiln sends none; another server's are not the policy's tokens
            raise BadRequest(f"input[{i}]: items of type {kind!r} are not supported (message, function_call, "
                             "function_call_output, custom_tool_call, custom_tool_call_output, reasoning)")
    tools = []
    for t in body.get("tools") or []:
        if not isinstance(t, dict):
            raise BadRequest("tools must be a list of objects")
        if t.get("type") == "function":
            tools.append({"type": "function", "function": {"name": t.get("name"), "description": t.get(
                "description", ""), "parameters": t.get("parameters") or {"type": "object", "properties": {}}}})
        elif t.get("type") == "custom":
            tools.append({"type": "function", "function": {"name": t.get("name"), "description": t.get(
                "description", ""), "parameters": CUSTOM_TOOL_PARAMETERS}})
        else:
            raise BadRequest(f"tools: {t.get('type')!r} tools are not supported, only function and custom tools "
                             "(codex: web_search=\"disabled\", --disable multi_agent)")
    return {"messages": messages, "tools": tools or None, "max_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "stream": body.get("stream")}


def _item_text(content) -> str:
    """A Responses content (a string, or input_text/output_text parts) as text."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") in (
            "input_text", "output_text", "text"))
    return text_of(content)


def custom_tools(body: dict) -> set[str]:
    """The names of a Responses body's custom tools (their calls go back as custom_tool_call items)."""
    return {t.get("name") for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type") == "custom"}


class AgentServer:
    """The endpoint on one rank: an HTTP server on its own threads (127.0.0.1 unless `host`), sessions, and `step`,
    which the rank's main thread calls in a loop to generate. `fixed_sampling`: every request samples with `sampling`
    (training: what the trainer scores); otherwise requests choose temperature and top_p. max_tokens defaults to
    sampling.max_new_tokens (with fixed_sampling also caps it); prompt plus reply stay within max_total_tokens.
    train_side_queries: side segments (another system prompt or other tools than the session's first request) train
    too."""

    def __init__(self, engine: Engine, tokenizer, sampling: Sampling, eot: str | None = None,
                 max_total_tokens: int = 32768, fixed_sampling: bool = True, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "kiln", train_side_queries: bool = False):
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        self.eot = eot or chat.end_of_turn(tokenizer)
        self.eot_id = tokenizer.convert_tokens_to_ids(self.eot)
        self.max_total_tokens, self.fixed_sampling, self.model_name = max_total_tokens, fixed_sampling, model_name
        self.train_side_queries = train_side_queries
        self.sessions: dict[str, list[Segment]] = {}
        self.ended: set[str] = set()
        self.lock = threading.Lock()  # sessions and ended: read by handler threads, written by the main thread
        self.pending: queue.Queue[Request] = queue.Queue()
        self.waiting: list[Request] = []  # taken from the queue, not generated yet
        self.generating: dict[int, Prepared] = {}  # submitted to a continuous engine, by id(request)
        self.requests = self.generate_calls = self.retries = 0
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
        for request in self.waiting + _drain(self.pending) + [p.request for p in self.generating.values()]:
            _answer(request, 503, _error("the endpoint shut down", "unavailable"))
        if self.generating:  # the engine must be empty for the next weights
            self.engine.abort()
        self.waiting, self.generating = [], {}

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
            segments = [s.record(self.tokenizer, self.eot) for s in self.sessions[key]]
        return {"id": key, "opened": [s["opened"] for s in segments], "segments": segments}

    def submit(self, request: Request) -> None:
        with self.lock:
            if request.key in self.ended:
                raise BadRequest("this session has ended", status=410, code="session_ended")
        self.pending.put(request)

    def step(self, busy: bool = True) -> bool:
        """Take the requests that have arrived, waiting up to TICK_SECONDS for one when nothing is generating (no
        longer: a request is taken when it arrives). A continuous engine (`engines.continuous`) gets each request of a
        session not generating yet, with the running ones' sampling, and does one decoding step; a request is
        answered at the step that ends its reply. Any other engine gets the waiting requests of distinct sessions that
        share the oldest one's sampling, in one call. Only a tensor-parallel engine's peers (`engines.call_group`)
        meet here, to call it together. `busy`: this rank still expects requests (its agents run). Returns whether this
        rank (or a peer) is busy or has requests waiting or generating."""
        if not self.waiting and not self.generating:
            try:
                self.waiting.append(self.pending.get(timeout=TICK_SECONDS))
            except queue.Empty:
                pass
        self.waiting += _drain(self.pending)
        running = [p.request for p in self.generating.values()]
        batch, sessions = [], {r.key for r in running}
        for request in self.waiting:
            if request.sampling == (running or self.waiting)[0].sampling and request.key not in sessions:
                batch.append(request)
                sessions.add(request.key)
        self.waiting = [r for r in self.waiting if r not in batch]
        prepared = [p for p in (self._prepare(r) for r in batch) if p is not None]
        if engines.continuous(self.engine):
            for p in prepared:
                self.engine.submit(id(p.request), p.prompt, self._sampling(p.request, p.budget))
                self.generating[id(p.request)] = p
            if self.generating:
                self._step_engine()
            return busy or bool(self.waiting) or bool(self.generating)
        busy, generating = busy or bool(self.waiting) or bool(prepared), bool(prepared)
        if (group := engines.call_group(self.engine)) is not None:
            busy, generating = collectives.any_ranks(busy, generating, group=group)
        if generating:
            self._generate(prepared)
        return busy

    def _prepare(self, request: Request) -> Prepared | None:
        """The request's segment (continued, or a new one) and the ids to generate from; answers refusals at once."""
        try:
            segment, new_ids, new_messages, new_segment = self._continue(request)
            prompt = [*segment.prompt_ids, *segment.completion_ids, *new_ids]  # one copy: the engine's prompt
            room = self.max_total_tokens - len(prompt)
            if room < 1:
                if not new_segment and segment.turns:  # the session ran out of tokens mid-episode, as the tool loop's
                    with self.lock:
                        last = segment.turns[-1]
                        last.finish = "max_total_tokens"
                        if not last.ended:  # a reply left open at the end of the budget is half a turn: untrained
                            segment.loss_mask[last.ids_start:] = [0] * (len(segment.loss_mask) - last.ids_start)
                raise BadRequest(f"the conversation is {len(prompt)} tokens, no room for a reply "
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
        return Prepared(request, segment, new_ids, new_messages, new_segment, budget, prompt)

    def _continue(self, request: Request) -> tuple[Segment, list[int], list[dict], bool]:
        """The segment the request continues (a reply of any segment its messages extend, or the last reply of one
        it repeats the request of), or a new one; the ids and template messages to add; whether the segment is new.
        A retry drops the reply it repeats the request of (nobody continued it) before it is answered again."""
        if request.messages[-1]["role"] == "assistant":
            raise BadRequest("the last message is an assistant turn: continuing a reply is not supported")
        wire = request.wire
        last_reply = next((i for i in reversed(range(len(wire))) if wire[i]["role"] == "assistant"), -1)
        with self.lock:
            segments = list(self.sessions.get(request.key, []))
        found = None  # (segment, turn index) whose reply the request continues, extensions of a last reply first
        for segment in reversed(segments):
            if segment.tools != request.tools:
                continue
            last = segment.turns[-1] if segment.turns else None
            if last is not None and last.request_len == len(wire) == _common_prefix(wire, segment.wire):  # a retry
                with self.lock:
                    segment.rewind()
                self.retries += 1
                found = (segment, len(segment.turns) - 1) if segment.turns else (segment, None)
                break
            # The one turn whose reply the request can continue (a segment's requests only grow), and that reply
            # itself, are checked before the whole history is: a request costs one comparison of its history, not
            # one per segment of its session.
            t = bisect.bisect_left(segment.turns, last_reply, key=lambda turn: turn.request_len)
            if (t == len(segment.turns) or segment.turns[t].request_len != last_reply
                    or segment.wire[last_reply] != wire[last_reply]):
                continue
            if (found is None or (found[1] != len(found[0].turns) - 1 and t == len(segment.turns) - 1)) and (
                    _common_prefix(wire, segment.wire) > last_reply):
                found = (segment, t)
        if found is not None:
            segment, t = found
            if t is None:  # a retry of the segment's first request: its prompt again
                return segment, [], [], False
            branched = t < len(segment.turns) - 1
            if branched:
                segment = segment.branch(t)
                segment.trains = self._main(segments, request) or self.train_side_queries
            new = [template_form(m) for m in request.messages[last_reply + 1:]]
            ended = segment.prompt_ended if branched else segment.turns[t].ended
            try:
                ids = chat.template_suffix_ids(self.tokenizer, segment.messages, new, request.tools, self.eot,
                                               after_eot=ended)
            except ValueError as e:
                raise BadRequest(f"messages: {e}") from None
            return segment, ids, new, branched
        messages = [template_form(m) for m in request.messages]
        try:
            text = chat.render(self.tokenizer, messages, request.tools, add_generation_prompt=True)
            plain = chat.tool_spans(self.tokenizer, messages, request.tools, True, text)
        except Exception as e:  # a template error on the client's messages is the client's to fix
            raise BadRequest(f"the chat template cannot render these messages: {e}") from None
        prompt_ids = chat.encode_text(self.tokenizer, text, plain)[0]
        main = self._main(segments, request)
        opened = "first" if not segments else ("rewrite" if main else "side")
        return Segment(messages, request.tools, prompt_ids, [], opened=opened,
                       trains=main or self.train_side_queries), [], [], True

    def _main(self, segments: list[Segment], request: Request) -> bool:
        """Whether the request belongs to the session's main thread: its system prompt and tools are the first
        segment's (a side query's differ)."""
        if not segments:
            return True
        first = segments[0]
        system = [template_form(m) for m in request.messages[:1] if m["role"] == "system"]
        return first.tools == request.tools and system == [m for m in first.messages[:1] if m["role"] == "system"]

    def _sampling(self, request: Request, budget: int) -> Sampling:
        temperature, top_p = request.sampling
        return dataclasses.replace(self.sampling, temperature=temperature, top_p=top_p, max_new_tokens=budget)

    def _step_engine(self) -> None:
        """One step of a continuous engine; the requests it finished are recorded and answered."""
        try:
            finished = self.engine.step()
        except Exception as e:  # the agents get an answer, the rank the error
            for p in self.generating.values():
                _answer(p.request, 500, _error(f"generation failed: {type(e).__name__}: {e}", "server_error"))
            self.generating = {}
            self.engine.abort()
            raise
        self.generate_calls += 1
        for key, completion in finished:
            p = self.generating.pop(key)
            self.requests += 1
            _answer(p.request, 200, self._record(p, completion))

    def _generate(self, prepared: list[Prepared]) -> None:
        if not prepared:  # a tensor-parallel peer generates: this rank's share of the call is empty
            self.engine.generate([], self.sampling)
            return
        sampling = self._sampling(prepared[0].request, max(p.budget for p in prepared))
        try:
            completions = self.engine.generate([p.prompt for p in prepared], sampling)
        except Exception as e:  # the agents get an answer, the rank the error
            for p in prepared:
                _answer(p.request, 500, _error(f"generation failed: {type(e).__name__}: {e}", "server_error"))
            raise
        self.generate_calls += 1
        for p, completion in zip(prepared, completions):
            self.requests += 1
            _answer(p.request, 200, self._record(p, completion))

    def _record(self, prepared: Prepared, completion) -> Reply:
        """Append the turn to its segment (a new segment to its session) and build the reply."""
        request, segment, new_ids, budget = prepared.request, prepared.segment, prepared.new_ids, prepared.budget
        ids, logprobs = completion.token_ids[:budget], completion.logprobs[:budget]
        ended = bool(ids) and ids[-1] == self.eot_id
        stopped = ended or (completion.finish_reason == "stop" and len(ids) == len(completion.token_ids))
        text = self.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)  # as sampled
        shown, stop = text, None  # what the reply says
        cut = chat.stop_cut(self.tokenizer, ids[:-1] if stopped else ids, request.stop) if request.stop else None
        if cut is not None:  # a stop string: the reply ends before it, the ids at the token that completed it
            ids, logprobs, shown, stop, stopped, ended = ids[:cut[0]], logprobs[:cut[0]], cut[1], cut[2], True, False
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        known = {t["function"]["name"] for t in request.tools or []}
        calls = [c for c in chat.parse_tool_calls(text, known) if isinstance(c, dict)] if ended else []
        finish = "tool_calls" if calls else ("stop" if stopped else "length")
        # half a turn cut by the session's token budget (not the request's max_tokens): kept, not trained, and the
        # segment ends there as the tool loop's does
        out_of_room = not stopped and len(ids) >= self.max_total_tokens - len(prepared.prompt)
        content = chat.TOOL_CALL.sub("", text).strip() if calls else shown
        tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                       "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in calls]
        reply = Reply(content, tool_calls, finish, stop, prepared.prompt, ids, request.return_token_ids)
        with self.lock:
            if prepared.new_segment:
                self.sessions.setdefault(request.key, []).append(segment)
            turn = Turn(len(request.messages), len(segment.completion_ids), len(segment.messages), ended,
                        "max_total_tokens" if out_of_room else finish)
            segment.turns.append(turn)
            segment.messages += prepared.new_messages + [{"role": "assistant", "content": text}]
            if not ended:
                segment.open_turns.append(len(segment.messages) - 1)
            segment.wire = request.wire + [wire_form(reply.message)]
            segment.completion_ids += new_ids + ids
            segment.loss_mask += [0] * len(new_ids) + [0 if out_of_room else 1] * len(ids)
            segment.logprobs += [0.0] * len(new_ids) + list(logprobs)
        return reply


def _common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def _drain(q: queue.Queue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def _answer(request: Request, status: int, body) -> None:
    if not request.reply.done():
        request.reply.set_result((status, body))


def _error(message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


# The replies in each API's shapes. Anthropic's stop reasons and error types for OpenAI's.
ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ANTHROPIC_ERROR = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   410: "invalid_request_error", 503: "overloaded_error"}


def chat_completion(reply: Reply, model: str) -> dict:
    """The reply as a chat.completion, with kiln's ids (choices[].token_ids; prompt_token_ids when asked)."""
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, **_prompt_ids(reply),
            "choices": [{"index": 0, "message": reply.message, "finish_reason": reply.finish, "logprobs": None,
                         "token_ids": reply.token_ids}],
            "usage": _usage(reply)}


def chat_chunks(reply: Reply, model: str, include_usage: bool) -> list[dict]:
    """The reply as chat.completion.chunk objects: the role, content deltas, each tool call (index, id, name, then its
    arguments in pieces), a finish chunk (with kiln's ids), and the usage chunk (no choices) when asked."""
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}

    def chunk(delta: dict, finish: str | None = None, **extra) -> dict:
        return head | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None} | extra]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    chunks += [chunk({"content": piece}) for piece in _pieces(reply.content)]
    for i, call in enumerate(reply.tool_calls):
        chunks.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                             "function": {"name": call["function"]["name"], "arguments": ""}}]}))
        chunks += [chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
                   for piece in _pieces(call["function"]["arguments"])]
    chunks.append(chunk({}, reply.finish, token_ids=reply.token_ids) | _prompt_ids(reply))
    if include_usage:
        chunks.append(head | {"choices": [], "usage": _usage(reply)})
    return chunks


def anthropic_message(reply: Reply, model: str) -> dict:
    """The reply as an Anthropic message: a text block (if any text), a tool_use block per call."""
    blocks = [{"type": "text", "text": reply.content}] if reply.content or not reply.tool_calls else []
    blocks += [{"type": "tool_use", "id": "toolu_" + c["id"][len("call_"):], "name": c["function"]["name"],
                "input": json.loads(c["function"]["arguments"])} for c in reply.tool_calls]
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
            "content": blocks, "stop_reason": "stop_sequence" if reply.stop else ANTHROPIC_STOP[reply.finish],
            "stop_sequence": reply.stop, **_prompt_ids(reply), "token_ids": reply.token_ids,
            "usage": {"input_tokens": len(reply.prompt_ids), "output_tokens": len(reply.token_ids)}}


def anthropic_events(reply: Reply, model: str) -> list[tuple[str, dict]]:
    """The reply as Anthropic's stream: message_start, each block's start, deltas (text_delta, input_json_delta) and
    stop, message_delta (stop reason, usage), message_stop."""
    message = anthropic_message(reply, model)
    start = message | {"content": [], "stop_reason": None, "stop_sequence": None,
                       "usage": {"input_tokens": len(reply.prompt_ids), "output_tokens": 0}}
    events = [("message_start", {"type": "message_start", "message": start})]
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            opened, deltas = {"type": "text", "text": ""}, [{"type": "text_delta", "text": p}
                                                              for p in _pieces(block["text"])]
        else:
            opened = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": p} for p in _pieces(json.dumps(block["input"]))]
        events.append(("content_block_start", {"type": "content_block_start", "index": i, "content_block": opened}))
        events += [("content_block_delta", {"type": "content_block_delta", "index": i, "delta": d}) for d in deltas]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    events.append(("message_delta", {"type": "message_delta", "delta": {
        "stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]},
        "usage": {"output_tokens": len(reply.token_ids)}}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def response_object(reply: Reply, model: str, custom: set[str], status: str | None = None) -> dict:
    """The reply as a Responses API response: a message item (if any text), a function_call item per call (a
    custom_tool_call for a custom tool), status incomplete when cut by the reply budget; with kiln's ids."""
    output = [{"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": reply.content, "annotations": []}]}
              ] if reply.content or not reply.tool_calls else []
    for call in reply.tool_calls:
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        output.append({"type": "custom_tool_call", "id": f"ctc_{uuid.uuid4().hex}", "status": "completed",
                       "call_id": call["id"], "name": name, "input": _custom_input(arguments)}
                      if name in custom else
                      {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "status": "completed",
                       "call_id": call["id"], "name": name, "arguments": arguments})
    cut = reply.finish == "length"
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "status": status or ("incomplete" if cut else "completed"), "model": model, "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "usage": {
                "input_tokens": len(reply.prompt_ids), "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": len(reply.token_ids), "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": len(reply.prompt_ids) + len(reply.token_ids)},
            "prompt_token_ids": reply.prompt_ids, "token_ids": reply.token_ids}


def response_events(reply: Reply, model: str, custom: set[str]) -> list[tuple[str, dict]]:
    """The reply as the Responses stream: response.created, then per output item output_item.added, its deltas
    (content_part.added, output_text.delta and .done, content_part.done; or function_call_arguments.delta and .done;
    or custom_tool_call_input.delta and .done) and output_item.done; then response.completed (response.incomplete
    when cut by the reply budget). Each event carries its sequence_number."""
    response = response_object(reply, model, custom)
    events = [("response.created", {"response": response | {"status": "in_progress", "output": [],
                                                             "incomplete_details": None, "usage": None}})]
    for i, item in enumerate(response["output"]):
        at = {"item_id": item["id"], "output_index": i}
        if item["type"] == "message":
            text, part = item["content"][0]["text"], {"type": "output_text", "text": "", "annotations": []}
            events += [("response.output_item.added", {"output_index": i, "item": item | {
                "status": "in_progress", "content": []}}),
                       ("response.content_part.added", at | {"content_index": 0, "part": part})]
            events += [("response.output_text.delta", at | {"content_index": 0, "delta": piece})
                       for piece in _pieces(text)]
            events += [("response.output_text.done", at | {"content_index": 0, "text": text}),
                       ("response.content_part.done", at | {"content_index": 0, "part": part | {"text": text}})]
        else:
            field_, kind = ("arguments", "function_call_arguments") if item["type"] == "function_call" else (
                "input", "custom_tool_call_input")
            events.append(("response.output_item.added", {"output_index": i, "item": item | {
                "status": "in_progress", field_: ""}}))
            events += [(f"response.{kind}.delta", at | {"delta": piece}) for piece in _pieces(item[field_])]
            events.append((f"response.{kind}.done", at | {field_: item[field_]}))
        events.append(("response.output_item.done", {"output_index": i, "item": item}))
    events.append(("response.incomplete" if response["status"] == "incomplete" else "response.completed",
                   {"response": response}))
    return [(name, {"type": name, "sequence_number": n} | data) for n, (name, data) in enumerate(events)]


def _custom_input(arguments: str) -> str:
    """A custom tool's input from the arguments the policy gave it ({"input": ...}; anything else as written)."""
    parsed = json.loads(arguments)
    return parsed["input"] if isinstance(parsed, dict) and isinstance(parsed.get("input"), str) else arguments


def responses_error(status: int, body: dict) -> dict:
    """An error as the Responses stream's `error` event."""
    return {"type": "error", "code": body["error"]["code"], "message": body["error"]["message"], "param": None}


def anthropic_error(status: int, body: dict) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR.get(status, "api_error"),
                                       "message": body["error"]["message"]}}


def _prompt_ids(reply: Reply) -> dict:
    return {"prompt_token_ids": reply.prompt_ids} if reply.with_prompt_ids else {}


def _usage(reply: Reply) -> dict:
    return {"prompt_tokens": len(reply.prompt_ids), "completion_tokens": len(reply.token_ids),
            "total_tokens": len(reply.prompt_ids) + len(reply.token_ids)}


def _pieces(text: str) -> list[str]:
    return [text[i: i + SSE_PIECE] for i in range(0, len(text), SSE_PIECE)]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # a reply's headers and body go out at once, not 40 ms apart (delayed ACKs)

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
        path = self.path.split("?")[0].rstrip("/")
        if path not in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
            return self._send(404, _error(f"no such path: {self.path}", "not_found"))
        anthropic, responses = path == "/v1/messages", path == "/v1/responses"
        custom: set[str] = set()
        auth = self.headers.get("Authorization", "")
        key = auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else self.headers.get("x-api-key", "")
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
            if not key:
                raise BadRequest("no session: send Authorization: Bearer <session key> (or x-api-key)", 401,
                                 "invalid_api_key")
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            if responses:
                custom, body = custom_tools(body), responses_to_chat(body)
            request = parse_request(key, anthropic_to_chat(body) if anthropic else body,
                                    server.sampling if server.fixed_sampling else None)
            server.submit(request)
        except json.JSONDecodeError as e:
            return self._error(400, _error(f"the body is not JSON: {e}", "invalid_json"), anthropic)
        except BadRequest as e:
            return self._error(e.status, _error(str(e), e.code), anthropic)
        if not request.stream:
            status, reply = request.reply.result()
            if status != 200:
                return self._error(status, reply, anthropic)
            if responses:
                return self._send(200, response_object(reply, server.model_name, custom))
            return self._send(200, anthropic_message(reply, server.model_name) if anthropic
                              else chat_completion(reply, server.model_name))
        try:  # an early refusal keeps its HTTP status; a long wait gets the stream's headers and keep-alives
            status, reply = request.reply.result(timeout=STREAM_WAIT_SECONDS)
            if status != 200:
                return self._error(status, reply, anthropic)
            self._open_stream()
        except FutureTimeout:
            self._open_stream()
            while True:
                try:
                    status, reply = request.reply.result(timeout=KEEPALIVE_SECONDS)
                    break
                except FutureTimeout:
                    if anthropic:
                        self._event("ping", {"type": "ping"})
                    else:
                        self._event(None, None)
        if status != 200:  # after the headers: OpenAI's error chunk, Anthropic's or the Responses' error event
            if responses:
                return self._event("error", responses_error(status, reply))
            return self._event("error", anthropic_error(status, reply)) if anthropic else self._event(None, reply)
        if responses:
            for name, data in response_events(reply, server.model_name, custom):
                self._event(name, data)
        elif anthropic:
            for name, data in anthropic_events(reply, server.model_name):
                self._event(name, data)
        else:
            for data in chat_chunks(reply, server.model_name, request.include_usage):
                self._event(None, data)
            self.wfile.write(b"data: [DONE]\n\n")

    def _open_stream(self) -> None:
        """SSE headers; the stream ends when the connection closes."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _event(self, name: str | None, data: dict | None) -> None:
        """One SSE event (`data` None: a keep-alive comment)."""
        text = ": keep-alive\n\n" if data is None else (f"event: {name}\n" if name else "") + (
            f"data: {json.dumps(data)}\n\n")
        self.wfile.write(text.encode())
        self.wfile.flush()

    def _error(self, status: int, body: dict, anthropic: bool) -> None:
        self._send(status, anthropic_error(status, body) if anthropic else body)

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


PLACEHOLDERS = ("base_url", "api_key", "row_json", "row_file", "result", "harness")
# Not passed on to agents: the trainer's secrets, and torchrun's variables (an agent using torch is not a rank).
WITHHELD_ENV = re.compile(r"WANDB_.*|KILN_JUDGE_.*|RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK|"
                          r"GROUP_WORLD_SIZE|ROLE_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*|TORCH_NCCL_.*")


def placeholders(command: str) -> set[str]:
    """The placeholder names of an --agent-cmd; ValueError on a malformed one."""
    try:
        return {name for _, name, _, _ in string.Formatter().parse(command) if name is not None}
    except ValueError as e:
        raise ValueError(f"--agent-cmd {command!r}: {e} (write literal braces as {{{{ and }}}})") from None


def check_agent_cmd(command: str, harnesses: tuple[str, ...] = ()) -> None:
    """ValueError unless every placeholder of the command is one of PLACEHOLDERS, and harnesses to choose from come
    with a {harness} placeholder to take them (checked before anything loads)."""
    names = placeholders(command)
    unknown = names - set(PLACEHOLDERS)
    if unknown:
        raise ValueError(f"--agent-cmd: unknown placeholder {{{sorted(unknown)[0]}}}; known: "
                         + ", ".join(f"{{{p}}}" for p in PLACEHOLDERS))
    if harnesses and "harness" not in names:
        raise ValueError(f"--agent-harnesses {' '.join(harnesses)}: the --agent-cmd has no {{harness}} placeholder to "
                         "take them")


@dataclass
class AgentProcess:
    key: str
    row: dict
    group: int
    result: Path
    process: subprocess.Popen
    harness: str = ""  # what {harness} was (mixed harnesses in one run)
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


def start_agent(command: str, base_url: str, row: dict, group: int, workdir: Path, log,
                harness: str = "") -> AgentProcess:
    """Run `command` (placeholders filled in, shell-quoted; {harness} is `harness`) with bash in a new process group,
    stdout and stderr to `log`. Its environment is the trainer's less WITHHELD_ENV, plus OPENAI_BASE_URL,
    OPENAI_API_KEY, KILN_ROW_FILE and KILN_RESULT_FILE."""
    key = f"kiln-{uuid.uuid4().hex}"
    row_file, result = workdir / f"{key}.row.json", workdir / f"{key}.result"
    row_json = json.dumps(agent_view(row))
    row_file.write_text(row_json)
    values = {"base_url": base_url, "api_key": key, "row_json": row_json, "row_file": str(row_file),
              "result": str(result), "harness": harness}
    line = command.format(**{k: shlex.quote(v) for k, v in values.items()})
    env = {k: v for k, v in os.environ.items() if not WITHHELD_ENV.fullmatch(k)} | {
        "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": key, "KILN_ROW_FILE": str(row_file),
        "KILN_RESULT_FILE": str(result)}
    process = subprocess.Popen(["bash", "-c", line], env=env, stdin=subprocess.DEVNULL, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    return AgentProcess(key, row, group, result, process, harness)


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process's group (the agent and everything it started) and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
