"""Rollout wall time of agent trajectories: lockstep (every turn of every trajectory in one engine call, then every
tool call, then the next turn) against independent trajectories (rollout.run_trajectories). Goal: >= 2.5x.

Workload: SWE-agent-like, with the distributions issue 30 states (its simulation's parameters, not a recording of
ours): per trajectory, turns lognormal with median 16 (sigma 0.4, 2 to 40); per turn a reply of lognormal length,
median 200 tokens (sigma 1.0, at most 4096), ending in one `bash` call but the last turn, and a tool call of lognormal
time, median 0.3 s (sigma 1.7: one call in a thousand over 50 s, at most 60 s), printing lognormal output (median 30
characters). On a GPU a decoding step takes 20-40 ms.

Measured: the real rollout loop (rollout.multi_turn) with the tiny model (tiny.make_tiny_model) on the HF engine,
scaled down `--scale` times: replies 1/scale as long, and tool times 1/scale as long counted in decoding steps (a
tool's seconds times this machine's step time over a GPU's 30 ms, measured first). Each reply is the script's tokens
(a filler and the call: a random tiny model writes no tool calls) with the logprobs the engine sampled. Three
schedules run the same plan, in this one process: lockstep; independent trajectories with an engine call per batch
of ready ones, each call decoding as many steps as its longest reply (its real cost); independent trajectories
through the HF engine's continuous batch (HFEngine.submit/step), each turn decoding its own reply's steps.

Simulated (--simulate): the unscaled workload on a GPU, in an event simulation: lockstep; independent with one
engine call per batch of ready trajectories (as the HF engine does); independent with continuous batching (vLLM,
each reply as long as its own tokens), each at 20 and 40 ms a decoding step.

Long tail (--long-tail): GRPO steps of --groups groups of --group-size trajectories, each trajectory --turns turns but
one in ten (drawn per trajectory) 10x as many; replies, tool times and outputs per turn drawn and scaled as above.
Step time (the rollout phase; the update is the same work at equal trained groups) without partial rollouts (every
step's groups to their end) against with them (partial_rollouts.InFlight: twice the groups in flight, a step ends once
it holds --groups complete groups, unfinished trajectories carried, restarted past staleness 1), --steps steps each on
the same plan (a restarted trajectory replays its own), the two alternating step by step. Goal: >= 1.5x. On this CPU
a decoding step costs more with more rows, and partial rollouts batch twice the trajectories; --fixed-step-ms gives
the engine a GPU's cost shape (a step costs the same at any rows) in the same loop.

    .venv/bin/python bench/agent_rollout.py [--trajectories 64 --scale 8 --seed 0]
    .venv/bin/python bench/agent_rollout.py --simulate
    .venv/bin/python bench/agent_rollout.py --long-tail [--steps 8 --groups 4 --group-size 4 --turns 4]
    .venv/bin/python bench/agent_rollout.py --long-tail --fixed-step-ms 5 [--continuous]
"""
from __future__ import annotations

import dataclasses
import heapq
import json
import math
import os
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import tyro

import chat
import engines
import partial_rollouts
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
    long_tail: bool = False
    """run the long-tail variant: step time with partial rollouts against without"""
    steps: int = 8
    """long tail: steps of each variant"""
    groups: int = 4
    """long tail: groups trained per step"""
    group_size: int = 4
    """long tail: trajectories per group"""
    turns: int = 4
    """long tail: turns of a trajectory (one in ten takes 10x as many)"""
    fixed_step_ms: float | None = None
    """long tail: instead of decoding with the tiny model, each engine call waits this many ms per decoding step
    whatever its rows (a memory-bound GPU's cost shape, which the CPU's does not have); tools scale to it"""
    continuous: bool = False
    """long tail: both variants' turns through a continuous batch (HFEngine.submit/step; with --fixed-step-ms, steps
    of that cost whatever the rows) instead of an engine call per batch of ready trajectories"""


@dataclass
class Turn:
    reply_tokens: int
    tool_seconds: float  # on a GPU machine, unscaled
    output_chars: int


def lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def draw_turn(rng: random.Random) -> Turn:
    return Turn(min(4096, max(1, round(lognormal(rng, 200, 1.0)))), min(60.0, lognormal(rng, 0.3, 1.7)),
                max(1, round(lognormal(rng, 30, 1.0))))


def plan(trajectories: int, seed: int) -> list[list[Turn]]:
    """Each trajectory's turns, drawn from the workload's distributions."""
    rng = random.Random(seed)
    return [[draw_turn(rng) for _ in range(min(40, max(2, round(lognormal(rng, 16, 0.4)))))]
            for _ in range(trajectories)]


def long_tail_plan(groups: int, group_size: int, turns: int, seed: int) -> dict[tuple[int, int], list[Turn]]:
    """The turns of trajectory (group, index in the group): `turns`, or for one in ten 10x as many."""
    rng = random.Random(seed)
    return {(g, i): [draw_turn(rng) for _ in range(turns * (10 if rng.random() < 0.1 else 1))]
            for g in range(groups) for i in range(group_size)}


# The real loop.


class ScriptedReplies:
    """An engine around the HF engine: each call decodes for as many steps as the longest reply the plan gives its
    prompts (no stop token: the real cost of the batch), then each prompt gets its planned reply: filler tokens and a
    `bash` call (none on the last turn), `tokens` long with its end-of-turn token, and the logprobs sampled. With
    `continuous`, through the HF engine's continuous batch instead: each turn decodes as many steps as its own reply,
    beside whatever else is being decoded, and comes back at its last one."""

    def __init__(self, engine: engines.HFEngine, tokenizer, turns: list[list[int]], continuous: bool = False):
        self.engine, self.tokenizer, self.turns, self.continuous = engine, tokenizer, turns, continuous
        self.submitted: dict[object, list[int]] = {}
        self.eot = tokenizer.convert_tokens_to_ids(chat.end_of_turn(tokenizer))
        self.start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.call = tokenizer('<tool_call>\n{"name": "bash", "arguments": {"command": "pytest -x"}}\n</tool_call>',
                              add_special_tokens=False)["input_ids"]
        self.filler = tokenizer("step", add_special_tokens=False)["input_ids"][:1]
        self.done = tokenizer("the file is fixed now", add_special_tokens=False)["input_ids"]
        self.first: dict[int, int] = {}

    def planned(self, prompt: list[int]) -> list[int]:
        task = int(re.search(r"task-(\d+)", self.tokenizer.decode(prompt[:64])).group(1))
        opened = self.first.setdefault(task, prompt.count(self.start))  # the prompt's turns
        turn = (prompt.count(self.start) - opened) // 2  # then each turn adds a tool message and a header
        tail = self.done if turn == len(self.turns[task]) - 1 else self.call
        return self.filler * max(0, self.turns[task][turn] - len(tail) - 1) + tail + [self.eot]

    def submit(self, key, prompt, sampling, seed=None):
        reply = self.planned(prompt)[: sampling.max_new_tokens]
        self.submitted[key] = reply
        self.engine.submit(key, prompt, dataclasses.replace(sampling, max_new_tokens=len(reply), stop_token_ids=[]),
                           seed)

    def step(self):
        finished = []
        for key, real in self.engine.step():
            reply = self.submitted.pop(key)
            finished.append((key, engines.Completion(reply, real.logprobs, "stop" if reply[-1] == self.eot else
                                                     "length")))
        return finished

    def abort(self):
        self.engine.abort()
        self.submitted = {}

    def generate(self, prompts, sampling):
        replies = [self.planned(prompt) for prompt in prompts]
        steps = min(max(len(r) for r in replies), sampling.max_new_tokens)
        real = self.engine.generate(prompts, dataclasses.replace(sampling, max_new_tokens=steps, stop_token_ids=[]))
        return [engines.Completion(r[:steps], c.logprobs[: len(r[:steps])], "stop" if len(r) <= steps else "length")
                for r, c in zip(replies, real)]


