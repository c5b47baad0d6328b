"""What a training run leaves beside its checkpoints: run_config.json (its resolved Args, kiln commit and library
versions), metrics.jsonl (mirrored to the log sinks asked for: wandb, TensorBoard, trackio, MLflow), samples.jsonl, and
the wall time of each phase of a step; the output-dir policy the trainers share (a fresh run never mixes with an old
one, a resumed run continues its files and its sinks' runs). Rank 0 writes; every other rank's calls do nothing.
(Errors as one line: cli.py.)
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import platform
import re
import secrets
import shutil
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

import wandb
from tqdm import tqdm

import sample_files
import task_rows

# What a trainer writes into its output dir: --overwrite removes these (and nothing else) before a fresh run.
RUN_FILES = ("metrics.jsonl", *sample_files.SAMPLE_FILES, sample_files.IMAGES_DIR, "checkpoints", "critic", "best",
             ".best_tmp", "hf", "eval_report.json", "eval_report.md", "wandb", "wandb_id", "tensorboard", "mlruns",
             "sink_runs.json", "run_config.json")
# The Args fields a --resume may change: how long the run goes, what it writes on the way and where (a run folder may
# be moved). Any other difference from run_config.json (the lr, the group size, the data, ...) would make the resumed
# run another run.
MAY_CHANGE_ON_RESUME = ("total_steps", "steps", "resume", "overwrite", "output_dir", "save_every", "keep_checkpoints",
                        "sample_every", "rich_samples", "samples_max_mb", "eval_every", "wandb_project", "log_to")
# The libraries whose versions run_config.json records (those installed).
CHECKOUT = Path(__file__).resolve().parent  # the kiln checkout whose commit run_config.json records
LIBRARIES = ("torch", "transformers", "tokenizers", "vllm", "tyro", "numpy", "swebench", "wandb", "tensorboard",
             "trackio", "mlflow-skinny", "mlflow")
# The log sinks metrics.jsonl can be mirrored to: the module each needs, and what to install when it is missing.
SINKS = {"wandb": ("wandb", "wandb"), "tensorboard": ("tensorboard", "tensorboard"), "trackio": ("trackio", "trackio"),
         "mlflow": ("mlflow", "mlflow-skinny")}


@dataclass
class Sink:
    """One open log sink: `log(record, step)` mirrors a metrics line, `finish()` closes the sink's run."""

    name: str
    log: Callable[[dict, int], None]
    finish: Callable[[], None]


@dataclass
class RunLog:
    output_dir: Path
    rank: int
    sinks: list[Sink] = field(default_factory=list)  # mirror every metrics line to these (`start` opens them)
    samples_max_bytes: int = 0  # samples.jsonl rotates past half of this (sample_files.rotate); 0 = never

    def metrics(self, metrics: dict) -> None:
        """One line of metrics.jsonl, stamped with the wall-clock time, and the same record in every sink at
        metrics["step"]. A non-finite number is written as null, so every line stays valid JSON."""
        if self.rank != 0:
            return
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
        with open(self.output_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record | {"timestamp": time.time()}, allow_nan=False) + "\n")
        for sink in self.sinks:  # each stamps its own time
            sink.log(record, metrics["step"])

    def samples(self, records: list[dict]) -> None:
        """Lines of samples.jsonl: every rank's `sample_record`s, gathered by the caller. The images a rich record
        carries (its "_images") go to sample_images/ under their content hash, once. Past half of samples_max_bytes
        the file rotates."""
        if self.rank != 0:
            return
        for record in records:
            for name, data in record.pop("_images", {}).items():
                path = self.output_dir / sample_files.IMAGES_DIR / name
                if not path.exists():
                    path.parent.mkdir(exist_ok=True)
                    tmp = path.with_name(name + ".tmp")
                    tmp.write_bytes(data)
                    tmp.replace(path)
        path = self.output_dir / "samples.jsonl"
        with open(path, "a") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)
        if self.samples_max_bytes and path.stat().st_size > self.samples_max_bytes // 2:
            sample_files.rotate(self.output_dir)

    def finish(self) -> None:
        """Close the sinks' runs here, not at interpreter exit: the trainers leave through policy.exit_distributed."""
        for sink in self.sinks:
            sink.finish()
        self.sinks = []


