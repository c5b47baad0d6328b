"""Long trajectories as real SWE agents run them (issue 47): what kiln spends outside the model per turn, from turn 1
to turn 90, on both agent paths. Goal: turn 90's overhead at most 1.5x turn 1's, total overhead linear in length.

Workload: one trajectory of --turns turns; each turn the policy replies with a short `bash` tool call (about 40
tokens with its end-of-turn token) and the tool prints about --tool-tokens tokens (different text every turn), so
that ~700 tokens are added per turn and 90 turns make ~64K tokens (the tiny tokenizer of tiny.py, its model built
with room for them). The engine is `ForcedEngine`: it answers each turn with the scripted reply's ids at once and
times itself, so that what is measured is kiln's own work and nothing of the model's.

- tool loop: rollout.multi_turn (kiln's own agent loop). A turn's overhead is the time from the engine's return of
  reply k to its call for reply k+1: parsing the reply, running the (instant) tool on the thread pool, cutting and
  tokenizing its output, the template's suffix ids, masks and bookkeeping, building the next prompt.
- endpoint: agent_server.AgentServer on 127.0.0.1 driven by an OpenAI-style client that sends the whole conversation
  each turn, as agents do: plain HTTP and JSON (`raw_client`), and one trajectory through the OpenAI SDK. Per turn:
  kiln's server side (from the request's arrival at the engine loop to its recorded reply, less the engine: segment
  matching, the template's suffix ids, masks, bookkeeping) and the round trip the client sees less the engine (HTTP,
  JSON both ways, the client's own work: grows with the conversation the protocol sends each turn, whoever serves
  it; the SDK's request building grows most).

Kiln's numbers are CPU seconds of the thread doing the work (time.thread_time: the rank's main thread, the endpoint's
engine loop), so that other jobs on a shared machine do not inflate them; the round trip is wall time. Each turn's
number is the median over --repeats trajectories and over 5 turns around it (turns 1-5 for turn 1, 28-32 for turn
30, ...); the total over all turns is compared with the total over the first half (2x: linear). The check_tito of
the finished trajectory (run once, at its end) is timed apart. Peak RSS is this process's, which runs both paths.

    .venv/bin/python bench/long_horizon.py [--turns 90 --tool-tokens 660 --repeats 3]
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openai
import torch
import tyro

import agent_server
import chat
import engines
import policy
import rollout
import tiny
import tools

CORPUS = ["Let me look at the failing test first.", '{"name": "bash", "arguments": {"command": "grep -n x a.py"}}',
          "def parse(line):\n    return line.split(',')\n", "FAILED tests/test_a.py::test_x - AssertionError"] * 20
BASH = {"type": "function", "function": {"name": "bash", "description": "run a command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
CHECKPOINTS = (1, 30, 60, 90)


@dataclass
class Args:
    turns: int = 90
    """assistant turns of each trajectory that take tool results (one more closes it)"""
    tool_tokens: int = 660
    """tokens each tool output adds (with the reply, ~700 a turn)"""
    repeats: int = 3
    """trajectories per path; each turn's overhead is the median over them"""
    threads: int = 1
    """torch threads (the dev machine is shared)"""


def tiny_long_model(directory: Path, max_positions: int = 131072):
    """The tiny model of tiny.py with room for a 64K-token trajectory, and its tokenizer."""
    path = tiny.make_tiny_model(directory, CORPUS, max_position_embeddings=max_positions)
    return path, policy.load_tokenizer(path)


def tool_outputs(tokenizer, turns: int, tokens: int) -> list[str]:
    """Each turn's tool printout (computed before anything is timed): about `tokens` tokens, different every turn
    (numbered source lines, as `cat -n` prints)."""
    line = "def parse_{k}(line):  return line.split(',')"
    sample = "\n".join(f"{1000 + k:6d}\t" + line.format(k=k) for k in range(20))
    per_line = len(tokenizer(sample, add_special_tokens=False)["input_ids"]) / 20
    return ["\n".join(f"{turn * 1000 + k:6d}\t" + line.format(k=k) for k in range(max(1, round(tokens / per_line))))
            for turn in range(turns + 2)]


def reply_text(turn: int, last: bool) -> str:
    if last:
        return "The test passes now."
    return "Let me look.\n<tool_call>\n" + json.dumps({"name": "bash", "arguments": {
        "command": f"grep -n parse_{turn} a.py"}}) + "\n</tool_call>"


