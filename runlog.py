"""What a training run leaves beside its checkpoints: metrics.jsonl (mirrored to wandb when asked), samples.jsonl, and
the wall time of each phase of a step. Rank 0 writes; every other rank's calls do nothing.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import wandb

import data_prep


@dataclass
class RunLog:
    output_dir: Path
    rank: int
    wandb: bool = False  # mirror every metrics line to the wandb run `start` opened

    def metrics(self, metrics: dict) -> None:
        """One line of metrics.jsonl (and a wandb log entry at metrics["step"])."""
        if self.rank != 0:
            return
        with open(self.output_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.wandb:
            wandb.log(metrics, step=metrics["step"])

    def samples(self, records: list[dict]) -> None:
        """Lines of samples.jsonl: every rank's `sample_record`s, gathered by the caller."""
        if self.rank == 0:
            with open(self.output_dir / "samples.jsonl", "a") as f:
                f.writelines(json.dumps(record) + "\n" for record in records)

    def finish(self) -> None:
        """Close the wandb run here, not at interpreter exit: the trainers leave through policy.exit_distributed."""
        if self.rank == 0 and self.wandb:
            wandb.finish()


def start(output_dir: str, rank: int, config: dict, wandb_project: str | None, resume: bool) -> RunLog:
    """The RunLog of a run: on rank 0 the output dir exists, a fresh run (not `resume`) starts metrics.jsonl and
    samples.jsonl anew, and with `wandb_project` a wandb run is opened (WANDB_MODE=offline works without network)."""
    log = RunLog(Path(output_dir), rank, wandb=wandb_project is not None)
    if rank != 0:
        return log
    log.output_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        for name in ("metrics.jsonl", "samples.jsonl"):
            (log.output_dir / name).unlink(missing_ok=True)
    if wandb_project:
        wandb.init(project=wandb_project, config=config, dir=output_dir, resume="allow" if resume else None)
    return log


def sample_record(step: int, sample) -> dict:
    """One line of samples.jsonl for a scored rollout.Sample."""
    return {"step": step, "task_id": data_prep.row_id(sample.row), "reward": sample.reward, "completion": sample.text,
            "error": sample.info.get("error")}


@contextmanager
def timed(seconds: dict, name: str):
    """`with timed(seconds, "phase"):` adds the block's wall time to seconds["phase"]."""
    start = time.perf_counter()
    yield
    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