class SeededReplies:
    """The long-tail variant's engine: each prompt's trajectory (group, index) and turn are read off its seed (the
    rollout derives it from them: rollout.sample_seeds), and it decodes as ScriptedReplies does; the reply is the
    plan's, its `bash` call naming the trajectory and the turn (for the tool's time), none on the last turn."""

    def __init__(self, engine: engines.HFEngine, tokenizer, lengths: dict[tuple[int, int], list[int]], seed: int,
                 fixed_step: float | None = None, continuous: bool = False):
        self.engine, self.tokenizer, self.lengths, self.fixed_step = engine, tokenizer, lengths, fixed_step
        self.continuous, self.submitted = continuous, {}  # key -> [reply, decoding steps left]
        self.keys = {engines.derive_seed(seed, g, i, t): (g, i, t) for (g, i), turns in lengths.items()
                     for t in range(len(turns))}
        self.eot = tokenizer.convert_tokens_to_ids(chat.end_of_turn(tokenizer))
        self.filler = tokenizer("step", add_special_tokens=False)["input_ids"][:1]
        self.done = tokenizer("the file is fixed now", add_special_tokens=False)["input_ids"]

    def reply(self, g: int, i: int, t: int) -> list[int]:
        tail = self.done if t == len(self.lengths[g, i]) - 1 else self.tokenizer(
            f'<tool_call>\n{{"name": "bash", "arguments": {{"command": "test {g} {i} {t}"}}}}\n</tool_call>',
            add_special_tokens=False)["input_ids"]
        return self.filler * max(0, self.lengths[g, i][t] - len(tail) - 1) + tail + [self.eot]

    def submit(self, key, prompt, sampling, seed):
        reply = self.reply(*self.keys[seed])[: sampling.max_new_tokens]
        self.submitted[key] = [reply, len(reply)]
        if self.fixed_step is None:
            self.engine.submit(key, prompt, dataclasses.replace(sampling, max_new_tokens=len(reply), stop_token_ids=[]),
                               seed)

    def step(self):
        if self.fixed_step is not None:  # one step of the same cost for any rows; each turn its own reply's steps
            time.sleep(self.fixed_step)
            for entry in self.submitted.values():
                entry[1] -= 1
            real = [(key, [-1.0] * len(entry[0])) for key, entry in self.submitted.items() if entry[1] == 0]
        else:
            real = [(key, completion.logprobs) for key, completion in self.engine.step()]
        finished = []
        for key, logprobs in real:
            reply = self.submitted.pop(key)[0]
            finished.append((key, engines.Completion(reply, logprobs, "stop" if reply[-1] == self.eot else "length")))
        return finished

    def abort(self):
        self.engine.abort()
        self.submitted = {}

    def generate(self, prompts, sampling, seeds):
        replies = [self.reply(*self.keys[seed]) for seed in seeds]
        steps = min(max(len(r) for r in replies), sampling.max_new_tokens)
        if self.fixed_step is not None:  # a GPU's cost shape: the call's steps, whatever its rows
            time.sleep(steps * self.fixed_step)
            real = [engines.Completion([], [-1.0] * steps, "length") for _ in replies]
        else:
            real = self.engine.generate(prompts, dataclasses.replace(sampling, max_new_tokens=steps,
                                                                     stop_token_ids=[], seed=None))
        return [engines.Completion(r[:steps], c.logprobs[: len(r[:steps])], "stop" if len(r) <= steps else "length")
                for r, c in zip(replies, real)]


