"""Rollout wall time of agent trajectories: lockstep (every turn of every trajectory in one engine call, then every
tool call, then the next turn) against independent trajectories (rollout.run_trajectories). Goal: >= 2.5x.

Workload: SWE-agent-like, with the distributions issue 30 states (its simulation's parameters, not a recording of
ours): per trajectory, turns lognormal with median 16 (sigma 0.4, 2 to 40); per turn a reply of lognormal length,
median 200 tokens (sigma 1.0, at most 4096), ending in one `bash` call but the last turn, and a tool call of lognormal
time, median 0.3 s (sigma 1.7: one call in a thousand over 50 s, at most 60 s), printing lognormal output (median 30
characters). On a GPU a decoding step takes 20-40 ms.

Measured: the real rollout loop (rollout.multi_turn) with the tiny model (tiny.make_tiny_model) on the HF engine,
scaled down `--scale` times: replies 1/scale as long, and tool times 1/scale as long counted in decoding steps (a
tool's seconds times this machine's step time over a GPU's 30 ms, measured first). The engine decodes each call for
as many steps as its longest scripted reply (its real cost: a batch lasts as long as its longest reply); each reply
is then the script's tokens (a filler and the call: a random tiny model writes no tool calls) with the logprobs the
engine sampled. Both schedules run the same plan, in this one process, lockstep first.

Simulated (--simulate): the unscaled workload on a GPU, in an event simulation: lockstep; independent with one
engine call per batch of ready trajectories (as the HF engine does); independent with continuous batching (vLLM,
each reply as long as its own tokens), each at 20 and 40 ms a decoding step.

    .venv/bin/python bench/agent_rollout.py [--trajectories 64 --scale 8 --seed 0]
    .venv/bin/python bench/agent_rollout.py --simulate
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import os
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import tyro

import chat
import engines
import policy
import rollout
import tiny
import tools

GPU_STEP_SECONDS = 0.030  # a memory-bound decoding step of a 7B-32B policy (issue 30: 20-40 ms)
CORPUS = ["step " * 8, "the file is fixed now", '{"name": "bash", "arguments": {"command": "pytest -x"}}'] * 20


@dataclass
class Args:
    trajectories: int = 64
    """trajectories in the rollout (one GRPO step's worth)"""
    scale: float = 8.0
    """replies and tool times (in decoding steps) are 1/scale of the workload's"""
    seed: int = 0
    """seed of the plan (turns, lengths, times) and of sampling"""
    simulate: bool = False
    """print the event simulation of the unscaled workload on a GPU instead of running the loop"""
    threads: int = 1
    """torch threads (the dev machine is shared: 1)"""
    step_ms: float | None = None
    """this machine's decoding step for the tool-time scaling, fixed (default: measured at the start, which follows
    the machine's load at that moment)"""


@dataclass
class Turn:
    reply_tokens: int
    tool_seconds: float  # on a GPU machine, unscaled
    output_chars: int


def plan(trajectories: int, seed: int) -> list[list[Turn]]:
    """Each trajectory's turns, drawn from the workload's distributions."""
    rng = random.Random(seed)

    def lognormal(median: float, sigma: float) -> float:
        return median * math.exp(rng.gauss(0.0, sigma))

    return [[Turn(min(4096, max(1, round(lognormal(200, 1.0)))), min(60.0, lognormal(0.3, 1.7)),
                  max(1, round(lognormal(30, 1.0))))
             for _ in range(min(40, max(2, round(lognormal(16, 0.4)))))]
            for _ in range(trajectories)]


# The real loop.


class ScriptedReplies:
    """An engine around the HF engine: each call decodes for as many steps as the longest reply the plan gives its
    prompts (no stop token: the real cost of the batch), then each prompt gets its planned reply: filler tokens and a
    `bash` call (none on the last turn), `tokens` long with its end-of-turn token, and the logprobs sampled."""

    def __init__(self, engine: engines.HFEngine, tokenizer, turns: list[list[int]]):
        self.engine, self.tokenizer, self.turns = engine, tokenizer, turns
        self.eot = tokenizer.convert_tokens_to_ids(chat.end_of_turn(tokenizer))
        self.start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.call = tokenizer('<tool_call>\n{"name": "bash", "arguments": {"command": "pytest -x"}}\n</tool_call>',
                              add_special_tokens=False)["input_ids"]
        self.filler = tokenizer("step", add_special_tokens=False)["input_ids"][:1]
        self.done = tokenizer("the file is fixed now", add_special_tokens=False)["input_ids"]
        self.first: dict[int, int] = {}

    def generate(self, prompts, sampling):
        replies = []
        for prompt in prompts:
            task = int(re.search(r"task-(\d+)", self.tokenizer.decode(prompt[:64])).group(1))
            opened = self.first.setdefault(task, prompt.count(self.start))  # the prompt's turns
            turn = (prompt.count(self.start) - opened) // 2  # then each turn adds a tool message and a header
            last = turn == len(self.turns[task]) - 1
            tail = self.done if last else self.call
            body = max(0, self.turns[task][turn] - len(tail) - 1)
            replies.append(self.filler * body + tail + [self.eot])
        steps = min(max(len(r) for r in replies), sampling.max_new_tokens)
        real = self.engine.generate(prompts, dataclasses.replace(sampling, max_new_tokens=steps, stop_token_ids=[]))
        return [engines.Completion(r[:steps], c.logprobs[: len(r[:steps])], "stop" if len(r) <= steps else "length")
                for r, c in zip(replies, real)]


def toolbox(times: list[list[float]], outputs: list[list[int]]):
    """A `bash` tool per trajectory whose k-th call takes times[task][k] seconds and prints outputs[task][k]
    characters."""
    def new_toolbox(row):
        task, calls = int(row["prompt"][0]["content"].split("-")[1].split(":")[0]), []

        def bash(arguments):
            k = len(calls)
            calls.append(k)
            time.sleep(times[task][k])
            return tools.ToolResult("ok " * (outputs[task][k] // 3))
        return tools.ToolBox({"bash": bash}, [])
    return new_toolbox


def step_seconds(engine: engines.HFEngine, rows: int) -> float:
    """This machine's decoding step, at `rows` rows of a 300-token prompt (the median step of the run)."""
    prompts = [[7 + (i % 50)] * 300 for i in range(rows)]
    engine.generate(prompts, engines.Sampling(max_new_tokens=4))  # warm-up
    start = time.perf_counter()
    engine.generate(prompts, engines.Sampling(max_new_tokens=65, stop_token_ids=[]))
    middle = time.perf_counter()
    engine.generate(prompts, engines.Sampling(max_new_tokens=1, stop_token_ids=[]))
    return max(1e-4, ((middle - start) - (time.perf_counter() - middle)) / 64)


def run(args: Args) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model_dir = tiny.make_tiny_model(tempfile.mkdtemp(prefix="kiln-bench-"), CORPUS, max_position_embeddings=32768)
    tokenizer, model = policy.load_tokenizer(model_dir), policy.load_model(model_dir)
    engine = engines.HFEngine(model, tokenizer.pad_token_id, batch_size=args.trajectories)
    step = args.step_ms / 1000 if args.step_ms else step_seconds(engine, min(16, args.trajectories))
    workload = plan(args.trajectories, args.seed)
    lengths = [[max(8, round(t.reply_tokens / args.scale)) for t in turns] for turns in workload]
    times = [[t.tool_seconds * step / GPU_STEP_SECONDS / args.scale for t in turns] for turns in workload]
    outputs = [[t.output_chars for t in turns] for turns in workload]
    rows = [{"prompt": [{"role": "user", "content": f"task-{i}: make the tests pass"}]} for i in range(len(workload))]
    limits = rollout.AgentLimits(max_turns=64, max_total_tokens=32768, max_tool_response_tokens=64)
    sampling = engines.Sampling(max_new_tokens=4096, temperature=1.0)
    print(f"{args.trajectories} trajectories, {sum(map(len, workload))} turns, scale 1/{args.scale:g}: replies "
          f"{sum(map(sum, lengths))} tokens (median {statistics.median(x for t in lengths for x in t):.0f}), tools "
          f"{sum(map(sum, times)):.1f} s in all; decoding step here {step * 1000:.1f} ms at 16 rows "
          f"(GPU {GPU_STEP_SECONDS * 1000:.0f} ms)")
    seconds = {}
    for lockstep in (True, False):
        scripted = ScriptedReplies(engine, tokenizer, lengths)
        start = time.perf_counter()
        samples, metrics = rollout.multi_turn(scripted, tokenizer, rows, 1, sampling, toolbox(times, outputs), limits,
                                              lockstep=lockstep)
        name = "lockstep" if lockstep else "independent"
        seconds[name] = time.perf_counter() - start
        turns = [s.info["turns"] for s in samples]
        if turns != [len(t) for t in workload]:
            raise RuntimeError(f"trajectories ran other turns than planned: {turns} ({[s.finish_reason for s in samples]}"
                               f") for {[len(t) for t in workload]}")
        print(f"{name:>11}: {seconds[name]:7.1f} s  engine calls {metrics['rollout/engine_calls']:.0f}, "
              f"{metrics['rollout/in_flight_mean']:.1f} trajectories a call, engine busy "
              f"{metrics['rollout/engine_busy_frac']:.0%}, tools busy {metrics['tools/busy_frac']:.0%}, "
              f"most tool calls at once {metrics['tools/running_max']:.0f}")
    print(f"lockstep / independent: {seconds['lockstep'] / seconds['independent']:.2f}x (goal >= 2.5x)")


# The event simulation.


def simulate_lockstep(workload: list[list[Turn]], step: float) -> float:
    """Each turn: one engine call as long as the longest reply of the live trajectories, then their slowest tool."""
    total, turn = 0.0, 0
    while live := [turns for turns in workload if turn < len(turns)]:
        total += max(t[turn].reply_tokens for t in live) * step
        total += max((t[turn].tool_seconds for t in live if turn < len(t) - 1), default=0.0)
        turn += 1
    return total


def simulate_per_call(workload: list[list[Turn]], step: float) -> float:
    """Independent trajectories, one engine call at a time for all that are ready, as long as its longest reply."""
    now, ready, tools_out, turn = 0.0, list(range(len(workload))), [], [0] * len(workload)
    while ready or tools_out:
        if not ready:
            now, task = heapq.heappop(tools_out)
            ready.append(task)
        while tools_out and tools_out[0][0] <= now:
            ready.append(heapq.heappop(tools_out)[1])
        now += max(workload[task][turn[task]].reply_tokens for task in ready) * step
        for task in ready:
            if turn[task] < len(workload[task]) - 1:
                heapq.heappush(tools_out, (now + workload[task][turn[task]].tool_seconds, task))
                turn[task] += 1
        ready = []
    return now


def simulate_continuous(workload: list[list[Turn]], step: float) -> float:
    """Independent trajectories on a continuous-batching engine: each reply as long as its own tokens."""
    return max(sum(t.reply_tokens * step + (t.tool_seconds if k < len(turns) - 1 else 0.0)
                   for k, t in enumerate(turns)) for turns in workload)


def simulate(args: Args) -> None:
    print(f"{args.trajectories} trajectories, unscaled workload; seconds (lockstep / independent)")
    for seed in range(args.seed, args.seed + 5):
        workload = plan(args.trajectories, seed)
        cells = []
        for step in (0.020, 0.040):
            lock, per_call, cont = (f(workload, step) for f in (simulate_lockstep, simulate_per_call,
                                                                  simulate_continuous))
            cells.append(f"{step * 1000:.0f} ms: lockstep {lock:6.0f}, per call {per_call:6.0f} ({lock / per_call:.2f}x),"
                         f" continuous {cont:6.0f} ({lock / cont:.2f}x)")
        print(f"seed {seed}: " + "; ".join(cells))


if __name__ == "__main__":
    args = tyro.cli(Args)
    simulate(args) if args.simulate else run(args)
