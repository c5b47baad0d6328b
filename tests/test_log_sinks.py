"""--log-to wandb,tensorboard,trackio,mlflow: every sink holds what metrics.jsonl holds, by name and step, read back
from each sink's own local store (TensorBoard's event files, trackio's database, MLflow's file store, wandb's offline
log); a resumed run goes on in the same sink runs; an unknown or missing sink fails in one line before anything
loads."""
import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# trackio reads $TRACKIO_DIR once, at import: its databases go to a folder of this test session's own.
os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="kiln-trackio-")
atexit.register(shutil.rmtree, os.environ["TRACKIO_DIR"], ignore_errors=True)
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from trackio.sqlite_storage import SQLiteStorage

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import data_prep  # noqa: E402
import runlog  # noqa: E402
import task_rows  # noqa: E402
import tiny  # noqa: E402
import script_runner  # noqa: E402
import train_grpo  # noqa: E402
from wandb_offline import logged, offline_run  # noqa: E402

ALL = "wandb,tensorboard,trackio,mlflow"


@pytest.fixture
def sink_env(tmp_path, monkeypatch):
    """Every sink's store local: wandb offline, trackio's databases in the session's folder (one project per test),
    MLflow's default file store in the output dir."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def expected(out: Path) -> dict[tuple[str, int], float]:
    """metrics.jsonl's numbers as (name, step) -> value: what every scalar sink must hold."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {(k, r["step"]): float(v) for r in records for k, v in r.items()
            if k not in ("step", "timestamp") and isinstance(v, (int, float)) and not isinstance(v, bool)}


def tensorboard_values(out: Path) -> dict[tuple[str, int], float]:
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}


def trackio_values(out: Path, project: str) -> dict[tuple[str, int], float]:
    run = json.loads((out / "sink_runs.json").read_text())["trackio"]
    assert SQLiteStorage.get_runs(project) == [run]
    return {(k, log["step"]): float(v) for log in SQLiteStorage.get_logs(project, run) for k, v in log.items()
            if k not in ("step", "timestamp") and isinstance(v, (int, float)) and not isinstance(v, bool)}


def mlflow_values(out: Path) -> tuple[dict[tuple[str, int], float], int]:
    client = MlflowClient((out / "mlruns").resolve().as_uri())
    run_id = json.loads((out / "sink_runs.json").read_text())["mlflow"]
    run = client.get_run(run_id)
    values = {(key, m.step): m.value for key in run.data.metrics for m in client.get_metric_history(run_id, key)}
    return values, len(client.search_runs([run.info.experiment_id]))


def assert_sinks_hold_metrics(out: Path, project: str) -> dict:
    want = expected(out)
    assert tensorboard_values(out) == pytest.approx(want)  # float32 in the event files
    assert trackio_values(out, project) == want
    mlflow, runs = mlflow_values(out)
    assert mlflow == {(runlog.mlflow_name(k), step): v for (k, step), v in want.items()} and runs == 1
    log = offline_run(out, runs=2)  # the first run and its resume: wandb writes one file each, under one id
    missing = {(k, s) for (k, s), v in want.items() if not logged(log, k, v)}
    assert not missing
    return want


def test_each_sink_holds_metrics_jsonl_across_a_resume_that_rewrites_steps(sink_env, monkeypatch):
    """A run logs steps 1-3 and is cut back to its step-2 checkpoint; the resumed run logs 3 and 4 again with other
    values. Each sink then holds exactly metrics.jsonl (TensorBoard purges the killed run's step 3 itself; trackio and
    MLflow would keep both, so the resume here only continues their runs: they hold steps 1-2 of the first run, the
    rest of the second) and one run."""
    out, project = sink_env / "run", f"kiln-{sink_env.name}"
    log = runlog.start(str(out), 0, {"lr": 1e-3}, project, resume_step=None, log_to=ALL)
    for step in (1, 2):
        log.metrics({"step": step, "critic/score/mean": step / 4, "val-core/all/pass@1": 0.5, "actor/grad_norm": 1.0})
    log.finish()
    log = runlog.start(str(out), 0, {"lr": 1e-3}, project, resume_step=2, log_to=ALL)
    for step in (3, 4):
        log.metrics({"step": step, "critic/score/mean": step / 8, "nonfinite": float("nan"), "kind": "text"})
    log.finish()
    want = assert_sinks_hold_metrics(out, project)
    assert want[("critic/score/mean", 4)] == 0.5 and ("val-core/all/pass@1", 1) in want
    assert runlog.mlflow_name("val-core/all/pass@1") == "val-core/all/pass_at_1"

    # TensorBoard: a killed run's steps past its checkpoint are dropped by the readers when the resume writes again.
    killed = sink_env / "killed"
    log = runlog.start(str(killed), 0, {}, None, resume_step=None, log_to="tensorboard")
    for step in (1, 2, 3):
        log.metrics({"step": step, "loss": float(step)})
    log.finish()
    log = runlog.start(str(killed), 0, {}, None, resume_step=2, log_to="tensorboard")
    log.metrics({"step": 3, "loss": 30.0})
    log.finish()
    assert tensorboard_values(killed) == expected(killed) == {("loss", 1): 1.0, ("loss", 2): 2.0, ("loss", 3): 30.0}


def test_unknown_or_missing_sink_is_refused_in_one_line_before_anything_loads(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"--log-to neptune: unknown log sink; use any of wandb, tensorboard"):
        runlog.sink_names("tensorboard,neptune")
    real = runlog.importlib.util.find_spec
    monkeypatch.setattr(runlog.importlib.util, "find_spec", lambda name: None if name == "mlflow" else real(name))
    with pytest.raises(ValueError, match=r"--log-to mlflow: the mlflow package is not installed \(pip install "
                                         r"mlflow-skinny\)"):
        runlog.sink_names("tensorboard, mlflow")
    monkeypatch.undo()
    assert runlog.sink_names("tensorboard,trackio", "proj") == ["tensorboard", "trackio", "wandb"]
    # From the command line: one error line, before the (missing) model or data is looked at.
    done = script_runner.run([sys.executable, str(ROOT / "train_grpo.py"), "--log-to", "tensorboard,neptune",
                           "--output-dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == ["error: --log-to neptune: unknown log sink; use any of wandb, "
                                                "tensorboard, trackio, mlflow (comma-separated)"]


@pytest.mark.slow
def test_grpo_run_and_its_resume_reach_every_sink(sink_env):
    """A real GRPO run (2 steps, then resumed to 3) with all four sinks: each holds metrics.jsonl, evaluations
    included, in one run."""
    root = sink_env
    train, test = data_prep.toy_rows(16, 2, seed=0, max_ops=2)
    task_rows.write_rows(train, root / "train.parquet")
    task_rows.write_rows(test, root / "test.parquet")
    model = tiny.make_tiny_model(root / "model", [r["prompt"][-1]["content"] for r in train], seed=0)
    out = root / "out"
    args = train_grpo.Args(model=str(model), data=str(root / "train.parquet"), eval_data=str(root / "test.parquet"),
                           output_dir=str(out), total_steps=2, save_every=2, sample_every=0, prompts_per_step=2,
                           group_size=2, max_new_tokens=8, lr=1e-3, log_to=ALL, wandb_project=f"kiln-{root.name}")
    train_grpo.main(args)
    train_grpo.main(args.__class__(**vars(args) | {"resume": True, "total_steps": 3}))
    want = assert_sinks_hold_metrics(out, f"kiln-{root.name}")
    assert {step for _, step in want} == {0, 1, 2, 3}
    assert ("val-core/all/pass@1", 3) in want and ("actor/grad_norm", 3) in want
