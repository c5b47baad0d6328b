"""Long trajectories as real SWE agents run them (issue 47): what kiln spends outside the model per turn, from turn 1
to turn 90, on both agent paths (goal: turn 90's overhead at most 1.5x turn 1's, total overhead linear in length);
tokens forwarded per token trained on a SWE-shaped group with branches, before and after the prefix tree; the
sequence-parallel equality error; and, on GPUs, a 64K-token update per --sequence-parallel size.

Per-turn overhead (`per_turn_section`):

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

Forwarded tokens (`forwarded_tokens_section`, synthetic: no recorded SWE trajectories here). A GRPO group of 4 agent
sessions of one task (2,000-token task prompt), each a main segment of 40 turns (a 150-token sampled reply, then a
700-token tool output: tool outputs dominate, as in SWE), two branch segments continuing the main one's 12th and
28th replies for 6 turns each (an agent that goes back to an earlier reply), three retried turns (the same history,
a new reply: a client's retry of a request kiln kept) and one rewrite (the task prompt, a 1,500-token summary, 8 more
turns). Trained tokens are the sampled replies. The samples are packed by policy.pack into micro-batches of
--micro-batch-tokens (a sequence-parallel row) and laid out by policy._layout: "after" is the prefix tree; "before"
is the layout kiln had until now on the same micro-batches (only equal prompts run once), which favours "before"
(its own packing would have put fewer samples together).

Sequence parallelism (`sequence_parallel_section`): tests/dist_sequence_parallel.py under torchrun on gloo at 2 and 4
ranks (tiny models; FSDP2, activation checkpointing, shared prefixes, a critic, the vision model); the largest error
relative to each tensor's largest entry over logprobs, entropies, loss and every gradient.

    .venv/bin/python bench/long_horizon.py [--turns 90 --tool-tokens 660 --repeats 3]   # the CPU sections
    torchrun --nproc-per-node 4 bench/long_horizon.py --gpu-shape qwen2.5-7b --tokens 65536 --sequence-parallel 4
    torchrun --nproc-per-node 2 bench/long_horizon.py --gpu-shape tiny --tokens 4096 --sequence-parallel 2 \
        --attn-implementation packed_sdpa --steps 1     # CPU smoke run of the GPU section

On GPUs (`--gpu-shape`): a Qwen2.5-7B-shaped model with random weights (28 heads, 4 key/value heads: N = 2 or 4; 8 is
refused), bf16 under FSDP2 over every rank, full activation checkpointing, one packed row of --tokens tokens (8
sequences) per sequence-parallel group; forward and backward of the logprobs' sum, peak memory and tokens/s per rank.
"""
from __future__ import annotations

import json
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import openai
import torch
import tyro
from transformers import Qwen2Config, Qwen2ForCausalLM

import agent_server
import chat
import collectives
import engines
import policy
import rollout
import sequence_parallel
import tiny
import tools

CORPUS = ["Let me look at the failing test first.", '{"name": "bash", "arguments": {"command": "grep -n x a.py"}}',
          "def parse(line):\n    return line.split(',')\n", "FAILED tests/test_a.py::test_x - AssertionError"] * 20
BASH = {"type": "function", "function": {"name": "bash", "description": "run a command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
CHECKPOINTS = (1, 30, 60, 90)
SHAPES = {  # Qwen2.5-7B's published config (random weights: only the shape matters)
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
                       rope_theta=1000000.0, tie_word_embeddings=False),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=131072, tie_word_embeddings=True),
}


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
    micro_batch_tokens: int = 65536
    """tokens per packed row in the forwarded-tokens section (a sequence-parallel row)"""
    seed: int = 0
    """the synthetic group's seed (and the GPU section's)"""
    gpu_shape: Literal["qwen2.5-7b", "tiny"] | None = None
    """run the GPU section instead (under torchrun, one rank per GPU)"""
    tokens: int = 65536
    """GPU section: tokens of the packed row each sequence-parallel group runs"""
    sequence_parallel: int = 1
    """GPU section: ranks per row"""
    steps: int = 3
    """GPU section: measured updates (after one warm-up)"""
    attn_implementation: str = "flex_attention"
    """GPU section: the packed attention (packed_sdpa for a CPU smoke run: flex has no CPU backward)"""


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


def swe_group(seed: int) -> tuple[list[list[int]], list[int], list[int]]:
    """(sequences, score_from, trained tokens per sequence) of the synthetic SWE-shaped group described above."""
    rng = random.Random(seed)

    def ids(n):
        return [rng.randrange(3, 150000) for _ in range(n)]

    def turns(n):
        parts = [(ids(150), ids(700)) for _ in range(n)]
        return parts, [t for reply, tool in parts for t in reply + tool]

    task = ids(2000)
    sequences, score_from, trained = [], [], []

    def add(prompt, completion, replies):
        sequences.append(prompt + completion)
        score_from.append(len(prompt))
        trained.append(replies)

    for _ in range(4):
        main_turns, main = turns(40)
        add(task, main, 40 * 150)
        for at in (12, 28):  # branch: the prompt is the main segment up to its at-th reply, as recorded
            history = task + main[: at * 850 - 700]
            _, more = turns(6)
            add(history, more, 6 * 150)
        for at in rng.sample(range(1, 40), 3):  # retried turn: the history before a reply, a new reply
            add(task + main[: (at - 1) * 850], ids(150), 150)
        _, rest = turns(8)
        add(task + ids(1500), rest, 8 * 150)
    return sequences, score_from, trained