def check_output_dir(output_dir: str, resume: bool, overwrite: bool, config: dict | None = None) -> None:
    """Refuse, before anything loads, an output dir that is a file, or that holds an earlier run's files when this run
    neither resumes it (--resume) nor replaces it (--overwrite); a --resume with nothing to resume (no checkpoint: a
    typo'd or empty dir); and a --resume whose `config` (the resolved Args) differs from the run's run_config.json in
    a field not in MAY_CHANGE_ON_RESUME. Every rank checks; none writes."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output-dir {output_dir} is a file")
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    # run_config.json alone is a run that stopped before its first record: nothing of it is lost by starting again
    earlier = [name for name in RUN_FILES if name != "run_config.json" and (out / name).exists()]
    if earlier and not resume and not overwrite:
        raise ValueError(f"--output-dir {output_dir} holds an earlier run ({', '.join(earlier)}): pass --resume to "
                         f"continue it, --overwrite to replace it, or another --output-dir")
    if resume and not any((out / "checkpoints").glob("step_*")):
        what = "does not exist" if not out.exists() else f"holds no checkpoint ({out / 'checkpoints'} is empty or missing)"
        raise ValueError(f"--resume: nothing to resume: --output-dir {output_dir} {what}; drop --resume to start a run "
                         f"there")
    if resume and config is not None and (out / "run_config.json").is_file():
        recorded = json.loads((out / "run_config.json").read_text())["args"]
        changed = {k: (recorded.get(k), v) for k, v in as_json(config).items()
                   if k not in MAY_CHANGE_ON_RESUME and recorded.get(k) != v}
        if changed:
            raise ValueError(f"--resume with other settings than the run in {output_dir} (run_config.json): "
                             + "; ".join(f"--{k.replace('_', '-')} {new!r} (the run's: {old!r})"
                                         for k, (old, new) in changed.items())
                             + f". Only {', '.join('--' + k.replace('_', '-') for k in MAY_CHANGE_ON_RESUME)} may "
                             f"change on a resume; pass the run's values, or start a new run elsewhere")


def as_json(value):
    """`value` as JSON reads it back (tuples as lists, paths and other objects as strings)."""
    return json.loads(json.dumps(value, default=str))


def run_config(config: dict) -> dict:
    """What run_config.json records: the resolved Args, the kiln commit (with "+dirty" when tracked files differ from
    it), the Python and library versions, the world size and when it started."""
    try:
        commit = subprocess.run(["git", "-C", str(CHECKOUT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "-C", str(CHECKOUT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):  # no git: the versions still say a lot
        commit, dirty = None, ""
    versions = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {"args": as_json(config), "kiln_commit": commit and commit + ("+dirty" if dirty else ""),
            "versions": versions, "world_size": int(os.environ.get("WORLD_SIZE", "1")), "started": time.time()}


def start(output_dir: str, rank: int, config: dict, wandb_project: str | None, resume_step: int | None,
          samples_max_mb: float = 0, log_to: str = "") -> RunLog:
    """The RunLog of a run, on rank 0 with the output dir made. A fresh run (`resume_step` None) removes an earlier
    run's files (check_output_dir let it only with --overwrite). A resumed run cuts metrics.jsonl and samples.jsonl
    back to its checkpoint's step, so the steps after it are not recorded twice, and reopens its sinks' runs
    (`open_sinks`: the ids are kept in the output dir)."""
    log = RunLog(Path(output_dir), rank, samples_max_bytes=int(samples_max_mb * 2**20))
    if rank != 0:
        return log
    log.output_dir.mkdir(parents=True, exist_ok=True)
    config_file = log.output_dir / "run_config.json"
    if resume_step is None:
        for name in RUN_FILES:
            path = log.output_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        config_file.write_text(json.dumps(run_config(config), indent=1) + "\n")
    else:
        for name in ("metrics.jsonl", *sample_files.SAMPLE_FILES):
            truncate_to_step(log.output_dir / name, resume_step)
        # each resume is recorded with what it may have changed (check_output_dir refused any other change)
        recorded = json.loads(config_file.read_text()) if config_file.is_file() else run_config(config)
        now = run_config(config)
        changed = {k: v for k, v in now["args"].items() if recorded["args"].get(k) != v}
        recorded.setdefault("resumes", []).append({"step": resume_step, "changed": changed} | {
            k: now[k] for k in ("kiln_commit", "versions", "world_size", "started")})
        config_file.write_text(json.dumps(recorded, indent=1) + "\n")
    log.sinks = open_sinks(sink_names(log_to, wandb_project), log.output_dir, wandb_project or "kiln", config,
                           resume_step)
    return log


def sink_names(log_to: str, wandb_project: str | None = None) -> list[str]:
    """The sinks of `--log-to wandb,tensorboard,...` (any subset, comma-separated), wandb also when --wandb-project is
    given; an unknown name or a sink whose package is missing raises ValueError naming it (checked before anything
    loads: rl_run.check_args)."""
    names = [name.strip() for name in log_to.split(",") if name.strip()] + (["wandb"] if wandb_project else [])
    for name in names:
        if name not in SINKS:
            raise ValueError(f"--log-to {name}: unknown log sink; use any of {', '.join(SINKS)} (comma-separated)")
        module, package = SINKS[name]
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"--log-to {name}: the {module} package is not installed (pip install {package})")
    return list(dict.fromkeys(names))


def open_sinks(names: list[str], out: Path, project: str, config: dict, resume_step: int | None) -> list[Sink]:
    """The sinks' runs, each named after the output dir: a fresh run starts new ones, a resumed run goes on in the same
    ones where the sink can (wandb by the id in <out>/wandb_id, trackio by its run name and MLflow by its run id, both
    in <out>/sink_runs.json; TensorBoard in <out>/tensorboard, whose readers drop the events a resumed run logs
    again). Their packages load here, not at import: each costs seconds that runs without it need not pay."""
    ids_file = out / "sink_runs.json"
    ids = json.loads(ids_file.read_text()) if ids_file.is_file() else {}
    sinks = []
    for name in names:
        if name == "wandb":
            id_file = out / "wandb_id"
            if not id_file.is_file():
                id_file.write_text(secrets.token_hex(4))  # wandb ids: lower-case letters and digits
            wandb.init(project=project, config=config, dir=str(out), id=id_file.read_text().strip(), resume="allow")
            sinks.append(Sink(name, lambda record, step: wandb.log(record, step=step), wandb.finish))
        elif name == "tensorboard":
            # purge_step: TensorBoard's readers drop the earlier events from this step on (a killed run's last steps)
            writer = importlib.import_module("torch.utils.tensorboard").SummaryWriter(
                str(out / "tensorboard"), purge_step=None if resume_step is None else resume_step + 1)

            def tensorboard_log(record: dict, step: int, writer=writer) -> None:
                for key, value in numbers(record):
                    writer.add_scalar(key, value, step)
                writer.flush()
            sinks.append(Sink(name, tensorboard_log, writer.close))
        elif name == "trackio":
            ids.setdefault("trackio", f"{out.name}-{secrets.token_hex(4)}")
            run = importlib.import_module("trackio").init(project=project, name=ids["trackio"], config=config,
                                                          resume="allow", embed=False, auto_log_cpu=False,
                                                          auto_log_gpu=False)
            sinks.append(Sink(name, lambda record, step, run=run: run.log(without_step(record), step=step), run.finish))
        elif name == "mlflow":
            sinks.append(open_mlflow(out, project, config, ids))
    if ids:  # a run with no such sink leaves no file: an output dir holding it is a run that logged
        ids_file.write_text(json.dumps(ids) + "\n")
    return sinks


def open_mlflow(out: Path, project: str, config: dict, ids: dict) -> Sink:
    """The run in MLflow's experiment `project`, at $MLFLOW_TRACKING_URI, else in a file store in <out>/mlruns. Metric
    names keep metrics.jsonl's but for the characters MLflow refuses: pass@k is written pass_at_k."""
    mlflow = importlib.import_module("mlflow")
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants a database; a folder needs none
        mlflow.set_tracking_uri((out / "mlruns").resolve().as_uri())
    mlflow.set_experiment(project)
    run = mlflow.start_run(run_id=ids.get("mlflow"), run_name=None if "mlflow" in ids else out.name)
    if "mlflow" not in ids:
        ids["mlflow"] = run.info.run_id
        mlflow.log_dict(as_json(config), "args.json")

    def mlflow_log(record: dict, step: int) -> None:
        mlflow.log_metrics({mlflow_name(key): value for key, value in numbers(record)}, step=step)
    return Sink("mlflow", mlflow_log, mlflow.end_run)


