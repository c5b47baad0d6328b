"""sequence_parallel.py: Ulysses sequence parallelism for the update. The equality checks run in one torchrun launch
per world size (tests/dist_sequence_parallel.py): logprobs, entropies, the loss and every gradient of packed rows
spread over 2 and 4 gloo ranks (FSDP2, activation checkpointing, shared prefixes, a critic, the vision model) equal a
single rank's within 1e-5 relative."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from transformers import AutoConfig, Qwen2Config

import data_prep
import policy
import ranks
import sequence_parallel
import task_rows
import tiny
from test_policy import CORPUS, ROOT, model_dir  # noqa: F401 -- the tiny model fixture policy's tests share


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


@pytest.mark.after_suite  # two 2-rank launches, each a GRPO, a PPO and an SFT run of 2 steps (make test-long)
def test_training_steps_are_the_same_with_and_without_sequence_parallelism(model_dir, tmp_path):
    """2 ranks each with their own samples (data parallel) against the same 2 ranks training all of them together
    with every packed row spread over both (--sequence-parallel 2; tests/dist_trainers_sp.py). Samples are seeded
    per sample, so both runs see the same ones, and each step's loss, entropy and gradient norm are the same (the
    second step's rollouts come from the first step's weights: the update was the same too); PPO's critic and
    advantage whitening too, and SFT's loss, tokens and gradient norm."""
    train, _ = data_prep.toy_rows(16, 0, seed=0, max_ops=1)
    task_rows.write_rows(train, tmp_path / "train.parquet")
    conversations = tmp_path / "conversations.jsonl"
    conversations.write_text("".join(json.dumps({"messages": r["prompt"] + [
        {"role": "assistant", "content": r["extra_info"]["solution"]}]}) + "\n" for r in train))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    runs = {}
    for n in (1, 2):
        out = tmp_path / f"sp{n}"
        result = subprocess.run(
            ranks.torchrun(2, ROOT / "tests" / "dist_trainers_sp.py", model_dir, tmp_path / "train.parquet",
                           conversations, out, n),
            env=env, timeout=900, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        for trainer, key in (("grpo", "actor/pg_loss"), ("ppo", "actor/pg_loss"), ("sft", "train/loss")):
            runs[trainer, n] = [json.loads(line) for line in open(out / trainer / "metrics.jsonl") if key in line]
    for trainer, keys, rel in (("grpo", ("actor/pg_loss", "actor/entropy", "actor/grad_norm"), 1e-4),
                               ("ppo", ("critic/vf_loss", "critic/grad_norm", "actor/pg_loss", "actor/grad_norm",
                                        "critic/advantages/std"), 1e-4),
                               ("sft", ("train/loss", "train/grad_norm", "train/tokens"), 1e-4)):
        assert len(runs[trainer, 1]) == len(runs[trainer, 2]) == 2
        for one, two in zip(runs[trainer, 1], runs[trainer, 2]):
            assert one.get("critic/score/mean") == two.get("critic/score/mean")
            for key in keys:
                assert two[key] == pytest.approx(one[key], rel=rel, abs=1e-6), (trainer, key)
    first = {trainer: runs[trainer, 1][0] for trainer in ("grpo", "ppo")}  # a step with rewards to follow
    assert first["grpo"]["actor/grad_norm"] > 0.1 and first["ppo"]["actor/grad_norm"] > 0.1
    assert first["ppo"]["critic/grad_norm"] > 0 and first["ppo"]["critic/vf_loss"] > 0
    assert runs["sft", 1][0]["train/grad_norm"] > 0.1
