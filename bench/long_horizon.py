"""Long-horizon updates (issue 47, the update side): tokens forwarded per token trained on a SWE-shaped group with
branches, before and after the prefix tree; the sequence-parallel equality error; and, on GPUs, a 64K-token update
per --sequence-parallel size.

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

    .venv/bin/python bench/long_horizon.py                 # the CPU sections
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
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import tyro  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

import collectives  # noqa: E402
import policy  # noqa: E402
import sequence_parallel  # noqa: E402
import tiny  # noqa: E402

SHAPES = {  # Qwen2.5-7B's published config (random weights: only the shape matters)
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
                       rope_theta=1000000.0, tie_word_embeddings=False),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=131072, tie_word_embeddings=True),
}


@dataclass
class Args:
    micro_batch_tokens: int = 65536
    """tokens per packed row in the forwarded-tokens section (a sequence-parallel row)"""
    seed: int = 0
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


def main(args: Args) -> None:
    if args.gpu_shape is not None:
        result = gpu_section(args)
        if collectives.rank() == 0:
            print("RESULT " + json.dumps(result))
        policy.exit_distributed()
    forwarded = forwarded_tokens_section(args.micro_batch_tokens, args.seed)
    print(f"forwarded tokens per trained token: before {forwarded['before']}, after {forwarded['after']} "
          f"({forwarded})", file=sys.stderr)
    error = sequence_parallel_section()
    print("RESULT " + json.dumps({"forwarded_per_trained": {"before": forwarded["before"], "after": forwarded["after"]},
                                  "sp_max_rel_err": error}))


if __name__ == "__main__":
    main(tyro.cli(Args))