def mlflow_name(key: str) -> str:
    """A metrics.jsonl key as MLflow accepts it (letters, digits, _ - . / : and spaces)."""
    return re.sub(r"[^/\w.\- :]", "_", key.replace("@", "_at_"))


def without_step(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "step"}


def numbers(record: dict):
    """(key, value) of a metrics record's numbers, the step aside: what the scalar sinks hold (a null, a non-finite
    number in metrics.jsonl, is left out)."""
    return [(k, float(v)) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)]


def truncate_to_step(path: Path, step: int) -> None:
    """Keep the lines of a JSONL log whose "step" is at most `step` (the records of a checkpointed step); rewritten
    through a temp file and a rename, so a crash leaves the old file or the new one."""
    if not path.is_file():
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def writes_samples(step: int, sample_every: int, total_steps: int) -> bool:
    """Whether step `step` (1-based) goes to samples.jsonl: every `sample_every`-th, and the last one, so a run shorter
    than --sample-every still leaves samples to grade (0: never)."""
    return sample_every > 0 and (step % sample_every == 0 or step == total_steps)


def sample_record(step: int, sample) -> dict:
    """One line of samples.jsonl for a scored rollout.Sample (a multi-turn one keeps its messages, tool output
    included)."""
    record = {"step": step, "task_id": task_rows.row_id(sample.row), "reward": sample.reward,
              "completion": sample.text, "error": sample.reward_info.get("error")}
    if "sandbox_isolation" in sample.reward_info:  # the sandbox level that graded it (sandbox.py's levels)
        record["sandbox_isolation"] = sample.reward_info["sandbox_isolation"]
    if "messages" in sample.info:
        record["messages"] = sample.info["messages"]
    return record


