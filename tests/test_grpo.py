"""GRPO end to end on CPU: 2-rank torchrun runs with the real sandboxed code reward, resume after a kill,
train-vs-engine logprob agreement, and a learning check on a reward a tiny model learns fast."""
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import data_prep  # noqa: E402
import policy  # noqa: E402
import ranks  # noqa: E402
import rewards  # noqa: E402
import rl_run  # noqa: E402
import rollout  # noqa: E402
import task_rows  # noqa: E402
import tiny  # noqa: E402
import train_grpo  # noqa: E402
import train_sft  # noqa: E402
from checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402
from wandb_offline import logged, offline_run  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    train, test = data_prep.toy_rows(200, 16, seed=0, max_ops=2)
    task_rows.write_rows(train, root / "train.parquet")
    task_rows.write_rows(test, root / "test.parquet")
    corpus = [r["prompt"][-1]["content"] + "\n" + r["extra_info"]["solution"] for r in train]
    model = tiny.make_tiny_model(root / "model", corpus, seed=0)
    # A short SFT warm start, so that some samples earn partial credit and GRPO has a signal to follow.
    train_sft.main(train_sft.Args(model=str(model), data=str(root / "train.parquet"), output_dir=str(root / "sft"),
                                  steps=150, lr=3e-3, batch_size=32, micro_batch_tokens=1024))
    return root, root / "sft" / "hf"


def grpo_command(root: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return [*ranks.torchrun(2, ROOT / "train_grpo.py"), "--model", str(model), "--data", str(root / "train.parquet"),
            "--output-dir", str(out), "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "64",
            "--lr", "1e-3", "--micro-batch-tokens", "512", "--save-every", "2", "--sample-every", "2", "--seed", "1", *extra]


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def metrics_by_step(out: Path) -> dict[int, dict]:
    """The last record of each training step (a resumed run rewrites the steps after its checkpoint)."""
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return {m["step"]: m for m in records if "critic/score/mean" in m}


def deterministic(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(("timing_s/", "perf/", "rollout/seconds", "timestamp",
                                                                  "rollout/tokens_per_s", "val-core/", "val-aux/"))}


def test_two_ranks_with_code_reward_then_kill_and_resume(task, tmp_path):
    root, model = task
    straight = tmp_path / "straight"
    subprocess.run(grpo_command(root, model, straight, "--total-steps", "6", "--eval-data",
                                str(root / "test.parquet"), "--eval-every", "3"),
                   check=True, env=env(), timeout=600)
    steps = metrics_by_step(straight)
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    for key in ["critic/score/mean", "critic/score/std", "critic/score/pass_rate", "critic/score/toy/mean",
                "response_length/mean", "actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac",
                "actor/pg_clipfrac_low", "actor/pg_clipfrac_high", "actor/grad_norm", "actor/skipped_step",
                "mismatch/engine_abs", "timing_s/rollout", "timing_s/reward", "timing_s/update", "perf/tokens_per_s",
                "actor/lr", "timestamp"]:
        assert all(key in m and math.isfinite(m[key]) for m in steps.values()), key
    # The same model generates and trains (HF engine), so the logprobs agree up to float noise.
    assert max(m["mismatch/engine_abs"] for m in steps.values()) <= 1e-3
    assert any(m["actor/grad_norm"] > 0 for m in steps.values())  # a step whose groups all tie has no gradient
    evals = [json.loads(line) for line in open(straight / "metrics.jsonl")]
    assert [m["step"] for m in evals if "val-core/all/pass@1" in m] == [0, 3, 6]
    samples = [json.loads(line) for line in open(straight / "samples.jsonl")]
    assert {s["step"] for s in samples} == {2, 4, 6} and all(s["task_id"].startswith("toy/") for s in samples)

    # Parameters changed: the last checkpoint differs from the initial model.
    checkpoint = latest_checkpoint(straight)
    assert checkpoint.name == "step_00000006"
    initial, trained = policy.load_model(model), policy.load_model(model)
    load_checkpoint(checkpoint, trained)
    changed = [n for (n, a), (_, b) in zip(initial.named_parameters(), trained.named_parameters())
               if not torch.equal(a, b)]
    assert len(changed) == len(list(initial.parameters()))

    # Kill a second run once its step-2 checkpoint is complete, resume it: the remaining steps are identical.
    killed = tmp_path / "killed"
    proc = subprocess.Popen(grpo_command(root, model, killed, "--total-steps", "6"), env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while latest_checkpoint(killed) is None and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    ranks.kill(proc)  # torchrun and its ranks: each rank has a session of its own, out of torchrun's group
    resumed_from = latest_checkpoint(killed)
    assert resumed_from is not None
    start = json.loads((resumed_from / "trainer_state.json").read_text())["step"]
    assert start < 6
    subprocess.run(grpo_command(root, model, killed, "--total-steps", "6", "--resume"), check=True, env=env(),
                   timeout=600)
    again = metrics_by_step(killed)
    for step in range(start + 1, 7):
        assert deterministic(again[step]) == deterministic(steps[step]), step


@dataclass
class Score:
    score: float
    info: dict


def test_tiny_model_learns_a_simple_reward(task, tmp_path):
    """Reward = fraction of characters that are 'x': a signal GRPO must push up within a few dozen steps."""

    root, model = task

    def x_fraction(rows, texts, sample_infos=None):
        return [Score(t.count("x") / max(1, len(t)), {}) for t in texts]

    args = train_grpo.Args(model=str(model), data=str(root / "train.parquet"), output_dir=str(tmp_path),
                           total_steps=30, max_new_tokens=16, lr=3e-3, prompts_per_step=8, group_size=8,
                           save_every=1000, sample_every=0, seed=0)
    train_grpo.main(args, score_fn=x_fraction)
    rewards = [m["critic/score/mean"] for m in metrics_by_step(tmp_path).values()]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-5:]) / 5  # the first two steps are (almost) untrained
    assert last > 2 * first and last - first > 0.15, rewards



