"""Runs that never silently go wrong: every metrics line is JSON with a timestamp, an output dir holding an earlier run
is refused, a resume cuts the logs back to its checkpoint and keeps its wandb run, an unreadable checkpoint is skipped
and the newest one never pruned, a non-finite reward stops the run and a non-finite gradient skips the step, bad
settings fail before anything loads with one line, and every metric is documented in docs/metrics.md."""
import importlib.util
import inspect
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import data_prep  # noqa: E402
import demo  # noqa: E402
import policy  # noqa: E402
import rewards  # noqa: E402
import runlog  # noqa: E402
import task_rows  # noqa: E402
import tiny  # noqa: E402
import ranks  # noqa: E402
import train_grpo  # noqa: E402
import train_ppo  # noqa: E402
import train_sft  # noqa: E402
from checkpoint import load_checkpoint, load_newest_checkpoint, save_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    train, test = data_prep.toy_rows(40, 4, seed=0, max_ops=2)
    task_rows.write_rows(train, root / "train.parquet")
    task_rows.write_rows(test[:2], root / "test.parquet")
    task_rows.write_rows(test[:1], root / "one.parquet")
    corpus = [r["prompt"][-1]["content"] + "\n" + r["extra_info"]["solution"] for r in train]
    return root, tiny.make_tiny_model(root / "model", corpus, seed=0)


@pytest.fixture
def process_group():
    created = not torch.distributed.is_initialized()
    policy.init_distributed()
    yield
    if created:
        torch.distributed.destroy_process_group()


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_lines_are_json_and_a_resume_cuts_the_logs_back(tmp_path):
    log = runlog.start(str(tmp_path), 0, {}, None, resume_step=None)
    for step in range(1, 5):
        log.metrics({"step": step, "actor/grad_norm": float("nan") if step == 2 else 1.0, "x": float("inf")})
        log.samples([{"step": step, "task_id": "toy/0"}])
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    records = [json.loads(line) for line in text.splitlines()]  # strict JSON: no bare NaN
    assert records[1]["actor/grad_norm"] is None and records[0]["x"] is None
    assert all(abs(r["timestamp"] - records[0]["timestamp"]) < 60 for r in records)

    runlog.start(str(tmp_path), 0, {}, None, resume_step=2)  # the checkpoint was at step 2
    assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")] == [1, 2]
    assert [r["step"] for r in lines(tmp_path / "samples.jsonl")] == [1, 2]
    runlog.start(str(tmp_path), 0, {}, None, resume_step=None)  # a fresh run (--overwrite was given)
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "samples.jsonl").exists()