def seeded_toolbox(times: dict[tuple[int, int], list[float]], outputs: dict[tuple[int, int], list[int]]):
    """A `bash` tool whose call `test g i t` takes times[g, i][t] seconds and prints outputs[g, i][t] characters."""
    def new_toolbox(row):
        def bash(arguments):
            g, i, t = map(int, arguments["command"].split()[1:])
            time.sleep(times[g, i][t])
            return tools.ToolResult("ok " * (outputs[g, i][t] // 3))
        return tools.ToolBox({"bash": bash}, [])
    return new_toolbox


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


def tiny_engine(args: Args, rows: int) -> tuple[object, engines.HFEngine, float]:
    """The tokenizer, the tiny model's HF engine taking `rows` prompts a call, and this machine's decoding step."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model_dir = tiny.make_tiny_model(tempfile.mkdtemp(prefix="kiln-bench-"), CORPUS, max_position_embeddings=32768)
    tokenizer, model = policy.load_tokenizer(model_dir), policy.load_model(model_dir)
    engine = engines.HFEngine(model, tokenizer.pad_token_id, batch_size=rows)
    return tokenizer, engine, args.step_ms / 1000 if args.step_ms else step_seconds(engine, min(16, rows))


def run(args: Args) -> dict:
    tokenizer, engine, step = tiny_engine(args, args.trajectories)
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
    for name, lockstep, continuous in (("lockstep", True, False), ("per call", False, False),
                                       ("continuous", False, True)):
        scripted = ScriptedReplies(engine, tokenizer, lengths, continuous)
        start = time.perf_counter()
        samples, metrics = rollout.multi_turn(scripted, tokenizer, rows, 1, sampling, toolbox(times, outputs), limits,
                                              lockstep=lockstep)
        seconds[name] = time.perf_counter() - start
        turns = [s.info["turns"] for s in samples]
        if turns != [len(t) for t in workload]:
            raise RuntimeError(f"trajectories ran other turns than planned: {turns} ({[s.finish_reason for s in samples]}"
                               f") for {[len(t) for t in workload]}")
        print(f"{name:>11}: {seconds[name]:7.1f} s  engine calls {metrics['rollout/engine_calls']:.0f}, "
              f"{metrics['rollout/in_flight_mean']:.1f} trajectories a call, engine busy "
              f"{metrics['rollout/engine_busy_frac']:.0%}, tools busy {metrics['tools/busy_frac']:.0%}, "
              f"most tool calls at once {metrics['tools/running_max']:.0f}")
    print(f"lockstep / independent per call: {seconds['lockstep'] / seconds['per call']:.2f}x; lockstep / "
          f"independent with continuous batching: {seconds['lockstep'] / seconds['continuous']:.2f}x (goal >= 2.5x)")
    return {"mode": "real", "seconds": seconds, "speedup_per_call": seconds["lockstep"] / seconds["per call"],
            "speedup_continuous": seconds["lockstep"] / seconds["continuous"]}


@dataclass
class Variant:
    """One side of the long-tail comparison: its groups in flight (partial rollouts) and what its steps did."""

    in_flight: partial_rollouts.InFlight | None
    next_group: int = 0
    seconds: list[float] = field(default_factory=list)
    engine_calls: float = 0.0
    restarted: float = 0.0
    ages: list[int] = field(default_factory=list)  # of the trained tokens, in steps
    trained: list[int] = field(default_factory=list)  # group ids


def run_long_tail(args: Args) -> dict:
    groups, size = args.groups, args.group_size
    tokenizer, engine, step = tiny_engine(args, 2 * groups * size)
    fixed_step = args.fixed_step_ms / 1000 if args.fixed_step_ms else None
    step = fixed_step or step
    workload = long_tail_plan((args.steps + 1) * groups, size, args.turns, args.seed)
    lengths = {k: [max(8, round(t.reply_tokens / args.scale)) for t in turns] for k, turns in workload.items()}
    times = {k: [t.tool_seconds * step / GPU_STEP_SECONDS / args.scale for t in turns] for k, turns in workload.items()}
    outputs = {k: [t.output_chars for t in turns] for k, turns in workload.items()}
    rows = [{"prompt": [{"role": "user", "content": f"task-{g}: make the tests pass"}]}
            for g in range((args.steps + 1) * groups)]
    limits = rollout.AgentLimits(max_turns=10 * args.turns, max_total_tokens=32768, max_tool_response_tokens=64)
    sampling = engines.Sampling(max_new_tokens=4096, temperature=1.0, seed=args.seed)
    long = {g for (g, _), turns in workload.items() if len(turns) > args.turns}
    print(f"long tail: {args.steps} steps of {groups} groups of {size}, {args.turns} turns a trajectory and "
          f"{10 * args.turns} for {sum(len(t) > args.turns for t in workload.values())} of {len(workload)} "
          f"(in {len(long)} of {len(rows)} groups), scale 1/{args.scale:g}; decoding step "
          + (f"fixed at {step * 1000:.1f} ms whatever the rows" if fixed_step else f"here {step * 1000:.1f} ms")
          + (", continuous batching" if args.continuous else ", an engine call per batch of ready trajectories"))
    variants = {"without": Variant(None),
                "partial": Variant(partial_rollouts.InFlight(groups=groups, max_staleness=1))}
    try:
        for version in range(args.steps):  # the variants alternate: both see the same load of a shared machine
            for name, variant in variants.items():
                in_flight = variant.in_flight
                count = partial_rollouts.prompts_per_rank(in_flight, groups)
                replies = SeededReplies(engine, tokenizer, lengths, args.seed, fixed_step, args.continuous)
                start = time.perf_counter()
                samples, metrics = rollout.multi_turn(
                    replies, tokenizer, rows[variant.next_group: variant.next_group + count], size, sampling,
                    seeded_toolbox(times, outputs), limits, first_group=variant.next_group, in_flight=in_flight,
                    version=version)
                variant.seconds.append(time.perf_counter() - start)
                variant.next_group += count
                planned = [len(workload[s.group, k % size]) for k, s in enumerate(samples)]  # whole groups, in order
                if len(samples) != groups * size or [s.info["turns"] for s in samples] != planned:
                    raise RuntimeError(f"{name}, step {version}: trajectories ran other turns than planned, or groups "
                                       "were split")
                variant.engine_calls += metrics["rollout/engine_calls"]
                variant.restarted += metrics.get("partial/restarted_stale", 0)
                variant.ages += [version - v for s in samples for v, m in zip(s.versions, s.loss_mask) if m]
                variant.trained += sorted({s.group for s in samples})
        for name, v in variants.items():
            print(f"{name:>8}: {statistics.mean(v.seconds):6.2f} s a step ({' '.join(f'{x:.1f}' for x in v.seconds)})"
                  f"; {len(v.trained)} groups trained ({len(long & set(v.trained))} with a long trajectory), engine "
                  f"calls {v.engine_calls:.0f}, staleness of trained tokens mean {statistics.mean(v.ages):.2f} max "
                  f"{max(v.ages)}, trajectories restarted {v.restarted:.0f}, groups in flight at the end "
                  f"{len(v.in_flight.group_ids()) if v.in_flight else 0}")
    finally:
        variants["partial"].in_flight.close()
    ratio = statistics.mean(variants["without"].seconds) / statistics.mean(variants["partial"].seconds)
    print(f"without / partial: {ratio:.2f}x (goal >= 1.5x)")
    return {"mode": "long_tail", "seconds_per_step": {name: statistics.mean(v.seconds) for name, v in variants.items()},
            "speedup": ratio}


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


def simulate(args: Args) -> dict:
    print(f"{args.trajectories} trajectories, unscaled workload; seconds (lockstep / independent)")
    speedups = {"20ms": [], "40ms": []}  # lockstep / continuous, per seed, by decoding step
    for seed in range(args.seed, args.seed + 5):
        workload = plan(args.trajectories, seed)
        cells = []
        for step in (0.020, 0.040):
            lock, per_call, cont = (f(workload, step) for f in (simulate_lockstep, simulate_per_call,
                                                                  simulate_continuous))
            cells.append(f"{step * 1000:.0f} ms: lockstep {lock:6.0f}, per call {per_call:6.0f} ({lock / per_call:.2f}x),"
                         f" continuous {cont:6.0f} ({lock / cont:.2f}x)")
            speedups[f"{step * 1000:.0f}ms"].append(lock / cont)
        print(f"seed {seed}: " + "; ".join(cells))
    return {"mode": "simulate", "speedup_continuous": speedups}


if __name__ == "__main__":
    args = tyro.cli(Args)
    result = simulate(args) if args.simulate else run_long_tail(args) if args.long_tail else run(args)
    print("RESULT " + json.dumps(result))
