"""`make demo-distill`: on-policy distillation on a 2-core CPU, with no task reward at all.

1. `make demo`'s two policies (trained first with the demo's recipe, demo.py, when its folder lacks them): the SFT
   warm start, the student, and the GRPO policy kept in grpo/best/ (its best held-out evaluation), the teacher
2. train_grpo.py with --teacher and --no-distill-task-reward on 2 ranks: the student samples, the teacher scores the
   student's own tokens, and each token's advantage is log p_teacher - log p_student (the sampled reverse KL). The
   unit tests' rewards are still computed and logged, and move nothing
3. the student's held-out pass rate before and after, beside the teacher's: `RESULT {json}` holds student_before,
   student_after, teacher (pass@1 in %) and distill_s (the wall seconds of step 2, its two evaluations included)
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

import cli
import demo


@dataclass
class Args:
    demo_dir: str = "runs/demo"
    """make demo's folder: sft/hf is the student, grpo/best the teacher (both made with the demo's recipe if absent)"""
    output_dir: str | None = None
    """where the distillation run goes (default: <demo_dir>/distill)"""
    seed: int = 0
    """seed of the demo's recipe (if it runs) and of the distillation"""
    nproc: int = 2
    """torchrun ranks"""
    steps: int = 20
    """distillation steps"""
    lr: float = 3e-4
    """learning rate (the demo's GRPO one)"""
    prompts_per_step: int = 16
    """prompts per step over both ranks"""
    group_size: int = 4
    """samples per prompt"""
    distill_coef: float = 1.0
    """weight of the reverse-KL advantage"""


def main(args: Args) -> dict:
    root = Path(args.demo_dir)
    student, teacher = root / "sft" / "hf", root / "grpo" / "best"
    if not (student / "config.json").is_file() or not (teacher / "best.json").is_file():
        print(f"{root} lacks make demo's policies: training them first with the demo's recipe", flush=True)
        demo.main(demo.Args(output_dir=str(root), seed=args.seed))
    teacher_pass = json.loads((teacher / "best.json").read_text())["metrics"][demo.HELD_OUT]
    out = Path(args.output_dir or root / "distill")
    start = time.perf_counter()
    demo.run(demo.torchrun(args.nproc, "train_grpo.py", "--model", str(student), "--teacher", str(teacher),
                           "--no-distill-task-reward", "--distill-coef", str(args.distill_coef),
                           "--data", str(root / "train.parquet"), "--eval-data", str(root / "test.parquet"),
                           "--output-dir", str(out), "--total-steps", str(args.steps), "--lr", str(args.lr),
                           "--eval-every", str(args.steps), "--prompts-per-step", str(args.prompts_per_step),
                           "--group-size", str(args.group_size), "--max-new-tokens", "128", "--warmup-steps", "5",
                           "--save-every", str(args.steps), "--sample-every", "5", "--seed", str(args.seed),
                           "--overwrite"),
             "on-policy distillation (no task reward)")
    seconds = time.perf_counter() - start
    evals = [m for m in map(json.loads, open(out / "metrics.jsonl")) if demo.HELD_OUT in m]
    before, after = evals[0][demo.HELD_OUT], evals[-1][demo.HELD_OUT]
    print(f"\nheld-out pass rate: student {before:.1%} before distillation -> {after:.1%} after "
          f"({(after - before) * 100:+.1f} points); teacher {teacher_pass:.1%}; distillation {seconds / 60:.1f} min; "
          f"metrics {out / 'metrics.jsonl'} (distill/reverse_kl: the student's sampled reverse KL to the teacher)")
    return {"student_before": round(100 * before, 1), "student_after": round(100 * after, 1),
            "teacher": round(100 * teacher_pass, 1), "distill_s": round(seconds, 1)}


if __name__ == "__main__":
    with cli.one_line_errors():
        print("RESULT " + json.dumps(main(tyro.cli(Args))))