class ForcedEngine:
    """An engine that replies turn k of its (single) trajectory with the scripted reply's ids and the end-of-turn token
    at once, logprob -1 each, and times itself (`seconds`, one entry per call): kiln's work is what remains."""

    def __init__(self, tokenizer, turns: int):
        self.tokenizer, self.turns = tokenizer, turns
        self.eot = tokenizer.convert_tokens_to_ids(chat.end_of_turn(tokenizer))
        self.calls: list[tuple[float, float]] = []  # (entered, returned): CPU seconds of the calling thread
        self.emitted: list[list[int]] = []  # each call's reply ids

    def generate(self, prompts, sampling, seeds=None):
        entered = time.thread_time()
        out = []
        for _ in prompts:
            turn = len(self.calls)
            ids = self.tokenizer(reply_text(turn, turn == self.turns), add_special_tokens=False)["input_ids"]
            ids = (ids + [self.eot])[: sampling.max_new_tokens]
            out.append(engines.Completion(ids, [-1.0] * len(ids), "stop" if ids[-1] == self.eot else "length"))
            self.emitted.append(ids)
        self.calls.append((entered, time.thread_time()))
        return out

    def load_weights(self, weights):
        return None

    def sleep(self):
        return None

    def wake_up(self):
        return None


def forced_toolbox(outputs: list[str]):
    """A `bash` tool whose k-th call prints outputs[k] at once."""
    def new_toolbox(row):
        calls = []

        def bash(arguments):
            calls.append(arguments)
            return tools.ToolResult(outputs[len(calls)])
        return tools.ToolBox({"bash": bash}, [BASH])
    return new_toolbox


def long_row() -> dict:
    return {"data_source": "toy", "prompt": [{"role": "system", "content": "You fix code."},
                                             {"role": "user", "content": "Make tests/test_a.py pass."}],
            "reward_model": {"style": "rule", "ground_truth": "{}"}, "extra_info": {"index": 0}}


def limits(turns: int, max_total_tokens: int = 131072) -> rollout.AgentLimits:
    return rollout.AgentLimits(max_turns=turns + 1, max_total_tokens=max_total_tokens, max_tool_response_tokens=4096)


def tool_loop_trajectory(tokenizer, turns: int, outputs: list[str], max_total_tokens: int = 131072,
                         engine: ForcedEngine | None = None) -> tuple[rollout.Sample, list[float]]:
    """One tool-loop trajectory; per turn k (1..turns), kiln's seconds from reply k to the call for reply k+1."""
    engine = engine or ForcedEngine(tokenizer, turns)
    (sample,), _ = rollout.multi_turn(engine, tokenizer, [long_row()], 1, engines.Sampling(max_new_tokens=256),
                                      forced_toolbox(outputs), limits(turns, max_total_tokens))
    return sample, [engine.calls[k][0] - engine.calls[k - 1][1] for k in range(1, len(engine.calls))]


class TimedServer(agent_server.AgentServer):
    """The endpoint, stamping when each request reaches the engine loop and when its reply is recorded."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.stamps: list[tuple[float, float]] = []

    def _prepare(self, request):
        taken = time.thread_time()
        request.reply.add_done_callback(lambda _: self.stamps.append((taken, time.thread_time())))
        return super()._prepare(request)


def raw_client(base_url: str, key: str):
    """A chat-completions call as plain HTTP and JSON (what any OpenAI-style agent sends), without the OpenAI SDK's
    own per-request work: the message it returns, or the refusal's code."""
    def create(messages: list[dict]) -> tuple[dict | None, str | None]:
        body = json.dumps({"model": "kiln", "messages": messages, "tools": [BASH]}).encode()
        request = urllib.request.Request(f"{base_url}/chat/completions", data=body, headers={
            "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request) as response:
                return json.loads(response.read())["choices"][0]["message"], None
        except urllib.error.HTTPError as e:
            return None, json.loads(e.read())["error"]["code"]
    return create


def sdk_client(base_url: str, key: str):
    """The same call through the OpenAI SDK."""
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)

    def create(messages: list[dict]) -> tuple[dict | None, str | None]:
        try:
            reply = client.chat.completions.create(model="kiln", messages=messages, tools=[BASH])
        except openai.BadRequestError as e:
            return None, e.code
        return reply.choices[0].message.model_dump(exclude_none=True), None
    return create


def endpoint_trajectory(tokenizer, turns: int, outputs: list[str], max_total_tokens: int = 131072,
                        engine: ForcedEngine | None = None, client=sdk_client
                        ) -> tuple[agent_server.Segment, list[float], list[float], str | None]:
    """One session through the endpoint driven by `client` (the OpenAI SDK, or raw_client), which stops at a reply
    without a tool call or a refusal; per request: kiln's server-side seconds and the client's round trip, each less
    the engine's time; and the refusal's code (None without one)."""
    engine = engine or ForcedEngine(tokenizer, turns)
    server = TimedServer(engine, tokenizer, engines.Sampling(max_new_tokens=256), max_total_tokens=max_total_tokens)
    running, refused = True, None

    def loop():
        while running:
            server.step()
    thread = threading.Thread(target=loop, daemon=True)
    with server:
        thread.start()
        try:
            create = client(server.base_url, "long")
            messages = [m for m in long_row()["prompt"]]
            trips = []
            for turn in range(turns + 1):
                began = time.perf_counter()
                message, refused = create(messages)
                if refused:
                    break
                trips.append(time.perf_counter() - began)
                messages.append(message)
                if not message.get("tool_calls"):
                    break
                messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                                 "content": outputs[turn + 1]})
            (segment,) = server.sessions["long"]
        finally:
            running = False
            thread.join()
    model = [returned - entered for entered, returned in engine.calls]
    served = [(done - taken) - m for (taken, done), m in zip(server.stamps, model)]
    return segment, served, [trip - m for trip, m in zip(trips, model)], refused


