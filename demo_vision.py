"""`make demo-vision`: watch kiln teach a tiny vision-language agent to run code on its image, CodeV's loop (image ->
code on the image -> printed output and images back -> answer), on a 2-core CPU in minutes.

1. vision_count tasks (data_prep.vision_count_rows): an image of small solid squares in six colours; the question
   names 1-3 colours and asks how many squares have one of them. A tiny model cannot count pixels by looking: one
   program on the image (exact colour tests, the mask's area over a square's) computes the answer. Held-out
   questions name 3-colour sequences never trained (each colour and each neighbouring pair was)
2. a tiny Qwen2.5-VL (vision tower, mrope, Qwen2.5-VL's template and image processor), created locally
3. an SFT warm start (train_sft.py, the images in the packed forward) on a careless teacher who writes its program in
   CodeV's <code> tags, gets the count and the mask it showed back in <sandbox_output>, and answers, but slips
   (data_prep.vision_count_teacher_conversations): a one-channel colour threshold that the white background passes
   more often than not, an answer at a glance without code, an output misread by one
4. GRPO with torchrun, 2 ranks, multi-turn rollouts with the sandboxed Python tool on the image (train_grpo.py --tools
   codev: printed output and the images the code shows come back, each within the image budget), rewarded on the
   answer alone (rewards.answer_reward); --check-tito compares every trajectory with the template
5. held-out pass rate, tool-call rate and the share of tool calls that compute the answer, before and after; every
   held-out trajectory is checked with chat.check_tito too; the trajectories with the images the tool returned stay
   for `python board.py runs/demo-vision/grpo`
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

import cli
import data_prep
import rollout
import task_rows
import tiny
from demo_agent import grpo, held_out, held_out_line, report, warm_start  # the agent demo's steps


@dataclass
class Args:
    output_dir: str = "runs/demo-vision"
    """everything the demo writes goes here"""
    seed: int = 0
    """seed for the tasks, the model and training"""
    nproc: int = 2
    """torchrun ranks for SFT and GRPO"""
    n_train: int = 2000
    """vision_count training tasks"""
    n_test: int = 100
    """held-out tasks (sequences of max_colours colours never seen in training)"""
    max_colours: int = 3
    """most colours a question names (the held-out questions' number)"""
    image_size: int = 112
    """side of the task images in pixels (16 image tokens each for the tiny model's image processor)"""
    hidden_size: int = 128
    """tiny model width"""
    num_layers: int = 2
    """tiny model depth"""
    skip_rate: float = 0.3
    """how often the SFT teacher answers at a glance, without code (a wrong count)"""
    slip_rate: float = 0.6
    """how often the SFT teacher tests a colour with one channel's threshold (vision_tasks.COUNT_SLIPS; above 0.5,
    greedy decoding of its warm start slips on every colour)"""
    misread_rate: float = 0.25
    """how often the SFT teacher misreads the tool's output (by one)"""
    sft_steps: int = 700
    """warm-start steps"""
    sft_batch_size: int = 32
    """conversations per SFT step"""
    sft_warmup_steps: int = 50
    """linear warm-up of the SFT learning rate"""
    grpo_steps: int = 40
    """GRPO steps"""
    grpo_lr: float = 3e-4
    """GRPO learning rate (tiny models want large ones)"""
    prompts_per_step: int = 8
    """GRPO prompts per step over all ranks"""
    group_size: int = 8
    """GRPO samples per prompt"""


# An agent's budget: a program, its output and mask image, and an answer fit with room to spare.
LIMITS = rollout.AgentLimits(max_turns=2, max_total_tokens=1024, max_tool_response_tokens=64)
MAX_NEW_TOKENS = 160  # per turn


def main(args: Args) -> dict:
    start = time.perf_counter()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, test = data_prep.vision_count_rows(args.n_train, args.n_test, seed=args.seed,
                                              max_colours=args.max_colours, size=args.image_size)
    task_rows.write_rows(train, out / "train.parquet")
    task_rows.write_rows(test, out / "test.parquet")
    conversations = data_prep.vision_count_teacher_conversations(train, args.slip_rate, args.skip_rate,
                                                                 args.misread_rate, seed=args.seed)
    write_conversations(conversations, out / "sft.jsonl")
    print(f"vision_count tasks: {len(train)} train, {len(test)} held-out (unseen colour sequences) in {out}; the "
          f"careless teacher's code-on-the-image conversations for SFT in {out / 'sft.jsonl'}")
    model_dir = tiny.make_tiny_vlm(out / "tiny-vlm", tiny.corpus_of(out / "sft.jsonl"), seed=args.seed,
                                   hidden_size=args.hidden_size, num_layers=args.num_layers)
    print(f"tiny vision-language model and tokenizer: {model_dir}")

    warm_start(args, model_dir, out)
    before = held_out(str(out / "sft" / "hf"), test, out / "held_out_before.jsonl", "codev", LIMITS, MAX_NEW_TOKENS)
    print(held_out_line("before GRPO", before))
    grpo(args, out, "codev", LIMITS, MAX_NEW_TOKENS)
    final = out / "grpo" / "checkpoints" / f"step_{args.grpo_steps:08d}"
    after = held_out(str(final), test, out / "held_out_after.jsonl", "codev", LIMITS, MAX_NEW_TOKENS)
    print(held_out_line("after GRPO", after))
    return report(out, test, before, after, args.grpo_steps, args.prompts_per_step * args.group_size, start,
                  f"kiln demo-vision: tiny Qwen2.5-VL, counting on images, code tool, 2 CPU ranks, seed {args.seed}")


def write_conversations(conversations: list[dict], path: Path) -> None:
    """SFT conversations as JSONL, their images as PNG files beside it (named in each line, relative to its folder)."""
    image_dir = path.parent / "sft-images"
    image_dir.mkdir(exist_ok=True)
    with open(path, "w") as f:
        for i, conversation in enumerate(conversations):
            names = []
            for k, image in enumerate(conversation["images"]):
                names.append(f"{image_dir.name}/{i}_{k}.png")
                (path.parent / names[-1]).write_bytes(image)
            f.write(json.dumps(conversation | {"images": names}) + "\n")


if __name__ == "__main__":
    with cli.one_line_errors():
        print("RESULT " + json.dumps(main(tyro.cli(Args))))
