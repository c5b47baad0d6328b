"""Tokens/s and MFU of kiln's GRPO update (train_grpo.update_policy: packing, chunked logprobs, loss, backward, clip, AdamW)
on a Qwen2.5-1.5B-shaped model with random weights, in bf16 under FSDP2.

    python bench/update_mfu.py                               # one GPU (H100/H200/A100 peak is known)
    torchrun --nproc-per-node 8 bench/update_mfu.py          # every rank takes `samples` sequences
    python bench/update_mfu.py --shape tiny --samples 8 --steps 2 --warmup 1 \
        --attn-implementation sdpa --no-compile-layers       # CPU smoke run, no MFU (flex has no CPU backward)

Model FLOPs follow the PaLM / torchtitan convention: 6 x (parameters of every matmul, the output layer included) per
token, plus 12 x layers x hidden x sequence length per token for attention; activation-checkpointing recompute is not
counted. Sequences are a random prompt plus a completion of random length, packed up to `micro_batch_tokens`;
with `--group-size G`, G consecutive samples share their prompt, as a GRPO group does, and an attention that shares
prefixes (packed_sdpa, flex_attention) runs it once per micro-batch: tokens/s then counts every sample's tokens and
MFU the work actually done.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import tyro
from transformers import Qwen2Config, Qwen2ForCausalLM

import policy
import rl_run
import rollout
import train_grpo

# Qwen2.5-1.5B's published config (the weights are random here: only the shape matters for speed).
SHAPES = {
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1000000.0, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True),
}
# Dense bf16 peak FLOP/s per GPU, by a substring of torch.cuda.get_device_name().
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


@dataclass
class Args:
    shape: Literal["qwen2.5-1.5b", "tiny"] = "qwen2.5-1.5b"
    """model shape (random init)"""
    samples: int = 64
    """sequences per update on each rank"""
    prompt_tokens: int = 512
    """prompt length of every sequence"""
    group_size: int = 1
    """consecutive samples sharing one prompt (1: every sample has its own, nothing to share)"""
    completion_tokens: tuple[int, int] = (256, 1536)
    """completion lengths are drawn uniformly from this range"""
    micro_batch_tokens: int = 65536
    """kiln's packed micro-batch size"""
    logprob_chunk_size: int = 512
    """rows of the output layer per chunk of the chosen-token logprobs"""
    activation_checkpointing: Literal["none", "full", "selective"] = "full"
    """recompute in backward: full (each decoder layer) or selective (only elementwise work; keeps matmul outputs)"""
    attn_implementation: str = "flex_attention"
    """transformers attention backend for the packed forward (flex_attention skips the blocks between sequences)"""
    compile_layers: bool = True
    """torch.compile each decoder layer"""
    steps: int = 5
    """measured updates"""
    warmup: int = 3
    """updates run first and not measured (compilation: the first two take longer)"""
    peak_tflops: float | None = None
    """peak bf16 TFLOP/s of one device; known for H100/H200/A100"""
    seed: int = 0
    profile: str | None = None
    """after the measured updates, profile one more and write its top operators (by device time) to this file"""


def matmul_params(model: torch.nn.Module) -> int:
    """Weights that multiply activations: every Linear, the (possibly tied) output layer included, embeddings not."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def flops_per_update(config: Qwen2Config, n_matmul: int, runs: list[tuple[int, int]]) -> float:
    """Model FLOPs of forward + backward over packed samples, each given as (tokens the forward runs, length of its
    sequence): a whole sequence is (n, n); a branch that shares its prompt runs only its completion, whose tokens
    attend to the whole sequence's length."""
    attention = sum(12 * config.num_hidden_layers * config.hidden_size * run * n for run, n in runs)
    return 6 * n_matmul * sum(run for run, _ in runs) + attention


def forward_runs(grpo: train_grpo.Run, batch: list[rollout.Sample]) -> list[tuple[int, int]]:
    """(tokens run, sequence length) of each sample as `train_grpo.update_policy` packs them: a sample whose prompt an
    earlier sample of its micro-batch has run, under an attention that shares prefixes, runs only its completion."""
    share = policy.shares_prefixes(grpo.model)
    runs = []
    for micro in policy.completion_micro_batches(grpo.model, batch, list(range(len(batch))),
                                                 grpo.args.micro_batch_tokens):
        seen = set()
        for i in micro:
            s = batch[i]
            runs.append((len(s.completion_ids) if share and tuple(s.prompt_ids) in seen else len(s.ids), len(s.ids)))
            seen.add(tuple(s.prompt_ids))
    return runs