# Rollout info a rich record keeps elsewhere (messages, tool calls, images) or not at all (tool signatures).
ROLLOUT_ONLY = ("messages", "images", "tools", "tool_log", "completion")
LOGPROB_DIGITS = 6  # logprobs and advantages are kept to 1e-6


def rich_sample_record(step: int, sample, tokenizer, trainer_logprobs: list[float] | None,
                       token_advantages: list[float] | None = None) -> dict:
    """sample_record plus what board.py shows of a sample: its data source, group, advantage (a scalar, or PPO's per
    token), shaped reward, finish reason and everything else the rollout and the reward put in its info (reward
    components, test counts, judge verdicts, turn and tool counts); its messages (a single-turn sample's: the prompt
    and the completion) with each image part naming its file; the completion's token ids, their text one by one, the
    loss mask, the engine's logprobs and the trainer's (`trainer_logprobs`: the policy before this step's update;
    None where it was not computed); the tool calls with their output, error and seconds. The images themselves ride
    in "_images" ({file name: bytes}), which RunLog.samples writes under sample_files.IMAGES_DIR and drops from the
    line."""
    n = len(sample.completion_ids)
    tool_log = sample.info.get("tool_log", [])
    images = {sample_files.image_name(data): data
              for data in [*sample.images, *(data for call in tool_log for data in call["images"])]}
    path = {data: f"{sample_files.IMAGES_DIR}/{name}" for name, data in images.items()}
    messages = sample.info.get("messages") or [*sample.row["prompt"], {"role": "assistant", "content": sample.text}]
    record = sample_record(step, sample) | {
        "data_source": sample.row.get("data_source"), "group": sample.group, "shaped_reward": sample.shaped_reward,
        "advantage": sample.advantage, "finish_reason": sample.finish_reason,
        "info": {k: v for k, v in sample.info.items() if k not in ROLLOUT_ONLY} | sample.reward_info | (
            {"session": sample.session, "segment": sample.segment, "segments": sample.segments} if sample.session
            else {}),
        "messages": with_image_paths(messages, [path[data] for data in sample.images]),
        "images": [path[data] for data in sample.images], "prompt_tokens": len(sample.prompt_ids),
        "prompt_images": len(sample.images) - len(sample.info.get("images", [])),
        "token_ids": list(sample.completion_ids),
        "token_text": tokenizer.batch_decode([[t] for t in sample.completion_ids]),
        "loss_mask": list(sample.loss_mask),
        "engine_logprobs": rounded(sample.engine_logprobs),
        "trainer_logprobs": None if trainer_logprobs is None else rounded(trainer_logprobs[:n]),
        "tool_calls": [call | {"images": [path[data] for data in call["images"]]} for call in tool_log],
        "_images": images}
    if token_advantages is not None:
        record["token_advantages"] = rounded(token_advantages[:n])
    return record


