"""GRPO with a vision-language policy end to end on CPU: a tiny Qwen2.5-VL, warm-started to write a code action and
then an answer, trains for 2 steps on 2 torchrun ranks on vision_toy rows with the CodeV tag protocol (the Python tool
on the row's image) and the rule reward: every trajectory matches the chat template's rendering, the tool ran, the
vision tower's weights got gradients and changed, and a run resumed from its step-1 checkpoint repeats step 2."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import chat  # noqa: E402
import data_prep  # noqa: E402
import policy  # noqa: E402
import ranks  # noqa: E402
import task_rows  # noqa: E402
import tiny  # noqa: E402
from checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow

CODE = "<code>```python\nprint(image.size)\n```</code>"


def conversation(row: dict) -> list[dict]:
    """The warm start's target: run code on the image, read its output, answer."""
    return [*row["prompt"], {"role": "assistant", "content": CODE},
            chat.observation_message("(256, 256)\n", 0),
            {"role": "assistant", "content": f"<answer>{row['reward_model']['ground_truth']}</answer>"}]


def warm_start(model_dir: Path, rows: list[dict], steps: int = 120) -> None:
    """A few SFT steps on `conversation`s (packed, with the rows' images), saved over the folder's weights."""
    tokenizer = policy.load_tokenizer(model_dir)
    model = policy.load_model(model_dir, attn_implementation="packed_sdpa")
    encoded = [chat.encode_conversation(tokenizer, conversation(row)) for row in rows]
    images = [task_rows.row_images(row) for row in rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        pick = torch.randperm(len(rows), generator=generator)[:4].tolist()
        logprobs, _ = policy.packed_logprobs(model, [encoded[i][0] for i in pick], images=[images[i] for i in pick])
        mask = torch.tensor([m for i in pick for m in encoded[i][1]], dtype=torch.float32)
        loss = -(logprobs * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision_grpo")
    rows, _ = data_prep.vision_toy_rows(16, 0, seed=0, size=256, families=("dots",))
    task_rows.write_rows(rows, root / "train.parquet")
    corpus = [json.dumps(conversation(row)) for row in rows] * 4 + [data_prep.CODEV_SYSTEM] * 20
    model = tiny.make_tiny_vlm(root / "model", corpus, seed=0)
    warm_start(model, rows)
    return root, model


# What the wall clock decides: times, and how the independent scheduler's engine calls formed around tool timing.
SCHEDULE = ("timing_s/", "perf/", "rollout/seconds", "rollout/tokens_per_s", "timestamp", "tools/seconds",
            "tools/agent_seconds", "rollout/engine_busy_frac", "tools/busy_frac", "rollout/engine_calls",
            "rollout/in_flight_mean", "tools/running_max")


def deterministic(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(SCHEDULE)}


def assert_same_step(got: dict, want: dict) -> None:
    """Every sample's tokens come from its own seeds, so a repeated step has the same samples, rewards and update,
    exactly. The engine's logprobs alone may move in the last bits: which trajectories share an HFEngine call follows
    the tools' timing, and a batch's padding and size change fp32 rounding on CPU (a logprob moves by 4.8e-7 at most
    over 169 rows of the tiny text and vision models; test_rollout holds it to 1e-6). mismatch/engine_abs, a mean of
    them, is held to 1e-6 (3.6e-9 apart in one run)."""
    got, want = deterministic(got), deterministic(want)
    assert got.pop("mismatch/engine_abs") == pytest.approx(want.pop("mismatch/engine_abs"), abs=1e-6, rel=0)
    assert got == want


def test_two_rank_grpo_on_vision_toy_with_the_python_tool(task, tmp_path):
    root, model = task
    out = tmp_path / "run"
    command = [*ranks.torchrun(2, ROOT / "train_grpo.py"), "--model", str(model), "--data", str(root / "train.parquet"),
               "--output-dir", str(out), "--tools", "codev", "--max-turns", "2", "--prompts-per-step", "2",
               "--group-size", "4", "--max-new-tokens", "24", "--max-total-tokens", "1024",
               "--max-prompt-tokens", "1000", "--total-steps", "2", "--lr", "1e-3", "--check-tito",
               "--save-every", "1", "--micro-batch-tokens", "4096", "--seed", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    steps = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [m for m in steps if "critic/score/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["tools/tito_drift_frac"] == 0 for m in steps)  # every trajectory is the template's rendering
    assert any(m["tools/calls_mean"] > 0 for m in steps)  # the policy's code ran on the image
    assert any(m["actor/grad_norm"] > 0 for m in steps)
    assert max(m["mismatch/engine_abs"] for m in steps) <= 1e-3  # HFEngine and the trainer: one distribution

    initial, trained = policy.load_model(model), policy.load_model(model)
    load_checkpoint(latest_checkpoint(out), trained)
    visual = [(name, a, b) for (name, a), (_, b) in zip(initial.named_parameters(), trained.named_parameters())
              if ".visual." in name]
    assert visual and all(not torch.equal(a, b) for _, a, b in visual), [n for n, a, b in visual if torch.equal(a, b)]

    # Resume from the step-1 checkpoint: step 2 again, with the same samples, rewards and update.
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000002")
    command[command.index(str(out))] = str(resumed)
    result = subprocess.run(command + ["--resume"], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    again = [json.loads(line) for line in open(resumed / "metrics.jsonl")]
    again = {m["step"]: m for m in again if "critic/score/mean" in m}
    assert sorted(again) == [1, 2]
    assert_same_step(again[2], steps[1])
