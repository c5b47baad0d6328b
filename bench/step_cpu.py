"""Seconds per GRPO step on CPU: kiln's train_grpo versus TRL's GRPOTrainer on the same tiny workload.

Workload: the tiny Qwen2 (2 layers, hidden 64) from `tiny.make_tiny_model`, 8 toy prompts x 4 samples x exactly 32
new tokens (no stop token in kiln, `min_new_tokens=32` in TRL), beta 0, lr 1e-4, one optimizer step per GRPO step,
world size 1, HF generation. The reward is a cheap in-process function of the text (distinct characters / length),
the same in both, so time is spent on generation and the update, not on grading. Warm-up steps are excluded; the
median (and the fastest) of the measured steps is reported. Both trainers run in this one process, in alternating
rounds.

    .venv/bin/python bench/step_cpu.py [--rounds 3 --steps 6 --warmup 2 --trl-first]

Needs TRL (`requirements-bench.txt`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import tyro

import chat
import data_prep
import engines
import policy
import rewards
import task_rows
import tiny
import train_grpo

PROMPTS_PER_STEP, GROUP_SIZE, NEW_TOKENS, LR = 8, 4, 32, 1e-4


@dataclass
class BenchArgs:
    steps: int = 6
    """measured steps per trainer per round"""
    rounds: int = 3
    """kiln-then-TRL rounds (each trainer set up afresh, with its own warm-up)"""
    warmup: int = 2
    """steps run first and not measured"""
    micro_batch_tokens: int = 8192
    """kiln's packed micro-batch size (train_grpo's default: the whole step, ~2,200 tokens, in one)"""
    trl_first: bool = False
    """TRL goes first in the first round"""
    seed: int = 0


def distinct_char_fraction(text: str) -> float:
    return len(set(text)) / len(text) if text else 0.0


def kiln_score(rows: list[dict], completions: list[str],
               sample_infos: list[dict] | None = None) -> list[rewards.Reward]:
    return [rewards.Reward(distinct_char_fraction(c)) for c in completions]


def trl_reward(completions, **kwargs) -> list[float]:
    return [distinct_char_fraction(c[-1]["content"] if isinstance(c, list) else c) for c in completions]


def run_kiln(bench: BenchArgs, model_dir: Path, data: Path, out: Path) -> dict:
    args = train_grpo.Args(
        model=str(model_dir), data=str(data), output_dir=str(out), engine="hf", seed=bench.seed,
        prompts_per_step=PROMPTS_PER_STEP, group_size=GROUP_SIZE, max_new_tokens=NEW_TOKENS, lr=LR,
        micro_batch_tokens=bench.micro_batch_tokens, total_steps=bench.warmup + bench.steps, sample_every=0)
    # train_grpo's own pieces instead of main(): main() stops at EOS, and the workload needs exactly 32 new tokens.
    run = train_grpo.setup(args, kiln_score)
    run.sampling = dataclasses.replace(run.sampling, stop_token_ids=[])
    walls, metrics = [], []
    for _ in range(args.total_steps):
        start = time.perf_counter()
        m = train_grpo.train_step(run)
        walls.append(time.perf_counter() - start)
        run.step += 1
        run.log.metrics(m | {"step": run.step})
        metrics.append(m)
    generation = generation_engine_vs_generate(run, model_dir, bench.seed)
    measured = metrics[bench.warmup:]
    # No stop token: every completion ends by length, i.e. has exactly 32 new tokens, when this is 1.0.
    lengths = {m["rollout/truncated_frac"] for m in measured}
    parts = sorted({k for m in measured for k in m if k.startswith("timing_s/")})
    return {"wall": walls[bench.warmup:], "parts": {k: statistics.median(m[k] for m in measured) for k in parts},
            "lengths": lengths, "generation": generation}


def generation_engine_vs_generate(run, model_dir: Path, seed: int, repeats: int = 3) -> dict:
    """Median seconds of one step's generation (32 x 32 tokens): through kiln's HFEngine for the trainer's
    FSDP2-wrapped policy (decoded on the engine's unsharded replica), and through transformers' `generate()` on the
    same weights in a plain model (what TRL calls)."""
    prompts = [chat.encode_prompt(run.tokenizer, r["prompt"]) for r in run.rows[:PROMPTS_PER_STEP]]
    prompts = [p for p in prompts for _ in range(GROUP_SIZE)]
    width = max(len(p) for p in prompts)
    pad = run.tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    plain = policy.load_model(model_dir).eval()
    plain.load_state_dict(dict(policy.iter_full_weights(run.model)), strict=False)  # a tied lm_head is not yielded
    engine = engines.HFEngine(run.model, pad_token_id=pad)
    engine.load_weights(policy.iter_full_weights(run.model))
    generators = {"hf_engine": lambda: engine.generate(prompts, run.sampling),
            "generate": lambda: plain.generate(input_ids=input_ids, attention_mask=(input_ids != pad).long(),
                                               max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=True,
                                               pad_token_id=pad)}
    seconds = {}
    for name, generate in generators.items():
        times = []
        for _ in range(repeats):
            torch.manual_seed(seed)
            start = time.perf_counter()
            generate()
            times.append(time.perf_counter() - start)
        seconds[name] = statistics.median(times)
    return seconds


def run_trl(bench: BenchArgs, model_dir: Path, rows: list[dict], out: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.walls, self.start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.walls.append(time.perf_counter() - self.start)

    config = GRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, fp16=False, max_steps=bench.warmup + bench.steps,
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP_SIZE, gradient_accumulation_steps=1,
        num_generations=GROUP_SIZE, max_completion_length=NEW_TOKENS,
        generation_kwargs={"min_new_tokens": NEW_TOKENS},  # EOS is suppressed until 32 tokens: all are 32 long
        temperature=1.0, learning_rate=LR, beta=0.0, use_vllm=False, logging_steps=1, save_strategy="no",
        report_to="none", seed=bench.seed, dataloader_num_workers=0, disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=trl_reward, args=config,
                          train_dataset=Dataset.from_list([{"prompt": r["prompt"]} for r in rows]),
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[timer])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h][bench.warmup:]
    return {"wall": timer.walls[bench.warmup:], "lengths": {h["completions/mean_length"] for h in logs}}


def main(bench: BenchArgs) -> dict:
    import transformers
    import trl

    train, _ = data_prep.toy_rows(PROMPTS_PER_STEP, 0, seed=bench.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = [r["prompt"][-1]["content"] + "\n" + r["extra_info"]["solution"] for r in train]
        model_dir = tiny.make_tiny_model(tmp / "tiny", corpus, seed=bench.seed)
        task_rows.write_rows(train, tmp / "train.parquet")
        # Rounds alternate which trainer goes first, so a burst of load from other jobs hits both alike.
        results = {"kiln": [], "trl": []}
        for round_ in range(bench.rounds):
            order = ["kiln", "trl"] if (round_ % 2 == 0) != bench.trl_first else ["trl", "kiln"]
            for name in order:
                if name == "kiln":
                    results[name].append(run_kiln(bench, model_dir, tmp / "train.parquet", tmp / f"kiln{round_}"))
                else:
                    results[name].append(run_trl(bench, model_dir, train, tmp / f"trl{round_}"))
    kiln_walls = [w for r in results["kiln"] for w in r["wall"]]
    trl_walls = [w for r in results["trl"] for w in r["wall"]]
    kiln_median, trl_median = statistics.median(kiln_walls), statistics.median(trl_walls)
    parts = {k: statistics.median(r["parts"][k] for r in results["kiln"]) for k in results["kiln"][0]["parts"]}
    generation = {k: statistics.median(r["generation"][k] for r in results["kiln"]) for k in ("hf_engine", "generate")}
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"{torch.get_num_threads()} threads, {bench.rounds} rounds alternating which trainer goes first")
    print(f"workload: {PROMPTS_PER_STEP} prompts x {GROUP_SIZE} samples x {NEW_TOKENS} new tokens; "
          f"{bench.warmup} warm-up steps per round excluded, {bench.steps} measured per round")
    print(f"kiln fraction of completions ending at {NEW_TOKENS} tokens: "
          f"{sorted({x for r in results['kiln'] for x in r['lengths']})}; "
          f"trl mean completion lengths: {sorted({x for r in results['trl'] for x in r['lengths']})}")
    print(f"kiln s/step: median {kiln_median:.3f}, min {min(kiln_walls):.3f}  "
          f"(all: {', '.join(f'{w:.3f}' for w in kiln_walls)})")
    print("kiln parts (median of round medians, s): " + json.dumps({k: round(v, 4) for k, v in parts.items()}))
    print("kiln generation alone (median s): " + json.dumps({k: round(v, 3) for k, v in generation.items()}))
    print(f"trl  s/step: median {trl_median:.3f}, min {min(trl_walls):.3f}  "
          f"(all: {', '.join(f'{w:.3f}' for w in trl_walls)})")
    print(f"ratio kiln/trl: median {kiln_median / trl_median:.2f}x, min {min(kiln_walls) / min(trl_walls):.2f}x "
          f"(goal <= 0.5x)")
    return {"kiln_s_per_step": kiln_median, "trl_s_per_step": trl_median, "ratio": kiln_median / trl_median}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(tyro.cli(BenchArgs))))