def synthetic_batch(args: Args, vocab: int, rng: random.Random) -> list[rollout.Sample]:
    """Random token sequences standing in for one rank's rollouts, `group_size` to a prompt, with advantages of +-1."""
    batch = []
    for i in range(args.samples):
        completion = rng.randint(*args.completion_tokens)
        if i % args.group_size == 0:  # (drawn in this order, group size 1 gives the earlier sessions' batches)
            prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
        batch.append(rollout.Sample(
            prompt_ids=prompt, completion_ids=[rng.randrange(vocab) for _ in range(completion)],
            loss_mask=[1] * completion, engine_logprobs=[0.0] * completion, row={}, group=i // args.group_size,
            advantage=rng.choice([-1.0, 1.0])))
    return batch


def peak_flops(args: Args, device: torch.device) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    known = [peak for key, peak in PEAK_BF16.items() if key in name]
    if not known:
        raise SystemExit(f"unknown peak FLOP/s for {name!r}: pass --peak-tflops")
    return known[0]


def update(grpo, batch: list) -> dict:
    """One train_grpo.update_policy on the batch, on-policy: its loss masks and its samples' advantages."""
    advantages = policy.padded([[s.advantage] * len(s.loss_mask) for s in batch])
    return train_grpo.update_policy(grpo, batch, 0, None, None, rl_run.rollout_correction(grpo, None, batch),
                                    advantages)


def profile_update(args: Args, grpo: train_grpo.Run, batch: list[rollout.Sample], rank: int) -> None:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        update(grpo, batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    if rank == 0:
        Path(args.profile).write_text(prof.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=70))


def main(args: Args) -> dict:
    rank, world, device = policy.init_distributed()
    cuda = device.type == "cuda"
    config = Qwen2Config(**SHAPES[args.shape])
    torch.manual_seed(args.seed)
    with device:
        model = Qwen2ForCausalLM._from_config(config, attn_implementation=args.attn_implementation,
                                              dtype=torch.float32)
    n_matmul = matmul_params(model)
    model = policy.shard_model(model, mixed_precision=cuda, activation_checkpointing=args.activation_checkpointing,
                                compile_layers=args.compile_layers)
    grpo_args = train_grpo.Args(model="", micro_batch_tokens=args.micro_batch_tokens,
                                logprob_chunk_size=args.logprob_chunk_size, max_new_tokens=max(args.completion_tokens),
                                mixed_precision=cuda, activation_checkpointing=args.activation_checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    # No engine, data, reward or log: update_policy() needs only the model, its optimizer and the Args.
    grpo = train_grpo.Run(args=grpo_args, rank=rank, world=world, model=model, ref_model=None, teacher=None,
                          optimizer=optimizer,
                          scheduler=scheduler, engine=None, tokenizer=None, sampling=None, limits=None, rows=[],
                          eval_rows=[], score_fn=None, judge=None, log=None)
    rng = random.Random(args.seed + rank)
    seconds, flops, tokens, tokens_run = [], [], [], []
    for step in range(args.warmup + args.steps):
        batch = synthetic_batch(args, config.vocab_size, rng)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        stats = update(grpo, batch)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if not torch.isfinite(torch.tensor(stats["actor/pg_loss"])):
            raise SystemExit(f"update {step}: loss is {stats['actor/pg_loss']}")
        if rank == 0:
            print(f"update {step}: {elapsed:.3f} s", file=sys.stderr, flush=True)
        if step >= args.warmup:
            runs = forward_runs(grpo, batch)
            seconds.append(elapsed)
            flops.append(flops_per_update(config, n_matmul, runs))
            tokens.append(sum(n for _, n in runs))
            tokens_run.append(sum(run for run, _ in runs))
    if args.profile:
        profile_update(args, grpo, synthetic_batch(args, config.vocab_size, rng), rank)
    per_rank_flops = sum(flops) / sum(seconds)  # throughput over all measured updates
    peak = peak_flops(args, device)
    result = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "world": world, "shape": args.shape,
        "torch": torch.__version__, "attn_implementation": args.attn_implementation,
        "compile_layers": args.compile_layers,
        "activation_checkpointing": args.activation_checkpointing, "micro_batch_tokens": args.micro_batch_tokens,
        "logprob_chunk_size": args.logprob_chunk_size,
        "group_size": args.group_size, "tokens_per_update_per_rank": statistics.mean(tokens),
        "tokens_run_per_update_per_rank": statistics.mean(tokens_run),
        "seconds_per_update": float(f"{statistics.mean(seconds):.4g}"),
        "tokens_per_s_per_rank": round(sum(tokens) / sum(seconds), 1),
        "model_tflops_per_rank": float(f"{per_rank_flops / 1e12:.4g}"),
        "mfu": round(per_rank_flops / peak, 4) if peak else None,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
    }
    if rank == 0:
        print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main(tyro.cli(Args))
    policy.exit_distributed()
