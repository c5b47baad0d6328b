"""Activation memory and time of `policy.shard_model`'s activation checkpointing modes (none, full, selective) on
decoder layers of Qwen2.5-1.5B's shape in bf16, forward + backward of one packed micro-batch. CPU; each measurement
runs in a fresh subprocess and reads the kernel's resident-memory counter after the forward, against the one before
it and after a warm-up: what the forward kept for backward (glibc is told to map every large buffer on its own, so a
freed one leaves RSS at once). Per token and layer is the difference between `layers` and twice as many layers, so
the embeddings, the output layer and the logits cancel out.

    .venv/bin/python bench/activation_memory.py [--layers 2] [--tokens 2048]
"""

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "full", "selective")


@dataclass
class Args:
    layers: int = 2
    """decoder layers of Qwen2.5-1.5B's shape (hidden 1536, MLP 8960, 12 query and 2 key/value heads); each mode
    also runs with twice as many"""
    tokens: int = 2048
    """packed tokens per micro-batch, in sequences of `sequence_tokens`"""
    sequence_tokens: int = 512
    """length of each packed sequence"""
    attn_implementation: str = "packed_sdpa"
    """attention of the packed forward (packed_sdpa: kiln's CPU default)"""


def measure(mode: str, layers: int, args: Args) -> dict:
    """Runs in the subprocess: bytes kept after the forward and seconds of forward + backward."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import policy

    policy.init_distributed()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=1024, hidden_size=1536, intermediate_size=8960, num_hidden_layers=layers,
                         num_attention_heads=12, num_key_value_heads=2, rope_theta=1000000.0)
    model = Qwen2ForCausalLM._from_config(config, attn_implementation=args.attn_implementation, dtype=torch.bfloat16)
    model = policy.shard_model(model, activation_checkpointing=mode)

    def step(tokens: int) -> tuple[int, float]:
        ids = torch.randint(config.vocab_size, (1, tokens))
        positions = torch.arange(tokens) % args.sequence_tokens
        start = time.perf_counter()
        logits = model(input_ids=ids, position_ids=positions[None], use_cache=False).logits
        kept = rss()
        logits.float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)
        return kept, time.perf_counter() - start

    step(args.sequence_tokens)  # warm-up: lazy initialisation, thread pools, gradient buffers
    baseline = rss()
    kept, seconds = step(args.tokens)
    return {"kept_bytes": kept - baseline, "seconds": seconds}


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmRSS")


def run(mode: str, layers: int, args: Args) -> dict:
    code = (f"import sys, json; sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'bench')!r}); "
            f"from activation_memory import Args, measure; "
            f"print(json.dumps(measure({mode!r}, {layers}, Args(**{vars(args)!r}))))")
    # glibc otherwise raises its mmap threshold after frees and keeps freed buffers resident
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"{mode}: the measurement failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(args: Args) -> None:
    print(f"{args.layers} decoder layers of Qwen2.5-1.5B's shape, bf16, {args.tokens} tokens in sequences of "
          f"{args.sequence_tokens}, {args.attn_implementation}, forward + backward")
    print(f"| activation checkpointing | kept, {args.layers} layers | kept, {2 * args.layers} layers | "
          f"KiB / token / layer | s, {2 * args.layers} layers |")
    print("|---|---:|---:|---:|---:|")
    for mode in MODES:
        few, more = run(mode, args.layers, args), run(mode, 2 * args.layers, args)
        per_token_layer = (more["kept_bytes"] - few["kept_bytes"]) / 1024 / args.tokens / args.layers
        print(f"| {mode} | {few['kept_bytes'] / 2**20:.0f} MiB | {more['kept_bytes'] / 2**20:.0f} MiB | "
              f"{per_token_layer:.1f} | {more['seconds']:.2f} |", flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
