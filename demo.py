"""`make demo`: watch kiln teach a tiny model to write code, on a 2-core CPU in a few minutes.

1. toy coding tasks (data_prep.py toy): held-out tasks compose seen operations in unseen combinations
2. a tiny Qwen2 model and byte-level BPE tokenizer, created locally (no downloads)
3. an SFT warm start (train_sft.py) on the solutions of a careless teacher, who slips on some operations more
   often than not (data_prep.TOY_SLIPS, e.g. `x / k` for "divides by k rounding down"): the model learns the task
   format and the teacher's habits, so it starts well short of what the tests ask
4. GRPO with torchrun, 2 ranks, the HF engine and sandboxed unit-test rewards (train_grpo.py): only the tests
   tell the model where the teacher was wrong
5. held-out pass rate before and after, metrics.jsonl, samples.jsonl and a PNG of the curves
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro
from matplotlib.figure import Figure

import cli
import data_prep
import task_rows
import tiny


@dataclass
class Args:
    output_dir: str = "runs/demo"
    """everything the demo writes goes here"""
    seed: int = 0
    """seed for the tasks, the model and training"""
    nproc: int = 2
    """torchrun ranks for SFT and GRPO"""
    n_train: int = 2000
    """toy training tasks"""
    n_test: int = 100
    """held-out toy tasks (unseen combinations of seen operations)"""
    max_ops: int = 3
    """longest chain of composed operations in a task"""
    hidden_size: int = 128
    """tiny model width"""
    num_layers: int = 4
    """tiny model depth"""
    slip_rate: float = 0.65
    """how often the SFT teacher writes its slip for an operation in data_prep.TOY_SLIPS"""
    sft_steps: int = 900
    """warm-start steps (copying the task's constants into the code takes the tiny model 400 to 900)"""
    sft_warmup_steps: int = 50
    """linear warm-up of the SFT learning rate"""
    grpo_steps: int = 60
    """GRPO steps"""
    grpo_lr: float = 3e-4
    """GRPO learning rate (tiny models want large ones; 5e-4 is already unstable)"""
    eval_every: int = 20
    """held-out evaluation every N GRPO steps (and before and after)"""
    lora_rank: int = 0
    """GRPO through LoRA adapters of this rank (alpha twice the rank; give it a larger --grpo-lr, e.g. 3e-3);
    0 = the full weights"""


HELD_OUT = "val-core/all/pass@1"  # the held-out pass rate in metrics.jsonl


def run(cmd: list[str], what: str) -> None:
    print(f"\n== {what}\n$ {' '.join(cmd)}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if subprocess.run(cmd, env=env).returncode != 0:
        raise RuntimeError(f"{what} failed (command above)")


def torchrun(nproc: int, script: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script, *args]


def sft_flags(args: Args, model_dir: Path, out: Path) -> list[str]:
    """train_sft.py's flags for the warm start (the README's command to redo it gives the same)."""
    return ["--model", str(model_dir), "--data", str(out / "sft.jsonl"), "--output-dir", str(out / "sft"),
            "--steps", str(args.sft_steps), "--lr", "3e-3", "--warmup-steps", str(args.sft_warmup_steps),
            "--batch-size", "32", "--seed", str(args.seed)]


def main(args: Args) -> dict:
    start = time.perf_counter()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, test = data_prep.toy_rows(args.n_train, args.n_test, seed=args.seed, max_ops=args.max_ops)
    task_rows.write_rows(train, out / "train.parquet")
    task_rows.write_rows(test, out / "test.parquet")
    with open(out / "sft.jsonl", "w") as f:
        for conversation in data_prep.toy_teacher_conversations(train, args.slip_rate, seed=args.seed):
            f.write(json.dumps(conversation) + "\n")
    print(f"toy tasks: {len(train)} train, {len(test)} held-out (unseen combinations) in {out}; the careless "
          f"teacher's solutions for SFT in {out / 'sft.jsonl'}")
    corpus = [r["prompt"][-1]["content"] + "\n" + r["extra_info"]["solution"] for r in train]
    model_dir = tiny.make_tiny_model(out / "tiny-model", corpus, seed=args.seed, hidden_size=args.hidden_size,
                                       num_layers=args.num_layers)
    print(f"tiny model and tokenizer: {model_dir}")

    run(torchrun(args.nproc, "train_sft.py", *sft_flags(args, model_dir, out), "--overwrite"), "SFT warm start")
    run(torchrun(args.nproc, "train_grpo.py", "--model", str(out / "sft" / "hf"), "--data", str(out / "train.parquet"),
                 "--eval-data", str(out / "test.parquet"), "--output-dir", str(out / "grpo"),
                 "--total-steps", str(args.grpo_steps), "--lr", str(args.grpo_lr), "--eval-every", str(args.eval_every),
                 "--prompts-per-step", "16", "--group-size", "8", "--max-new-tokens", "128",
                 "--warmup-steps", "5",  # Adam's first, sign-like steps knock a tiny model off its warm start
                 "--save-every", str(args.grpo_steps), "--sample-every", "5", "--rich-samples",  # for board.py
                 "--seed", str(args.seed), "--overwrite",
                 *(["--lora-rank", str(args.lora_rank), "--lora-alpha", str(2 * args.lora_rank)] if args.lora_rank
                   else [])),
        "GRPO")

    evals = [m for m in map(json.loads, open(out / "grpo" / "metrics.jsonl")) if HELD_OUT in m]
    before, after = evals[0][HELD_OUT], evals[-1][HELD_OUT]
    png = plot(out / "grpo" / "metrics.jsonl", out / "curves.png", args.seed)
    minutes = (time.perf_counter() - start) / 60
    print(f"\nheld-out pass rate: {before:.1%} before GRPO -> {after:.1%} after ({(after - before) * 100:+.1f} points)")
    print(f"seed {args.seed}, wall time {minutes:.1f} min; metrics {out / 'grpo' / 'metrics.jsonl'}, samples "
          f"{out / 'grpo' / 'samples.jsonl'}, curves {png}, the last evaluation's test pass rates by band "
          f"{out / 'grpo' / 'eval_report.png'} (table: eval_report.md)")
    return {"before": before, "after": after, "minutes": minutes}


def smoothed(values: list[float], window: int = 5) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start): train curves are noisy step to step."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def plot(metrics_path: Path, png: Path, seed: int) -> Path:
    records = [json.loads(line) for line in open(metrics_path)]
    train = [m for m in records if "critic/score/mean" in m]
    evals = [m for m in records if HELD_OUT in m]
    fig = Figure(figsize=(7, 4))  # no pyplot: nothing to display, no backend to pick
    ax = fig.subplots()
    steps = [m["step"] for m in train]
    for key, label, color in (("critic/score/mean", "train reward, sampled at T=1", "C0"),
                              ("critic/score/pass_rate", "train pass rate, sampled at T=1", "C1")):
        values = [m[key] for m in train]
        ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, smoothed(values), color=color, label=f"{label} (mean of 5 steps)")
    tasks = evals[0].get("val-aux/all/tasks", 0) if evals else 0
    ax.plot([m["step"] for m in evals], [m[HELD_OUT] for m in evals], "o--", color="C2",
            label=f"held-out pass@1, greedy ({tasks} tasks; measured at the dots only)")
    ax.set_xlabel("GRPO step (step 0: the SFT warm start)")
    ax.set_ylabel("reward / pass rate")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right", fontsize="small")
    ax.set_title(f"kiln demo: tiny model, toy code tasks, 2 CPU ranks, seed {seed}")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    return png


if __name__ == "__main__":
    with cli.one_line_errors():
        print("RESULT " + json.dumps(main(tyro.cli(Args))))
