"""Tokens/s of the packed multimodal update against the same batch padded, on a Qwen2.5-VL.

The update's forward and backward (no optimizer step, the same in both) over one GRPO batch: `--groups` prompts, each
with one or two images (sizes drawn per prompt), `--group-size` completions of `--min-new`..`--max-new` tokens each.
Packed: kiln's `policy.completion_micro_batches` + `completion_logprobs` (packed_sdpa on the language model, [4, 1, L]
positions, a group's prompt and its images run once per micro-batch, chunked logprobs). Padded: the samples in rows
padded to the longest of their micro-batch (sdpa with the padding mask, mrope from get_rope_index with it, the full
[rows, length, vocab] logits through log_softmax), as many rows per forward as fit `--micro-batch-tokens`. Tokens are
the real ones (images expanded), the same count for both. Both compute the same logprobs (checked before timing).

    .venv/bin/python bench/vlm_step.py                          # the tiny Qwen2.5-VL on CPU
    python bench/vlm_step.py --shape qwen2.5-vl-3b --groups 8   # Qwen2.5-VL-3B's shape, random weights, a GPU
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import tyro
from PIL import Image
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

import policy
import tiny
import vision

# Qwen2.5-VL-3B-Instruct's config.json: the language model and the vision tower.
QWEN25_VL_3B = dict(
    text_config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                     num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31]),
    tie_word_embeddings=True)


@dataclass
class Args:
    shape: Literal["tiny", "qwen2.5-vl-3b"] = "tiny"
    """the tiny Qwen2.5-VL of tiny.py, or Qwen2.5-VL-3B's shape with random weights (a GPU, bf16)"""
    groups: int = 4
    """prompts in the batch"""
    group_size: int = 4
    """completions per prompt"""
    min_new: int = 16
    """shortest completion"""
    max_new: int = 128
    """longest completion"""
    micro_batch_tokens: int = 4096
    """tokens per forward (packed: kiln's budget; padded: rows x longest row)"""
    repeats: int = 5
    """measured updates per method, alternating (after one warm-up each)"""
    seed: int = 0


def png(width: int, height: int, rng: np.random.Generator) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def build(args: Args, folder: Path, device: torch.device):
    """The model (packed_sdpa on its language model) and its image processor's folder."""
    sizes = {"tiny": {}, "qwen2.5-vl-3b": {"max_pixels": 28 * 28 * 1280}}[args.shape]
    path = tiny.make_tiny_vlm(folder, ["The answer is 3. <answer>red</answer> def f(x): return x"] * 50, **sizes)
    if args.shape == "tiny":
        return policy.load_model(path, attn_implementation="packed_sdpa").to(device)
    small = Qwen2_5_VLConfig.from_pretrained(path)
    config = Qwen2_5_VLConfig(**QWEN25_VL_3B, image_token_id=small.image_token_id,
                              video_token_id=small.video_token_id, vision_start_token_id=small.vision_start_token_id,
                              vision_end_token_id=small.vision_end_token_id)
    config._attn_implementation = {"text_config": "packed_sdpa", "vision_config": "sdpa"}
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    model.config._name_or_path = str(path)  # where vision.processor_for finds the image processor
    return model


