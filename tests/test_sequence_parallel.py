"""sequence_parallel.py: Ulysses sequence parallelism for the update. The equality checks run in one torchrun launch
per world size (tests/dist_sequence_parallel.py): logprobs, entropies, the loss and every gradient of packed rows
spread over 2 and 4 gloo ranks (FSDP2, activation checkpointing, shared prefixes, a critic, the vision model) equal a
single rank's within 1e-5 relative."""

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from transformers import AutoConfig, Qwen2Config

import data_prep
import policy
import ranks
import sequence_parallel
import task_rows
import tiny

ROOT = Path(__file__).resolve().parents[1]
CORPUS = [inspect.getsource(m) for m in (json.decoder, json.encoder, textwrap, inspect)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_tiny_model(tmp_path_factory.mktemp("tiny"), CORPUS, seed=3)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return tiny.make_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"), CORPUS, seed=3)


@pytest.mark.slow  # a torchrun launch per world size (about 20 s each on 2 cores)
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_equals_one_rank(model_dir, vlm_dir, world):
    """World 2: groups of 2 (key/value heads split). World 4: groups of 4 (the 2 key/value heads repeated) and 2
    groups of 2 side by side (data parallel over the groups, the gradient the mean of theirs)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run(
        ranks.torchrun(world, ROOT / "tests" / "dist_sequence_parallel.py", model_dir, vlm_dir),
        capture_output=True, text=True, env=env, timeout=600)
    passed = {line[3:] for line in result.stdout.splitlines() if line.startswith("ok ")}
    sizes = [2] if world == 2 else [4, 2]
    expected = ({f"logprobs_entropy_loss_{n}" for n in sizes} | {f"gradients_{n}" for n in sizes}
                | {f"values_{world}", f"vision_{world}"})
    assert result.returncode == 0 and passed == expected, result.stdout[-3000:] + result.stderr[-6000:]
    error = float(next(line.split()[1] for line in result.stdout.splitlines() if line.startswith("max_rel_err")))
    assert 0 <= error <= 1e-5


def qwen(heads: int, kv_heads: int) -> Qwen2Config:
    return Qwen2Config(hidden_size=heads * 8, num_attention_heads=heads, num_key_value_heads=kv_heads)


@pytest.mark.parametrize("heads, kv_heads, size", [(28, 4, 2), (28, 4, 4), (32, 8, 8), (32, 8, 16), (4, 2, 4)])
def test_head_counts_that_split(heads, kv_heads, size):
    sequence_parallel.check_heads(qwen(heads, kv_heads), size)


@pytest.mark.parametrize("heads, kv_heads, size", [(28, 4, 8), (12, 4, 6), (32, 8, 3)])
def test_head_counts_that_do_not_split_are_refused_naming_them(heads, kv_heads, size):
    """Qwen2.5-7B's 28 heads refuse 8; 12 heads and 4 key/value heads refuse 6 (6 neither divides 4 nor is a
    multiple of it)."""
    with pytest.raises(ValueError) as e:
        sequence_parallel.check_heads(qwen(heads, kv_heads), size)
    message = str(e.value)
    assert f"--sequence-parallel {size}" in message and f"{heads} attention heads" in message
    assert f"{kv_heads} key/value heads" in message


def test_vision_model_is_judged_by_its_language_model(vlm_dir):
    config = AutoConfig.from_pretrained(vlm_dir)  # the tiny VL: 4 heads, 2 key/value heads
    sequence_parallel.check_heads(config, 4)
    with pytest.raises(ValueError, match="4 attention heads and 2 key/value heads"):
        sequence_parallel.check_heads(config, 3)


def test_refuses_an_attention_it_does_not_wrap_and_a_world_it_does_not_divide(model_dir):
    group = sequence_parallel.Group(2, 0, None)
    with pytest.raises(ValueError, match="needs --attn-implementation packed_sdpa or flex_attention, not sdpa"):
        sequence_parallel.attach(policy.load_model(model_dir, attn_implementation="sdpa"), group)
    with pytest.raises(ValueError, match="--sequence-parallel 4: must divide the number of ranks \\(6\\)"):
        sequence_parallel.check_world(4, 6)


@pytest.mark.slow  # two 2-rank GRPO runs of 2 steps
def test_grpo_step_is_the_same_with_and_without_sequence_parallelism(model_dir, tmp_path):
    """2 ranks each with their own samples (data parallel) against the same 2 ranks training all of them together
    with every packed row spread over both (--sequence-parallel 2): samples are seeded per sample, so both runs see
    the same ones, and the loss, entropy and gradient norm of each step are the same (the second step's rollouts come
    from the first step's weights: the update was the same too)."""
    train, _ = data_prep.toy_rows(16, 0, seed=0, max_ops=1)
    task_rows.write_rows(train, tmp_path / "train.parquet")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    runs = {}
    for n in (1, 2):
        out = tmp_path / f"sp{n}"
        subprocess.run([*ranks.torchrun(2, ROOT / "train_grpo.py"), "--model", str(model_dir), "--data",
                        str(tmp_path / "train.parquet"), "--output-dir", str(out), "--prompts-per-step", "2",
                        "--group-size", "2", "--max-new-tokens", "24", "--total-steps", "2", "--save-every", "0",
                        "--sample-every", "0", "--seed", "1", "--sequence-parallel", str(n)],
                       check=True, env=env, timeout=600, capture_output=True)
        runs[n] = [json.loads(line) for line in open(out / "metrics.jsonl") if "actor/pg_loss" in line]
    assert len(runs[1]) == len(runs[2]) == 2
    for one, two in zip(runs[1], runs[2]):
        assert one["critic/score/mean"] == two["critic/score/mean"]
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "response_length/mean"):
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-7), key


@pytest.mark.slow  # two 2-rank SFT runs of 2 steps
def test_sft_is_the_same_with_and_without_sequence_parallelism(model_dir, tmp_path):
    """train_sft.py on 2 ranks, data parallel against --sequence-parallel 2: the same loss, tokens and gradient norm
    at each step."""
    train, _ = data_prep.toy_rows(8, 0, seed=0, max_ops=2)
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps({"messages": r["prompt"] + [
        {"role": "assistant", "content": r["extra_info"]["solution"]}]}) + "\n" for r in train))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    runs = {}
    for n in (1, 2):
        out = tmp_path / f"sft{n}"
        subprocess.run([*ranks.torchrun(2, ROOT / "train_sft.py"), "--model", str(model_dir), "--data",
                        str(data), "--output-dir", str(out), "--steps", "2",
                        "--batch-size", "4", "--sequence-parallel", str(n)],
                       check=True, env=env, timeout=600, capture_output=True)
        runs[n] = [json.loads(line) for line in open(out / "metrics.jsonl") if "train/loss" in line]
    assert len(runs[1]) == len(runs[2]) == 2
    for one, two in zip(runs[1], runs[2]):
        assert two["train/tokens"] == one["train/tokens"]
        for key in ("train/loss", "train/grad_norm"):
            assert two[key] == pytest.approx(one[key], rel=1e-4), key