def sample_records(step: int, samples: list, tokenizer=None, trainer_logprobs=None, token_advantages=None) -> list:
    """This rank's lines of samples.jsonl for a step: rich ones (rich_sample_record) with a tokenizer, else
    sample_record's. trainer_logprobs, token_advantages: [B, T] tensors whose rows are the samples' (or None)."""
    if tokenizer is None:
        return [sample_record(step, s) for s in samples]
    logprobs = [None] * len(samples) if trainer_logprobs is None else trainer_logprobs.tolist()
    advantages = [None] * len(samples) if token_advantages is None else token_advantages.tolist()
    return [rich_sample_record(step, s, tokenizer, lp, adv) for s, lp, adv in zip(samples, logprobs, advantages)]


def rounded(values) -> list[float]:
    return [round(float(v), LOGPROB_DIGITS) for v in values]


def with_image_paths(messages: list[dict], paths: list[str]) -> list[dict]:
    """Copies of `messages` whose image parts, in order, name the files `paths` ({"type": "image", "image": path})."""
    remaining = iter(paths)
    named = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [part | {"image": next(remaining, None)} if part.get("type") == "image" else part
                       for part in content]
        named.append(message | {"content": content})
    return named


def announced_eval(evaluate: Callable, run) -> dict:
    """`evaluate(run)` of a trainer's Run with a line on rank 0 before it (the step and the task count) and after it
    (`eval_line`): an evaluation is never a silent wait."""
    if run.rank == 0:
        tqdm.write(f"eval step {run.step}: {len(run.eval_rows)} tasks ...")
    start = time.perf_counter()
    metrics = evaluate(run)
    if run.rank == 0:
        tqdm.write(eval_line(run.step, metrics) + f" ({time.perf_counter() - start:.1f}s)")
    return metrics


def eval_line(step: int, metrics: dict) -> str:
    """`eval step N: all pass@1 0.430 | toy pass@1 0.430 | reward 0.512` from eval_report.report_metrics' metrics: every
    data source's pass@1 (not its difficulties) and the mean reward."""
    groups = [k.split("/")[1] for k in metrics if k.startswith("val-core/") and k.endswith("/pass@1")
              and k.count("/") == 2]
    cells = [f"{g} pass@1 {metrics[f'val-core/{g}/pass@1']:.3f}" for g in sorted(groups, key=lambda g: (g != "all", g))]
    if "val-core/all/reward/mean" in metrics:  # absent when a judge graded none of the samples
        cells.append(f"reward {metrics['val-core/all/reward/mean']:.3f}")
    if "val-aux/judge_ungraded" in metrics:
        cells.append(f"ungraded by the judge {metrics['val-aux/judge_ungraded']}")
    return f"eval step {step}: " + " | ".join(cells)


@contextmanager
def timed(seconds: dict, name: str):
    """`with timed(seconds, "phase"):` adds the block's wall time to seconds["phase"]."""
    start = time.perf_counter()
    yield
    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