def forwarded_tokens_section(micro_batch_tokens: int = 65536, seed: int = 0) -> dict:
    """Tokens forwarded per token trained on the SWE-shaped group: {"before": x, "after": y} (and the counts)."""
    sequences, score_from, trained = swe_group(seed)
    config = Qwen2Config(**SHAPES["tiny"])
    config._attn_implementation = "packed_sdpa"  # an attention that shares prefixes: what pack() asks
    index = list(range(len(sequences)))
    micro = policy.pack(index, sequences, micro_batch_tokens, score_from, SimpleNamespace(config=config))
    before = after = 0
    for batch in micro:
        seqs, first = [sequences[i] for i in batch], [score_from[i] for i in batch]
        after += len(policy._layout(seqs, first, True)[0])
        before += len(policy._layout(seqs, first, True, prefix_keys=[()] * len(seqs))[0])  # equal prompts only
    total_trained = sum(trained)
    return {"before": round(before / total_trained, 2), "after": round(after / total_trained, 2),
            "tokens_trained": total_trained, "tokens_forwarded_before": before, "tokens_forwarded_after": after,
            "tokens_unshared": sum(map(len, sequences)), "samples": len(sequences), "micro_batches": len(micro)}


def sequence_parallel_section(worlds: tuple[int, ...] = (2, 4)) -> float:
    """The largest relative error of sequence-parallel against one rank over tests/dist_sequence_parallel.py's
    checks, at each world size."""
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = [Path(policy.__file__).read_text()]
        text = tiny.make_tiny_model(Path(tmp, "text"), corpus, seed=3)
        vlm = tiny.make_tiny_vlm(Path(tmp, "vlm"), corpus, seed=3)
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        for world in worlds:
            result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     f"--nproc-per-node={world}", str(ROOT / "tests" / "dist_sequence_parallel.py"),
                                     str(text), str(vlm)], capture_output=True, text=True, env=env, timeout=900)
            found = re.search(r"^max_rel_err (\S+)$", result.stdout, re.M)
            if result.returncode or not found:
                raise RuntimeError(f"{world} ranks failed:\n{result.stdout[-2000:]}{result.stderr[-4000:]}")
            errors.append(float(found.group(1)))
            print(f"sequence parallel, {world} ranks: max relative error {errors[-1]:.2e}", file=sys.stderr)
    return max(errors)


def gpu_section(args: Args) -> dict:
    """One packed row of args.tokens per sequence-parallel group, forward + backward, on a `gpu_shape` model."""
    rank, world, device = policy.init_distributed()
    config = Qwen2Config(**SHAPES[args.gpu_shape])
    sequence_parallel.check_heads(config, args.sequence_parallel, args.gpu_shape)
    torch.manual_seed(args.seed)
    with device:
        model = Qwen2ForCausalLM._from_config(config, attn_implementation=args.attn_implementation,
                                              dtype=torch.float32)
    cuda = device.type == "cuda"
    model = policy.shard_model(model, mixed_precision=cuda, activation_checkpointing="full")
    model = sequence_parallel.attach(model, sequence_parallel.make_group(args.sequence_parallel))
    rng = random.Random(args.seed + rank // args.sequence_parallel)  # a group's ranks run the same row
    length = args.tokens // 8
    samples = [SimpleNamespace(prompt_ids=[rng.randrange(config.vocab_size) for _ in range(512)],
                               completion_ids=[rng.randrange(config.vocab_size) for _ in range(length - 512)],
                               images=[]) for _ in range(8)]
    seconds = []
    for step in range(1 + args.steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        logprobs, _ = policy.completion_logprobs(model, samples)
        logprobs.sum().backward()
        if cuda:
            torch.cuda.synchronize()
        if step:
            seconds.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "world": world, "shape": args.gpu_shape,
            "sequence_parallel": args.sequence_parallel, "tokens_per_row": args.tokens,
            "tokens_per_s_per_rank": round(args.tokens * args.steps / sum(seconds) / args.sequence_parallel, 1),
            "seconds_per_update": round(sum(seconds) / args.steps, 3),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None}


def main(args: Args) -> dict | None:
    """Each section returns its headline keys for RESULT; with --gpu-shape only the GPU section runs (under
    torchrun), its RESULT printed by rank 0."""
    torch.set_num_threads(args.threads)
    if args.gpu_shape is not None:
        result = gpu_section(args)
        policy.exit_distributed()
        return result if collectives.rank() == 0 else None
    result = per_turn_section(args)
    forwarded = forwarded_tokens_section(args.micro_batch_tokens, args.seed)
    print(f"forwarded tokens per trained token: before {forwarded['before']}, after {forwarded['after']} "
          f"({forwarded})", file=sys.stderr)
    result["forwarded_per_trained"] = {"before": forwarded["before"], "after": forwarded["after"]}
    result["sp_max_rel_err"] = sequence_parallel_section()
    return result


if __name__ == "__main__":
    headline = main(tyro.cli(Args))
    if headline is not None:
        print("RESULT " + json.dumps(headline))