def test_output_dir_policy(tmp_path):
    runlog.check_output_dir(str(tmp_path / "new"), resume=False, overwrite=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        runlog.check_output_dir(str(tmp_path / "file"), resume=False, overwrite=False)
    (tmp_path / "old" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"holds an earlier run \(checkpoints\): pass --resume .* --overwrite"):
        runlog.check_output_dir(str(tmp_path / "old"), resume=False, overwrite=False)
    with pytest.raises(ValueError, match=r"--resume: nothing to resume: --output-dir .*/old holds no checkpoint"):
        runlog.check_output_dir(str(tmp_path / "old"), resume=True, overwrite=False)
    with pytest.raises(ValueError, match=r"--resume: nothing to resume: --output-dir .*/olf does not exist"):
        runlog.check_output_dir(str(tmp_path / "olf"), resume=True, overwrite=False)  # a typo
    (tmp_path / "old" / "checkpoints" / "step_00000002").mkdir()
    runlog.check_output_dir(str(tmp_path / "old"), resume=True, overwrite=False)
    runlog.check_output_dir(str(tmp_path / "old"), resume=False, overwrite=True)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README").write_text("mine")  # not a run's file: not in the way
    runlog.check_output_dir(str(tmp_path / "notes"), resume=False, overwrite=False)


def test_a_run_records_its_config_and_a_resume_may_change_only_its_length(tmp_path):
    """run_config.json holds the resolved Args, the kiln commit and the library versions; a --resume that changes the
    lr or the group size is refused naming each field, one that changes --total-steps goes on and is recorded."""
    config = {"lr": 3e-4, "group_size": 8, "total_steps": 200, "data": "runs/demo/train.parquet", "stop": ("a", "b"),
              "resume": False}
    runlog.start(str(tmp_path), 0, config, None, resume_step=None)
    recorded = json.loads((tmp_path / "run_config.json").read_text())
    assert recorded["args"] == config | {"stop": ["a", "b"]}
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", recorded["kiln_commit"]), recorded["kiln_commit"]
    assert torch.__version__.startswith(recorded["versions"]["torch"])
    assert {"python", "transformers", "tyro"} <= set(recorded["versions"])
    (tmp_path / "checkpoints" / "step_00000004").mkdir(parents=True)

    with pytest.raises(ValueError) as refused:
        runlog.check_output_dir(str(tmp_path), True, False, config | {"lr": 1e-3, "group_size": 4, "resume": True})
    message = str(refused.value)
    assert "--lr 0.001 (the run's: 0.0003); --group-size 4 (the run's: 8)" in message
    assert "Only --total-steps, --steps, --resume, --overwrite, --output-dir" in message and "may change on a resume" in message
    resumed = config | {"total_steps": 32, "resume": True}
    runlog.check_output_dir(str(tmp_path), True, False, resumed)
    runlog.start(str(tmp_path), 0, resumed, None, resume_step=4)
    recorded = json.loads((tmp_path / "run_config.json").read_text())
    assert recorded["args"]["total_steps"] == 200  # what the run started with; each resume says what it changed
    assert recorded["resumes"][0]["step"] == 4 and recorded["resumes"][0]["changed"] == {"total_steps": 32,
                                                                                         "resume": True}


def test_pruning_keeps_the_newest_and_an_unreadable_checkpoint_is_skipped(toy, tmp_path, process_group, capsys):
    _, model_dir = toy
    model = policy.shard_model(policy.load_model(model_dir))
    optimizer = policy.adamw(model, 1e-3, 0.0)

    def save(step, out=tmp_path):
        return save_checkpoint(out, step, model, optimizer, {"step": step}, hf_source_dir=model_dir,
                               keep_last=2)

    def steps(out=tmp_path):
        return sorted(p.name for p in (out / "checkpoints").glob("step_*"))

    for step in (2, 4, 6, 8):
        save(step)
    assert steps() == ["step_00000006", "step_00000008"]
    save(7)  # a resumed run went on from step 6: its step 7 stays, the abandoned step 8 goes
    assert steps() == ["step_00000006", "step_00000007"]
    save(1)
    assert steps() == ["step_00000001"]

    def load(path):
        return load_checkpoint(path, model, optimizer)

    for step in (2, 4):
        save(step, tmp_path / "a")
    assert load_newest_checkpoint(tmp_path / "a", load)[1] == {"step": 4}
    distcp = sorted((tmp_path / "a" / "checkpoints" / "step_00000004").glob("*.distcp"))[0]
    distcp.write_bytes(distcp.read_bytes()[:1000])  # a truncated shard
    path, state = load_newest_checkpoint(tmp_path / "a", load)
    assert path.name == "step_00000002" and state == {"step": 2}
    assert "checkpoint " + str(tmp_path / "a" / "checkpoints" / "step_00000004") + " is unreadable" in \
        capsys.readouterr().out
    (tmp_path / "a" / "checkpoints" / "step_00000002" / "trainer_state.json").write_text('{"step": ')
    assert load_newest_checkpoint(tmp_path / "a", load) == (None, None)
    assert "trainer_state.json: Expecting value" in capsys.readouterr().out


def test_settings_are_refused_before_anything_loads(toy, tmp_path, process_group, monkeypatch):
    root, model = toy
    (tmp_path / "file").write_text("x")
    base = dict(model=str(model), data=str(root / "train.parquet"), output_dir=str(tmp_path / "out"))
    monkeypatch.setattr(policy, "load_model", lambda *a, **k: pytest.fail("a model loaded before the check"))
    cases = [
        (dict(group_size=1), r"--advantage grpo compares samples of a group: --group-size must be >= 2"),
        (dict(group_size=0), r"--group-size must be > 0"),
        (dict(total_steps=-5), r"--total-steps must be >= 0"),
        (dict(prompts_per_step=0), r"--prompts-per-step must be > 0"),
        (dict(max_new_tokens=0), r"--max-new-tokens must be > 0"),
        (dict(temperature=0.0), r"--temperature must be > 0"),
        (dict(output_dir=str(tmp_path / "file")), r"--output-dir .*file is a file"),
        (dict(model=str(tmp_path / "no-such-model")), r"--model .*no-such-model: model folder does not exist"),
    ]
    if importlib.util.find_spec("vllm") is None:
        cases.append((dict(engine="vllm"), r"vllm is not installed .* on CPU pass --engine hf"))
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            train_grpo.setup(train_grpo.Args(**base | overrides), rewards.score_batch)
    train_grpo.check_args(train_grpo.Args(**base | dict(group_size=1, advantage="reinforce++")), 1)
    for overrides, message in [(dict(max_new_tokens=0), r"--max-new-tokens must be > 0"),
                               (dict(critic_model=str(tmp_path / "nope")), r"--critic-model .*nope: model folder"),
                               (dict(total_steps=-1), r"--total-steps must be >= 0")]:
        with pytest.raises(ValueError, match=message):
            train_ppo.setup(train_ppo.Args(**base | dict(eval_data=None) | overrides), rewards.score_batch)
    with pytest.raises(ValueError, match=r"--model .*nope: model folder does not exist"):
        train_sft.main(train_sft.Args(model=str(tmp_path / "nope"), data=base["data"], output_dir=base["output_dir"]))

    # A data_source without a reward function is named when the rows load, not after the first rollout.
    rows = task_rows.load_rows(root / "train.parquet")
    task_rows.write_rows([r | {"data_source": "my_task"} for r in rows[:4]], tmp_path / "mine.parquet")
    with pytest.raises(ValueError, match=r"mine.parquet: no reward function for data_source 'my_task'; known: apps"):
        train_grpo.setup(train_grpo.Args(**base | dict(data=str(tmp_path / "mine.parquet"))), rewards.score_batch)
    with pytest.raises(ValueError, match=r"no reward function for data_source 'my_task'"):
        rewards.main(rewards.ScoreArgs(samples=str(tmp_path / "none.jsonl"), data=str(tmp_path / "mine.parquet")))


def test_score_out_is_checked_first_and_written_whole_after_the_report(toy, tmp_path, capsys):
    root, _ = toy
    rows = task_rows.load_rows(root / "test.parquet")
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"task_id": task_rows.row_id(r), "completion": "```python\n"
                                           + r["extra_info"]["solution"] + "\n```"}) + "\n" for r in rows))
    for bad in (dict(workers=0), dict(timeout=0.0), dict(timeout=-1.0)):
        with pytest.raises(ValueError, match="--workers and --timeout must be > 0"):
            rewards.main(rewards.ScoreArgs(samples=str(samples), data=str(root / "test.parquet"), **bad))
    for out, message in ((tmp_path, "is a directory"), (tmp_path / "nodir" / "x.jsonl", "does not exist")):
        with pytest.raises(ValueError, match=message):
            rewards.main(rewards.ScoreArgs(samples=str(samples), data=str(root / "test.parquet"), out=str(out)))
    assert "samples in" not in capsys.readouterr().out  # refused before grading
    out = tmp_path / "results.jsonl"
    out.write_text("an earlier file\n")
    rewards.main(rewards.ScoreArgs(samples=str(samples), data=str(root / "test.parquet"), out=str(out)))
    printed = capsys.readouterr().out
    assert printed.index("mean reward") < printed.index(f"results: {out}")
    assert [r["score"] for r in lines(out)] == [1.0, 1.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl", "samples.jsonl"]  # no temp file left


def readme_pattern(key: str) -> str:
    """docs/metrics.md's spelling of a metric key: data sources, difficulties and error kinds are placeholders."""
    key = re.sub(r"^(critic/score)/(?!mean$|std$|max$|min$|pass_rate$|grader_errors$)(error/)?[^/]+(/mean)?$",
                 lambda m: f"{m.group(1)}/{'error/<kind>' if m.group(2) else '<source>/mean'}", key)
    key = re.sub(r"^val-aux/error/.+$", "val-aux/error/<kind>", key)
    key = re.sub(r"^val-aux/(?!error/).+?/band/[^/]+$", "val-aux/<group>/band/<band>", key)
    return re.sub(r"^(val-core|val-aux)/(?!all/reward)[^@]+?/(pass@\d+|tasks|test_pass_rate)$",
                  lambda m: f"{m.group(1)}/<group>/{'pass@<k>' if m.group(2).startswith('pass@') else m.group(2)}", key)


def test_readme_patterns():
    assert readme_pattern("critic/score/toy/mean") == "critic/score/<source>/mean"
    assert readme_pattern("critic/score/error/no_code") == "critic/score/error/<kind>"
    assert readme_pattern("critic/score/pass_rate") == "critic/score/pass_rate"
    assert readme_pattern("critic/score/grader_errors") == "critic/score/grader_errors"
    assert readme_pattern("val-core/apps/interview/pass@1") == "val-core/<group>/pass@<k>"
    assert readme_pattern("val-aux/all/tasks") == "val-aux/<group>/tasks"
    assert readme_pattern("val-core/all/reward/mean") == "val-core/all/reward/mean"
    assert readme_pattern("val-core/apps/interview/test_pass_rate") == "val-core/<group>/test_pass_rate"
    assert readme_pattern("val-aux/all/band/very_poor") == "val-aux/<group>/band/<band>"


def undocumented(keys) -> set[str]:
    table = (ROOT / "docs" / "metrics.md").read_text()
    return {k for k in keys if f"`{readme_pattern(k)}`" not in table}


@pytest.mark.slow
def test_grpo_resume_after_an_unreadable_checkpoint(toy, tmp_path, monkeypatch, capsys):
    """A 4-step run with checkpoints at 2 and 4 whose step-4 checkpoint is then cut short: --resume warns, goes on
    from step 2, and leaves every step and sample recorded once, equal to the first run's; wandb keeps one run id.
    A fresh run into the same dir is refused. Every metric the run logged is documented in docs/metrics.md."""
    root, model = toy
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "out"
    args = train_grpo.Args(model=str(model), data=str(root / "train.parquet"), eval_data=str(root / "test.parquet"),
                           output_dir=str(out), total_steps=4, save_every=2, sample_every=1, prompts_per_step=2,
                           group_size=2, max_new_tokens=8, lr=1e-3, wandb_project="kiln-test")
    train_grpo.main(args)
    first = lines(out / "metrics.jsonl")
    printed = capsys.readouterr().out
    assert re.search(r"eval step 0: all pass@1 \d\.\d{3} \| toy pass@1 \d\.\d{3} \| reward \d\.\d{3}", printed)
    assert "eval step 4: all pass@1" in printed
    assert not undocumented({k for record in first for k in record})
    (out / "checkpoints" / "step_00000004" / "trainer_state.json").write_text('{"step": 4,')

    with pytest.raises(ValueError, match="holds an earlier run"):
        train_grpo.main(args)
    train_grpo.main(args.__class__(**vars(args) | {"resume": True}))
    assert "step_00000004 is unreadable (ValueError" in capsys.readouterr().out
    again = lines(out / "metrics.jsonl")
    assert [r["step"] for r in again] == [0, 1, 2, 3, 4]  # step 0 is the first evaluation; step 4 holds the last
    skip = ("timing_s/", "perf/", "rollout/seconds", "rollout/tokens_per_s", "timestamp")
    for a, b in zip(first, again):
        assert {k: v for k, v in a.items() if not k.startswith(skip)} == \
            {k: v for k, v in b.items() if not k.startswith(skip)}
    assert [s["step"] for s in lines(out / "samples.jsonl")] == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    runs = sorted(p.name for p in (out / "wandb").glob("offline-run-*"))
    # offline-run-<start time>-<run id>, and "-1" after it when both started within one second
    ids = {re.fullmatch(r"offline-run-\d{8}_\d{6}-([a-z0-9]+)(-\d+)?", name).group(1) for name in runs}
    assert len(runs) == 2 and len(ids) == 1, runs


@pytest.mark.slow
def test_grpo_nan_reward_stops_and_nan_gradient_skips_the_step(toy, tmp_path, process_group):
    root, model = toy
    args = train_grpo.Args(model=str(model), data=str(root / "train.parquet"), output_dir=str(tmp_path),
                           prompts_per_step=2, group_size=2, max_new_tokens=8, lr=1e-2, sample_every=1,
                           tools="python", max_turns=1)

    def score(rows, texts, sample_infos=None):  # the judge failed to parse its answer for the second sample
        return [rewards.Reward(float("nan") if i == 1 else 0.5 * i, {"judge": "parsed"}) for i in range(len(texts))]

    run = train_grpo.setup(args, score)

    def weights():
        return [p.full_tensor().clone() for p in run.model.parameters()]

    before = weights()
    task = task_rows.row_id(task_rows.in_epoch_order(run.rows, 0, 2, args.seed)[0])
    with pytest.raises(RuntimeError, match=rf"step 1: non-finite reward nan for task {task} \(1 sample"):
        train_grpo.train_step(run)
    assert all(torch.equal(a, b) for a, b in zip(weights(), before))

    # --nonfinite-rewards drop: the sample leaves the batch (its group's advantages come from the others), counted.
    run.args.nonfinite_rewards = "drop"
    metrics = train_grpo.train_step(run)
    assert metrics["critic/score/nonfinite_dropped"] == 1 and metrics["critic/score/mean"] == pytest.approx((0 + 1 + 1.5) / 3)
    assert metrics["actor/skipped_step"] == 0 and all(torch.isfinite(p.full_tensor()).all() for p in run.model.parameters())
    before = weights()
    run.args.nonfinite_rewards = "stop"

    # A reward function that works, and a gradient that does not: the optimizer step is skipped and counted.
    run.score_fn = lambda rows, texts, sample_infos=None: [rewards.Reward(float(i % 2), {"judge": "parsed"})
                                                          for i in range(len(texts))]
    hook = run.model.model.layers[0].mlp.register_full_backward_pre_hook(  # backward only: generation is unharmed
        lambda module, grad_output: tuple(g * float("nan") for g in grad_output))
    metrics = train_grpo.train_step(run)
    run.log.metrics(metrics | {"step": 1})
    assert metrics["actor/skipped_step"] == 1 and math.isnan(metrics["actor/grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(weights(), before))
    assert lines(tmp_path / "metrics.jsonl")[-1]["actor/grad_norm"] is None
    hook.remove()
    metrics = train_grpo.train_step(run)
    assert metrics["actor/skipped_step"] == 0 and not all(torch.equal(a, b) for a, b in zip(weights(), before))
    # A multi-turn sample keeps the rollout's messages (tool output included) next to the reward's info.
    record = lines(tmp_path / "samples.jsonl")[0]
    assert record["step"] == 1 and record["messages"][-1]["role"] == "assistant"
    assert record["messages"][-1]["content"] == record["completion"]


@pytest.mark.slow
def test_sft_refuses_an_earlier_run_and_overwrite_starts_clean(toy, tmp_path):
    root, model = toy
    args = train_sft.Args(model=str(model), data=str(root / "train.parquet"), output_dir=str(tmp_path), steps=2,
                          batch_size=4, micro_batch_tokens=1024)
    train_sft.main(args)
    with pytest.raises(ValueError, match="holds an earlier run"):
        train_sft.main(args)
    train_sft.main(args.__class__(**vars(args) | {"overwrite": True}))
    assert json.loads((tmp_path / "run_config.json").read_text())["args"]["lr"] == args.lr
    with pytest.raises(ValueError, match=r"--resume with other settings .*: --lr 0\.001 \(the run's: 1e-05\)"):
        train_sft.main(args.__class__(**vars(args) | {"resume": True, "lr": 1e-3}))
    records = lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert {"train/loss", "train/grad_norm", "train/lr", "train/tokens", "train/skipped_step"} <= set(records[0])
    assert not undocumented(records[0])


@pytest.mark.slow
def test_a_known_error_under_torchrun_is_one_line(toy, tmp_path):
    root, model = toy
    result = subprocess.run(
        [*ranks.torchrun(2, ROOT / "train_grpo.py"), "--model", str(model), "--data", str(root / "train.parquet"),
         "--eval-data", str(root / "one.parquet"), "--output-dir", str(tmp_path / "out"), "--prompts-per-step", "2"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    error = f"error: {root / 'one.parquet'}: 1 eval rows for 2 ranks; need at least one each"
    assert errors == [error], result.stderr
    # No rank's traceback: what follows the line is torchrun's own report of the failed ranks, which ends with it.
    assert 'train_grpo.py", line' not in result.stderr and result.stderr.count("Traceback") <= 1
    last = [line.strip() for line in result.stderr.splitlines() if line.strip().strip("=")][-1]
    assert last == f"traceback : {error}", result.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_curves_label_their_axes_and_smooth_the_train_curves(tmp_path, monkeypatch):
    assert demo.smoothed([0, 1, 2, 3, 4, 5, 6], window=3) == [0, 0.5, 1, 2, 3, 4, 5]
    records = [{"step": 0, "val-core/all/pass@1": 0.4, "val-aux/all/tasks": 100}]
    records += [{"step": s, "critic/score/mean": s / 10, "critic/score/pass_rate": s / 20} for s in range(1, 8)]
    records += [{"step": 7, "val-core/all/pass@1": 0.8, "val-aux/all/tasks": 100}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    figures = []
    monkeypatch.setattr(demo.Figure, "savefig", lambda self, *a, **k: figures.append(self))
    demo.plot(tmp_path / "metrics.jsonl", tmp_path / "curves.png", seed=0)
    ax = figures[0].axes[0]
    assert ax.get_xlabel().startswith("GRPO step") and ax.get_ylabel() == "reward / pass rate"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("held-out pass@1, greedy (100 tasks" in t for t in legend)
    assert any("sampled at T=1 (mean of 5 steps)" in t for t in legend)
    smooth = [line for line in ax.get_lines() if line.get_label().startswith("train reward")][0]
    assert list(smooth.get_ydata()) == pytest.approx(demo.smoothed([s / 10 for s in range(1, 8)]))


def test_data_prep_says_what_it_wrote_and_documents_every_flag(tmp_path, capsys):
    data_prep.toy(tmp_path / "toy.parquet", split="test", n_train=5, n_test=2)
    assert capsys.readouterr().out == f"wrote 2 rows to {tmp_path / 'toy.parquet'} (toy: 2)\n"
    for command in (data_prep.humaneval, data_prep.mbpp, data_prep.apps, data_prep.toy):
        for name in inspect.signature(command).parameters:
            assert re.search(rf"^\s+{name}: \S", command.__doc__, re.M), (command.__name__, name)
