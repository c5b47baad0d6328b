"""`make demo-agent`: watch kiln teach a tiny agent to use its Python tool, on a 2-core CPU in minutes.

1. calc tasks (data_prep.calc_rows): x starts at a 2-digit number and goes through a chain of arithmetic with
   single-digit constants; the exact answer (up to 7 digits) cannot be guessed, one python call computes it.
   Held-out tasks are 3-operation chains never seen in training (each step and neighbouring pair of steps was)
2. a tiny Qwen2 model and byte-level BPE tokenizer, created locally (no downloads)
3. an SFT warm start (train_sft.py) on a careless teacher who calls the python tool through the real template and
   protocol (<tool_call>, the output as a tool turn, then <answer>) but slips (data_prep.calc_teacher_conversations):
   it answers without calling, writes its wrong line for an operation more often than not (`x + k` left
   unassigned for "adds k", `x / k` for "divides by k rounding down", `x * 2` for "squares it"), or misreads the
   output
4. GRPO with torchrun, 2 ranks, multi-turn rollouts with the sandboxed python tool (train_grpo.py --tools python),
   rewarded on the answer alone (rewards.answer_reward); --check-tito compares every trajectory with the template
5. held-out pass rate, tool-call rate and the share of tool calls that compute the answer, before and after; every
   held-out trajectory is checked with chat.check_tito too. metrics.jsonl, samples.jsonl, held-out samples, the eval
   report and a PNG of the curves
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from matplotlib.figure import Figure

import chat
import cli
import data_prep
import engines
import eval_report
import generate
import policy
import rewards
import rollout
import runlog
import task_rows
import tiny
import tools
import vision
from demo import run, smoothed, torchrun  # the text demo's steps


@dataclass
class Args:
    output_dir: str = "runs/demo-agent"
    """everything the demo writes goes here"""
    seed: int = 0
    """seed for the tasks, the model and training"""
    nproc: int = 2
    """torchrun ranks for SFT and GRPO"""
    n_train: int = 2000
    """calc training tasks"""
    n_test: int = 100
    """held-out calc tasks (chains of max_ops operations never seen in training)"""
    max_ops: int = 3
    """longest chain of operations in a task (the held-out chains' length)"""
    hidden_size: int = 128
    """tiny model width"""
    num_layers: int = 2
    """tiny model depth (2 layers learn the copying as well as 4 at half the cost, which pays for more GRPO steps)"""
    skip_rate: float = 0.3
    """how often the SFT teacher answers without calling the tool (it gives the start number)"""
    slip_rate: float = 0.6
    """how often the SFT teacher writes an operation's slip (data_prep.CALC_SLIPS; above 0.5, greedy decoding of its
    warm start slips on every operation)"""
    misread_rate: float = 0.25
    """how often the SFT teacher misreads the tool's output (drops its last digit)"""
    sft_steps: int = 900
    """warm-start steps"""
    sft_batch_size: int = 32
    """conversations per SFT step (the tool signatures make each prompt about 200 tokens)"""
    sft_warmup_steps: int = 50
    """linear warm-up of the SFT learning rate"""
    grpo_steps: int = 80
    """GRPO steps"""
    grpo_lr: float = 3e-4
    """GRPO learning rate (tiny models want large ones)"""
    prompts_per_step: int = 8
    """GRPO prompts per step over all ranks"""
    group_size: int = 8
    """GRPO samples per prompt"""


# An agent's budget: a call, its output and an answer fit with room to spare.
LIMITS = rollout.AgentLimits(max_turns=3, max_total_tokens=768, max_tool_response_tokens=64)
MAX_NEW_TOKENS = 128  # per turn


def main(args: Args) -> dict:
    start = time.perf_counter()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, test = data_prep.calc_rows(args.n_train, args.n_test, seed=args.seed, max_ops=args.max_ops)
    task_rows.write_rows(train, out / "train.parquet")
    task_rows.write_rows(test, out / "test.parquet")
    schemas = tools.TOOL_SCHEMAS["python"]  # what the rollout shows the agent, so SFT trains on the same prompt
    conversations = data_prep.calc_teacher_conversations(train, schemas, args.slip_rate, args.skip_rate,
                                                         args.misread_rate, seed=args.seed)
    with open(out / "sft.jsonl", "w") as f:
        f.writelines(json.dumps(c) + "\n" for c in conversations)
    print(f"calc tasks: {len(train)} train, {len(test)} held-out (unseen chains) in {out}; the careless teacher's "
          f"tool-using conversations for SFT in {out / 'sft.jsonl'}")
    model_dir = tiny.make_tiny_model(out / "tiny-model", tokenizer_corpus(conversations), seed=args.seed,
                                     hidden_size=args.hidden_size, num_layers=args.num_layers)
    print(f"tiny model and tokenizer: {model_dir}")

    warm_start(args, model_dir, out)
    before = held_out(str(out / "sft" / "hf"), test, out / "held_out_before.jsonl")
    print(held_out_line("before GRPO", before))
    grpo(args, out, "python", LIMITS, MAX_NEW_TOKENS)
    final = out / "grpo" / "checkpoints" / f"step_{args.grpo_steps:08d}"
    after = held_out(str(final), test, out / "held_out_after.jsonl")
    print(held_out_line("after GRPO", after))
    return report(out, test, before, after, args.grpo_steps, args.prompts_per_step * args.group_size, start,
                  f"kiln demo-agent: tiny model, calc tasks, python tool, 2 CPU ranks, seed {args.seed}")


def warm_start(args, model_dir: Path, out: Path) -> None:
    """train_sft.py on the teacher's conversations (out/sft.jsonl) into out/sft, on args.nproc ranks."""
    run(torchrun(args.nproc, "train_sft.py", "--model", str(model_dir), "--data", str(out / "sft.jsonl"),
                 "--output-dir", str(out / "sft"), "--steps", str(args.sft_steps), "--lr", "3e-3",
                 "--warmup-steps", str(args.sft_warmup_steps), "--batch-size", str(args.sft_batch_size),
                 "--seed", str(args.seed), "--overwrite"),
        "SFT warm start")


def grpo(args, out: Path, tools: str, limits: rollout.AgentLimits, max_new_tokens: int) -> None:
    """train_grpo.py from the warm start on out/train.parquet with the toolbox `tools`, every trajectory checked by
    check_tito, rich samples every 5 steps for board.py; the last step's checkpoint kept."""
    run(torchrun(args.nproc, "train_grpo.py", "--model", str(out / "sft" / "hf"), "--data", str(out / "train.parquet"),
                 "--output-dir", str(out / "grpo"), "--tools", tools, "--check-tito",
                 "--max-turns", str(limits.max_turns), "--max-total-tokens", str(limits.max_total_tokens),
                 "--max-tool-response-tokens", str(limits.max_tool_response_tokens),
                 "--max-new-tokens", str(max_new_tokens), "--total-steps", str(args.grpo_steps),
                 "--lr", str(args.grpo_lr), "--prompts-per-step", str(args.prompts_per_step),
                 "--group-size", str(args.group_size),
                 "--warmup-steps", "5",  # Adam's first, sign-like steps knock a tiny model off its warm start
                 "--save-every", str(args.grpo_steps), "--sample-every", "5", "--rich-samples",  # for board.py
                 "--seed", str(args.seed), "--overwrite"),
        "GRPO")


def report(out: Path, test: list[dict], before: dict, after: dict, grpo_steps: int, trajectories: int,
           start: float, title: str) -> dict:
    """The held-out evaluations into the run's files (for board.py and the eval report), the lift, its sign test,
    tool use, check_tito's counts and the curves, printed; returns the demo's headline numbers."""
    evals = [{"step": 0} | before["summary"], {"step": grpo_steps} | after["summary"]]
    eval_report.write_eval_report(out / "grpo", evals, {}, str(out / "test.parquet"))
    log = runlog.RunLog(out / "grpo", rank=0)  # where board.py and train_grpo's own evaluations put them
    for e in evals:
        log.metrics({"step": e["step"]} | eval_report.report_metrics(e))

    records = [json.loads(line) for line in open(out / "grpo" / "metrics.jsonl")]
    train_steps = [m for m in records if "critic/score/mean" in m]
    train_split = round(sum(m["tools/tito_split_frac"] for m in train_steps) * trajectories)
    train_mask_drifted = round(sum(m["tools/tito_mask_drift_frac"] for m in train_steps) * trajectories)
    checked = len(train_steps) * trajectories + 2 * len(test)
    mask_drifted = train_mask_drifted + before["mask_drifted"] + after["mask_drifted"]
    calls_first, calls_last = (sum(m["tools/calls_mean"] for m in part) / len(part)
                               for part in (train_steps[:5], train_steps[-5:]))
    png = plot(train_steps, before, after, out / "curves.png", title)
    wall_s = time.perf_counter() - start
    minutes = wall_s / 60
    print(f"\nheld-out pass rate: {before['pass_rate']:.1%} before GRPO -> {after['pass_rate']:.1%} after "
          f"({(after['pass_rate'] - before['pass_rate']) * 100:+.1f} points)")
    wins = sum(a and not b for a, b in zip(after["passed"], before["passed"]))
    losses = sum(b and not a for a, b in zip(after["passed"], before["passed"]))
    print(f"held-out tasks GRPO taught: {wins}, unlearnt: {losses}; the chance of a lift this size or more if GRPO "
          f"changed nothing (one-sided sign test): {sign_test_p(wins, losses):.1e}")
    print(f"held-out tool-call rate (greedy): {before['tool_call_rate']:.1%} -> {after['tool_call_rate']:.1%}; tool "
          f"calls that compute the answer: {before['calls_right']:.1%} -> {after['calls_right']:.1%}; calls that run "
          f"without error: {before['calls_ran']:.1%} -> {after['calls_ran']:.1%}")
    print(f"tool calls per training trajectory (sampled at T=1): {calls_first:.2f} in the first 5 GRPO steps -> "
          f"{calls_last:.2f} in the last 5")
    print(f"check_tito: {checked} trajectories compared with the chat template's rendering: {mask_drifted} with a "
          f"loss mask on anything but the policy's own tokens (tool calls' outputs, the template's turns) or other "
          f"text; {train_split} of {len(train_steps) * trajectories} in training and "
          f"{before['split'] + after['split']} of {2 * len(test)} held-out sampled a split of the text other than the "
          f"tokenizer's (ids drift: trained as sampled, never re-tokenized)")
    print(f"wall time {minutes:.1f} min, load average {os.getloadavg()[0]:.1f}; metrics "
          f"{out / 'grpo' / 'metrics.jsonl'}, samples {out / 'grpo' / 'samples.jsonl'}, held-out trajectories "
          f"{out / 'held_out_before.jsonl'} and {out / 'held_out_after.jsonl'}, curves {png}, eval report "
          f"{out / 'grpo' / 'eval_report.md'}; to browse the run, its trajectories token by token and the held-out "
          f"pass rates: python board.py {out / 'grpo'}")
    return {"before": before["pass_rate"], "after": after["pass_rate"], "wins": wins, "losses": losses,
            "tool_call_rate": (before["tool_call_rate"], after["tool_call_rate"]),
            "calls_right": (before["calls_right"], after["calls_right"]), "train_calls": (calls_first, calls_last),
            "checked": checked, "mask_drifted": mask_drifted, "train_split": train_split, "minutes": minutes,
            "wall_s": round(wall_s, 1)}


def tokenizer_corpus(conversations: list[dict]) -> list[str]:
    """What the tiny tokenizer's merges are learnt from: the teacher's messages as text and the tool signatures."""
    corpus = [json.dumps(schema) for schema in conversations[0]["tools"]] * 20
    for conversation in conversations:
        for message in conversation["messages"]:
            calls = [json.dumps(call["function"]) for call in message.get("tool_calls", [])]
            corpus.append("\n".join([message["content"], *calls]))
    return corpus


def held_out(model: str, rows: list[dict], samples_path: Path, tools: str = "python",
             limits: rollout.AgentLimits = LIMITS, max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    """Greedy agent rollouts of `model` (a Hugging Face folder or a kiln checkpoint) on `rows` with the toolbox
    `tools`, in this process, as the trainer runs them; each checked with chat.check_tito and graded. Returns the pass
    rate, the share of tasks where the agent called its tool, the shares of calls that ran without error and that
    printed the right answer, the trajectories that split the text otherwise than the tokenizer (ids drift) and with
    a mask or text drift, and the eval_report.report summary. The trajectories go to `samples_path`."""
    hf_dir = Path(generate.hf_folder(model))
    tokenizer = policy.load_tokenizer(str(hf_dir))
    engine = generate.load_generator(generate.GenerateArgs(model=model, data=""), tokenizer, torch.device("cpu"))
    eot = chat.end_of_turn(tokenizer)
    greedy = engines.Sampling(max_new_tokens=max_new_tokens, temperature=0.0,
                              stop_token_ids=policy.stop_token_ids(tokenizer, str(hf_dir), eot))
    samples, _ = rollout.collect(engine, tokenizer, rows, 1, greedy, tools, limits, eot=eot,
                                 count_image=vision.image_counter(str(hf_dir)) or rollout.placeholder_only)
    drifts = [chat.check_tito(tokenizer, s, s.info["messages"], s.info["tools"], eot) for s in samples]
    results = rewards.score_batch([s.row for s in samples], [s.text for s in samples])
    outputs = [[tool_output(m) for m in s.info["messages"][len(s.row["prompt"]):] if chat.is_tool_output(m)]
               for s in samples]
    calls = sum(s.info["tool_calls"] for s in samples)
    with open(samples_path, "w") as f:
        for s, r, d in zip(samples, results, drifts):
            f.write(json.dumps(runlog.sample_record(0, s) | {"reward": r.score, "answer": r.info["answer"],
                                                            "truth": s.row["reward_model"]["ground_truth"],
                                                            "error": r.info["error"], "tito": d}) + "\n")
    return {"pass_rate": sum(r.score for r in results) / len(results),
            "passed": [r.score >= 1.0 for r in results],  # in row order
            "tool_call_rate": sum(s.info["tool_calls"] > 0 for s in samples) / len(samples),
            "calls_ran": 1 - sum(s.info["tool_errors"] for s in samples) / max(calls, 1),
            "calls_right": sum(o == s.row["reward_model"]["ground_truth"] for s, out in zip(samples, outputs)
                               for o in out) / max(calls, 1),
            "split": sum("ids" in d for d in drifts), "mask_drifted": sum(chat.mask_drifted(d) for d in drifts),
            "summary": eval_report.report({task_rows.row_id(r): r for r in rows},
                                      [task_rows.row_id(s.row) for s in samples],
                                      [rewards.for_report(r) for r in results])}


def tool_output(message: dict) -> str:
    """What a tool call printed, from its reply: a `tool` message's text, or an observation's (tags taken off)."""
    content = message["content"]
    text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
    return text.removeprefix(chat.OBSERVATION_OPEN).removesuffix(chat.OBSERVATION_CLOSE).strip()


def sign_test_p(wins: int, losses: int) -> float:
    """P(at least `wins` of the wins + losses tasks that changed outcome turned to a pass) if each change were a fair
    coin flip: how likely a held-out lift this size is by chance (the exact one-sided sign test, McNemar's)."""
    n = wins + losses
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2 ** n


def held_out_line(when: str, result: dict) -> str:
    return (f"held-out {when}: pass rate {result['pass_rate']:.1%}, tool-call rate {result['tool_call_rate']:.1%}, "
            f"tool calls that compute the answer {result['calls_right']:.1%}, check_tito mask drifts "
            f"{result['mask_drifted']}")


def plot(train: list[dict], before: dict, after: dict, png: Path, title: str) -> Path:
    fig = Figure(figsize=(7, 5))  # no pyplot: nothing to display, no backend to pick
    ax = fig.subplots()
    steps = [m["step"] for m in train]
    for key, label, color in (("critic/score/mean", "train reward (pass rate), sampled at T=1", "C0"),
                              ("tools/calls_mean", "train tool calls per trajectory", "C1")):
        values = [m[key] for m in train]
        ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, smoothed(values), color=color, label=f"{label} (mean of 5 steps)")
    last = steps[-1] if steps else 0
    ax.plot([0, last], [before["pass_rate"], after["pass_rate"]], "o--", color="C2",
            label=f"held-out pass rate, greedy ({before['summary']['pass']['all']['tasks']} tasks)")
    ax.plot([0, last], [before["tool_call_rate"], after["tool_call_rate"]], "s:", color="C3",
            label="held-out tool-call rate, greedy")
    ax.set_xlabel("GRPO step (step 0: the SFT warm start)")
    ax.set_ylabel("rate")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, fontsize="small")  # below: no curve hidden
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    return png


if __name__ == "__main__":
    with cli.one_line_errors():
        print("RESULT " + json.dumps(main(tyro.cli(Args))))