def around(per_turn: list[list[float]], turn: int) -> float:
    """The median over repeats and 5 turns around `turn` (1-based; the window kept inside the trajectory)."""
    first = min(max(1, turn - 2), len(per_turn[0]) - 4)
    return statistics.median(x for run in per_turn for x in run[first - 1: first + 4])


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def print_path(name: str, per_turn: list[list[float]], turns: int) -> tuple[float, float]:
    """Prints a path's per-turn overhead; returns turn 90 / turn 1, and the total over all turns / the total over the
    first half (2 when the total is linear in the length, 4 when quadratic)."""
    cells = {k: around(per_turn, k) for k in CHECKPOINTS if k <= turns}
    total = statistics.median(sum(run[:turns]) for run in per_turn)
    half = statistics.median(sum(run[: turns // 2]) for run in per_turn)
    first, last = cells[min(cells)], cells[max(cells)]
    print(f"{name:>24}: " + ", ".join(f"turn {k} {v * 1000:6.2f} ms" for k, v in cells.items())
          + f"; turn {max(cells)} / turn 1 {last / first:.2f}x; all turns {total:.2f} s, {total / half:.2f}x the "
          f"first half's")
    return last / first, total / half


def per_turn_section(args: Args) -> dict:
    """Per-turn overhead of both paths, and check_tito once per finished trajectory."""
    with tempfile.TemporaryDirectory() as tmp:
        _, tokenizer = tiny_long_model(Path(tmp))
    outputs = tool_outputs(tokenizer, args.turns, args.tool_tokens)
    loop_turns, loop_tito, served_turns, trip_turns, served_tito = [], [], [], [], []
    for _ in range(args.repeats):
        sample, overhead = tool_loop_trajectory(tokenizer, args.turns, outputs)
        loop_turns.append(overhead)
        began = time.thread_time()
        findings = chat.check_tito(tokenizer, sample, sample.info["messages"], sample.info["tools"])
        loop_tito.append(time.thread_time() - began)
        if findings:
            raise RuntimeError(f"tool loop: check_tito found {findings}")
    tokens = len(sample.ids)
    print(f"tool loop: {args.turns + 1} assistant turns, {tokens} tokens, {sum(sample.loss_mask)} sampled; "
          f"peak RSS {peak_rss_mib():.0f} MiB")
    ratio_loop, total_loop = print_path("tool loop", loop_turns, args.turns)
    print(f"{'check_tito at the end':>24}: {statistics.median(loop_tito) * 1000:.1f} ms")
    for _ in range(args.repeats):
        segment, served, trips, _ = endpoint_trajectory(tokenizer, args.turns, outputs, client=raw_client)
        served_turns.append(served[1:])  # request k+1 carries turn k's tool output
        trip_turns.append(trips[1:])
        began = time.thread_time()
        findings = chat.check_tito(tokenizer, segment, segment.messages, segment.tools, open_turns=segment.open_turns)
        served_tito.append(time.thread_time() - began)
        if findings:
            raise RuntimeError(f"endpoint: check_tito found {findings}")
    print(f"endpoint: {len(segment.turns)} requests, {len(segment.ids)} tokens, {sum(segment.loss_mask)} sampled; "
          f"peak RSS {peak_rss_mib():.0f} MiB")
    ratio_served, total_served = print_path("endpoint, kiln's side", served_turns, args.turns)
    ratio_trip, _ = print_path("round trip, plain HTTP", trip_turns, args.turns)
    _, _, sdk_trips, _ = endpoint_trajectory(tokenizer, args.turns, outputs, client=sdk_client)
    ratio_sdk, _ = print_path("round trip, OpenAI SDK", [sdk_trips[1:]], args.turns)
    print(f"{'check_tito at the end':>24}: {statistics.median(served_tito) * 1000:.1f} ms")
    return {"turn90_over_turn1": {"tool_loop": round(ratio_loop, 3), "endpoint": round(ratio_served, 3)},
            "total_over_first_half": {"tool_loop": round(total_loop, 3), "endpoint": round(total_served, 3)},
            "round_trip_turn90_over_turn1": {"plain_http": round(ratio_trip, 3), "openai_sdk": round(ratio_sdk, 3)},
            "tokens": tokens,
            "peak_rss_mib": round(peak_rss_mib()), "turns": args.turns}


def main(args: Args) -> dict:
    """Each section is a function that returns its headline keys for RESULT: per_turn_section here
    (`turn90_over_turn1`, per path); issue 47's update side adds forwarded_tokens_section (`forwarded_per_trained`:
    before, after) and sequence_parallel_section (`sp_max_rel_err`) the same way."""
    torch.set_num_threads(args.threads)
    result = per_turn_section(args)
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(tyro.cli(Args))))
