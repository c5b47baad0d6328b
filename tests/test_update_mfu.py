"""bench/update_mfu.py: the FLOP count behind its MFU, checked by hand, and a CPU run of the real update."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import update_mfu  # noqa: E402


def test_flops_by_hand():
    config = Qwen2Config(**update_mfu.SHAPES["tiny"])
    with torch.device("meta"):
        model = Qwen2ForCausalLM._from_config(config)
    # per layer: q 64x64 + k 64x32 + v 64x32 + o 64x64 (2 kv heads of 16) + gate, up 64x128 + down 128x64
    # = 4096 + 2048 + 2048 + 4096 + 3 * 8192 = 36864; 2 layers; plus the tied output layer 512x64 = 32768
    assert update_mfu.matmul_params(model) == 2 * 36864 + 32768 == 106496
    # 6 x 106496 x (10 + 20) tokens, plus attention 12 x 2 layers x 64 x (10^2 + 20^2)
    assert update_mfu.flops_per_update(config, 106496, [(10, 10), (20, 20)]) == 19_169_280 + 768_000
    # a 20-token sequence whose 6-token prompt another sample ran: 14 tokens, each attending over 20
    assert update_mfu.flops_per_update(config, 106496, [(10, 10), (14, 20)]) == 6 * 106496 * 24 + 1536 * (100 + 280)


def test_qwen2_5_1_5b_shape_has_its_parameter_count():
    with torch.device("meta"):
        model = Qwen2ForCausalLM._from_config(Qwen2Config(**update_mfu.SHAPES["qwen2.5-1.5b"]))
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 1.54  # Qwen2.5-1.5B's published size


@pytest.mark.slow
def test_cpu_run_reports_consistent_numbers():
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "update_mfu.py"), "--shape", "tiny", "--samples", "6",
         "--prompt-tokens", "16", "--completion-tokens", "8", "8", "--micro-batch-tokens", "64", "--steps", "2",
         "--warmup", "1", "--peak-tflops", "0.001", "--attn-implementation", "sdpa",
         "--no-compile-layers"],
        capture_output=True, text=True, timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1].split("RESULT ", 1)[1])
    assert result["tokens_per_update_per_rank"] == 6 * (16 + 8)
    # (reported to 4 significant digits)
    assert result["tokens_per_s_per_rank"] == pytest.approx(144 / result["seconds_per_update"], rel=2e-3)
    assert result["mfu"] == pytest.approx(result["model_tflops_per_rank"] / 0.001, rel=1e-3)


@pytest.mark.slow
def test_groups_share_their_prompt_in_the_forward():
    """--group-size 3 under packed_sdpa: 6 samples of 16 + 8 tokens, 2 prompts, each run once per micro-batch of 64
    tokens: the pack is [24 + 8 + 8 + 24 = 64], [24 + 8] (the second group's prompt runs again in the second
    micro-batch), so the prompts of samples 1, 2 and 5 (48 tokens) are not run."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "update_mfu.py"), "--shape", "tiny", "--samples", "6",
         "--group-size", "3", "--prompt-tokens", "16", "--completion-tokens", "8", "8", "--micro-batch-tokens", "64",
         "--steps", "2", "--warmup", "1", "--peak-tflops", "0.001", "--attn-implementation", "packed_sdpa",
         "--no-compile-layers"],
        capture_output=True, text=True, timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1].split("RESULT ", 1)[1])
    assert (result["tokens_per_update_per_rank"], result["tokens_run_per_update_per_rank"]) == (144, 96)