def batch(args: Args, config) -> list[SimpleNamespace]:
    """GRPO samples: per prompt some text, one or two images and a question; completions of random lengths."""
    rng = np.random.default_rng(args.seed)
    vocab = config.get_text_config().vocab_size
    span = [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
    big = 896 if config.get_text_config().hidden_size > 64 else 300
    samples = []
    for group in range(args.groups):
        images = [png(int(rng.integers(64, big)), int(rng.integers(64, big)), rng)
                  for _ in range(int(rng.integers(1, 3)))]
        prompt = rng.integers(10, vocab, 40).tolist()
        for _ in images:
            prompt += span + rng.integers(10, vocab, 12).tolist()
        for _ in range(args.group_size):
            completion = rng.integers(10, vocab, int(rng.integers(args.min_new, args.max_new + 1))).tolist()
            samples.append(SimpleNamespace(prompt_ids=prompt, completion_ids=completion, images=images,
                                           group=group))
    return samples


def packed_update(model, samples, args: Args) -> list[torch.Tensor]:
    sums = []
    for micro in policy.completion_micro_batches(model, samples, list(range(len(samples))), args.micro_batch_tokens):
        logprobs, _ = policy.completion_logprobs(model, [samples[i] for i in micro])
        (-logprobs.sum() / len(samples)).backward()
        sums += list(logprobs.detach().float().sum(1))
    return sums


def expanded_length(model, sample) -> int:
    added, _ = vision.added_tokens(model.config, sample.prompt_ids, sample.images)
    return len(sample.prompt_ids) + len(sample.completion_ids) + added


def padded_rows(model, samples, max_tokens: int) -> list[list[int]]:
    """Micro-batches of consecutive samples whose rows x longest expanded row fit the budget."""
    lengths = [expanded_length(model, s) for s in samples]
    micro, current = [], []
    for i, n in enumerate(lengths):
        if current and (len(current) + 1) * max(n, *(lengths[j] for j in current)) > max_tokens:
            micro.append(current)
            current = []
        current.append(i)
    return micro + [current]


def padded_update(model, samples, args: Args) -> list[torch.Tensor]:
    sums, processor, pad = [], vision.processor_for(model.config), model.config.image_token_id
    device = next(model.parameters()).device
    for micro in padded_rows(model, samples, args.micro_batch_tokens):
        rows, completions, pixel_values, grids = [], [], [], []
        for i in micro:
            s = samples[i]
            pixels, grid = vision.pixels(processor, s.images)
            rows.append(vision.expand(s.prompt_ids + s.completion_ids, grid, pad, processor.merge_size)[0])
            completions.append(len(s.completion_ids))
            pixel_values.append(pixels)
            grids.append(grid)
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, row in enumerate(rows):  # right padding: real tokens first, as a padded trainer lays them out
            ids[r, : len(row)], mask[r, : len(row)] = torch.tensor(row), 1
        ids, mask, grid = ids.to(device), mask.to(device), torch.cat(grids).to(device)
        positions, _ = model.model.get_rope_index(ids, mm_token_type_ids=(ids == pad).int(), image_grid_thw=grid,
                                                  attention_mask=mask)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, image_grid_thw=grid,
                       pixel_values=torch.cat(pixel_values).to(device), use_cache=False).logits.float()
        logits[..., vision.banned_token_ids(model.config)] = -torch.inf
        chosen = logits[:, :-1].log_softmax(-1).gather(2, ids[:, 1:, None]).squeeze(2)
        total = 0
        for r, (row, n) in enumerate(zip(rows, completions)):
            row_sum = chosen[r, len(row) - 1 - n : len(row) - 1].sum()
            sums.append(row_sum.detach())
            total = total + row_sum
        (-total / len(samples)).backward()
    return sums


def timed(update, model, samples, args: Args) -> float:
    model.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    update(model, samples, args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def set_text_attention(model, attn: str) -> None:
    model.set_attn_implementation({"text_config": attn, "vision_config": "sdpa"})


def main(args: Args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as folder:
        model = build(args, Path(folder), device)
        samples = batch(args, model.config)
        tokens = sum(expanded_length(model, s) for s in samples)
        packed = packed_update(model, samples, args)  # also the warm-ups
        set_text_attention(model, "sdpa")
        padded = padded_update(model, samples, args)
        gap = max(abs(float(a - b)) / max(1.0, abs(float(b))) for a, b in zip(packed, padded))
        print(f"check: per-sample completion logprob sums agree to {gap:.1e} (relative)")
        packed_s, padded_s = [], []
        for _ in range(args.repeats):  # alternating, so a busy spell of a shared machine hits both
            padded_s.append(timed(padded_update, model, samples, args))
            set_text_attention(model, "packed_sdpa")
            packed_s.append(timed(packed_update, model, samples, args))
            set_text_attention(model, "sdpa")
        width = sum(len(m) * max(expanded_length(model, samples[i]) for i in m)
                    for m in padded_rows(model, samples, args.micro_batch_tokens))
    print(f"{args.shape} on {device}: {len(samples)} samples, {tokens} tokens (images expanded), padded rows hold "
          f"{width} positions")
    for name, seconds in (("packed", packed_s), ("padded", padded_s)):
        print(f"{name}: {statistics.median(seconds):.3f} s median ({min(seconds):.3f} fastest) per update, "
              f"{tokens / statistics.median(seconds):,.0f} tokens/s")
    print(f"packed / padded tokens/s: {statistics.median(padded_s) / statistics.median(packed_s):.2f}x")


if __name__ == "__main__":
    main(tyro.cli(Args))