def test_wandb_offline_logs_every_metric_of_every_step(task, tmp_path, monkeypatch):
    """--wandb-project with WANDB_MODE=offline (no network): the run lands under <output_dir>/wandb, and its log holds
    every key and value that metrics.jsonl holds (the step as wandb's own)."""

    root, model = task
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = train_grpo.Args(model=str(model), data=str(root / "train.parquet"), output_dir=str(tmp_path),
                           total_steps=2, max_new_tokens=8, prompts_per_step=4, group_size=2, save_every=1000,
                           sample_every=0, wandb_project="kiln-test")
    train_grpo.main(args, score_fn=lambda rows, texts, sample_infos=None: [Score(t.count("x") / max(1, len(t)), {})
                                                                           for t in texts])
    run = offline_run(tmp_path)
    steps = metrics_by_step(tmp_path)
    assert sorted(steps) == [1, 2]
    for metrics in steps.values():
        missing = {k: v for k, v in metrics.items()
                   if k not in ("step", "timestamp") and not logged(run, k, v)}  # wandb stamps its own time
        assert not missing, missing


def test_minibatches_take_whole_groups_and_an_empty_one_takes_no_step(tmp_path):
    """update_policy() with --minibatches 2 on what dynamic sampling left of a batch, one group: one minibatch trains on
    the whole group, and the other is empty on every rank and must not step (AdamW's momentum would still move
    weights)."""

    model_dir = tiny.make_tiny_model(tmp_path / "model", ["def f(x):\n    return x + 1\n"] * 20)
    created = not torch.distributed.is_initialized()
    try:
        policy.init_distributed()
        model = policy.shard_model(policy.load_model(model_dir))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        args = train_grpo.Args(model=str(model_dir), minibatches=2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        run = train_grpo.Run(args=args, rank=0, world=1, model=model, ref_model=None, teacher=None, optimizer=optimizer,
                             scheduler=scheduler, engine=None, tokenizer=None, sampling=None, limits=None, rows=[],
                             eval_rows=[], score_fn=None, judge=None, log=None)
        batch = [rollout.Sample(prompt_ids=[1, 2, 3], completion_ids=completion, loss_mask=[1, 1],
                                engine_logprobs=[0.0, 0.0], row={}, group=5, advantage=advantage)
                 for completion, advantage in (([40, 41], 1.0), ([42, 43], -1.0))]

        def weights():
            return [p.full_tensor().clone() for p in model.parameters()]

        before = weights()
        assert policy.minibatch([5, 5], 2, 0) == []
        correction = rl_run.rollout_correction(run, None, batch)  # none asked for: the loss masks as they are
        advantages = policy.padded([[s.advantage] * 2 for s in batch])
        assert train_grpo.update_policy(run, batch, 0, None, None, correction, advantages) == {}
        assert all(torch.equal(a, b) for a, b in zip(weights(), before))
        stats = train_grpo.update_policy(run, batch, 1, None, None, correction, advantages)
        assert stats["actor/grad_norm"] > 0 and math.isfinite(stats["actor/pg_loss"])
        assert not any(torch.equal(a, b) for a, b in zip(weights(), before))
        with pytest.raises(ValueError, match="--minibatches 9 needs as many prompts per rank"):
            train_grpo.setup(train_grpo.Args(model=str(model_dir), minibatches=9, prompts_per_step=8), None)
    finally:
        if created:
            torch.distributed.destroy_process_group()


def test_best_policy_follows_the_chosen_metric(tmp_path):
    """evaluate() at three steps whose rewards (scripted per step, with test counts) rank them differently by mean
    test pass rate (the default --best-metric) and by pass@1: best/ and best.json follow the chosen metric, the eval
    report holds every evaluation and the last one's band picture, and an unknown metric is refused by name."""
    train, test = data_prep.toy_rows(20, 4, seed=0, max_ops=2)
    task_rows.write_rows(test, tmp_path / "test.parquet")
    model_dir = tiny.make_tiny_model(tmp_path / "model", [r["prompt"][-1]["content"] for r in train], seed=0)
    # (passed, total) of the 4 rows at each step: one full pass then nothing; 2/3 everywhere; 1/3 everywhere.
    tests_passed = {0: [(3, 3), (0, 3), (0, 3), (0, 3)], 1: [(2, 3)] * 4, 2: [(1, 3)] * 4}
    index = {task_rows.row_id(r): i for i, r in enumerate(test)}

    def run_with(best_metric: str, out: Path):
        run = train_grpo.setup(train_grpo.Args(
            model=str(model_dir), data=str(tmp_path / "test.parquet"), eval_data=str(tmp_path / "test.parquet"),
            output_dir=str(out), max_new_tokens=4, prompts_per_step=4, best_metric=best_metric), None)

        def scripted(rows, texts, sample_infos=None):
            counts = [tests_passed[run.step][index[task_rows.row_id(r)]] for r in rows]
            return [rewards.Reward(p / t, {"passed": p, "total": t, "verdicts": []}) for p, t in counts]

        run.score_fn = scripted
        metrics = []
        for step in (0, 1, 2):
            run.step = step
            metrics.append(rl_run.evaluate(run))
        return run, metrics

    created = not torch.distributed.is_initialized()
    try:
        run, metrics = run_with("val-core/all/test_pass_rate", tmp_path / "by_pass_rate")
        assert [m["val-core/all/test_pass_rate"] for m in metrics] == pytest.approx([0.25, 2 / 3, 1 / 3])
        assert [m["val-core/all/pass@1"] for m in metrics] == [0.25, 0.0, 0.0]
        assert metrics[1]["val-aux/all/band/good"] == 1.0 and metrics[0]["val-aux/all/band/very_poor"] == 0.75
        best = json.loads((tmp_path / "by_pass_rate" / "best" / "best.json").read_text())
        assert best["step"] == 1 and run.best == {"step": 1, "metric": "val-core/all/test_pass_rate",
                                                  "value": pytest.approx(2 / 3)}
        assert policy.load_model(tmp_path / "by_pass_rate" / "best").config.num_hidden_layers == 2
        report = json.loads((tmp_path / "by_pass_rate" / "eval_report.json").read_text())
        assert report["best"]["step"] == 1 and [e["step"] for e in report["evals"]] == [0, 1, 2]
        md = (tmp_path / "by_pass_rate" / "eval_report.md").read_text()
        assert "| 1 (best) | 0.000 |" in md and "## Step 2 (the last evaluation)" in md
        png = (tmp_path / "by_pass_rate" / "eval_report.png").read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000

        run, _ = run_with("val-core/all/pass@1", tmp_path / "by_pass_at_1")
        assert json.loads((tmp_path / "by_pass_at_1" / "best" / "best.json").read_text())["step"] == 0
        with pytest.raises(ValueError, match=r"--best-metric val-core/all/nope: this evaluation has no such metric "
                                             ".*; it has val-aux/all/band/excellent"):
            run_with("val-core/all/nope", tmp_path / "nope")
        with pytest.raises(ValueError, match="must be an evaluation metric"):
            run_with("reward/mean", tmp_path / "nope")
    finally:
        if created:
            torch.distributed.destroy_process_group()
