"""Supervised fine-tuning on conversations: the cold start before RL.

`torchrun --nproc-per-node 8 train_sft.py --model ... --data conversations.jsonl`. The same masks (assistant
tokens only), packing, FSDP2 and checkpoints as the RL scripts. A data row is either `{"messages": [...]}`
(tool turns included; with `"tools": [...]`, the signatures the template renders in the prompt, as OpenAI's
fine-tuning format has them) or a kiln row whose `extra_info["solution"]` becomes the assistant's answer. A row's
`images` (bytes, paths, data URLs; one per {"type": "image"} part of its messages, in order, tool and observation
turns included) go with it into a vision-language model's packed forward (CodeV's cold start), never into the loss
mask.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

import chat
import cli
import collectives
import losses
import hub
import policy
import runlog
import sequence_parallel
import task_rows
import vision
from checkpoint import load_checkpoint, load_newest_checkpoint, save_checkpoint, save_hf


@dataclass
class Args:
    model: str = "runs/demo/tiny-model"
    """model to fine-tune: a Hugging Face folder or hub name (default: the tiny model `make demo` builds)"""
    data: str = "runs/demo/sft.jsonl"
    """conversations (.jsonl/.parquet with `messages`) or kiln rows with extra_info.solution"""
    output_dir: str = "runs/sft"
    """where metrics.jsonl, checkpoints/ and the final Hugging Face folder hf/ go"""
    seed: int = 0
    """seed for data order and initialisation"""
    steps: int = 100
    """optimizer steps"""
    batch_size: int = 32
    """conversations per optimizer step across all ranks (must divide by the world size)"""
    micro_batch_tokens: int = 8192
    """tokens packed into one forward/backward"""
    lr: float = 1e-5
    """peak learning rate (AdamW), cosine decay to 10% after warm-up"""
    warmup_steps: int = 0
    """linear warm-up steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    mixed_precision: bool = False
    """bf16 parameters with fp32 reductions (use on GPUs; with --lora-rank the frozen base is stored in bf16 too)"""
    lora_rank: int = 0
    """train LoRA adapters of this rank (PEFT) instead of the full weights, the base frozen (hf/ gets them merged);
    0 = full fine-tuning"""
    lora_alpha: float = 16.0
    """LoRA scale alpha: an adapted layer adds (alpha / rank) B A x"""
    lora_targets: str = "all-linear"
    """the linear layers that get adapters: all-linear (all but the output layer) or module names, comma-separated"""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """recompute in backward to save memory: full (decoder layers from their inputs) or selective (keeps matmul and
    attention outputs, recomputes only elementwise work)"""
    attn_implementation: str = "packed_sdpa"
    """attention of the trained models: packed_sdpa (policy.py: sdpa per packed sequence), flex_attention (faster on
    GPUs), flash_attention_2 when installed; plain sdpa masks the whole micro-batch, quadratic in its tokens"""
    compile_layers: bool = False
    """torch.compile each decoder layer (GPUs: fuses norms, rotary and activations)"""
    sequence_parallel: int = 1
    """spread each packed row over N consecutive ranks, which train on their conversations together (Ulysses;
    docs/long_horizon.md)"""
    save_every: int = 0
    """checkpoint every N steps (0 = only at the end)"""
    keep_checkpoints: int = 2
    """how many recent checkpoints to keep"""
    resume: bool = False
    """continue from the newest checkpoint in output_dir"""
    end_of_turn: str | None = None
    """token that closes an assistant turn (default: found in the chat template, e.g. <|im_end|>, <|eot_id|>)"""
    overwrite: bool = False
    """replace an earlier run in output_dir (without it or --resume, a non-empty output_dir is refused)"""


SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool"}


def conversation(row: dict, where: str) -> list[dict]:
    if "messages" in row:
        return checked_messages(row["messages"], where)
    if "conversations" in row:
        raise ValueError(f"{where}: `conversations` looks like ShareGPT; write it as `messages` with "
                         f"{{'role', 'content'}} ({', '.join(f'{a} -> {b}' for a, b in SHAREGPT_ROLES.items())})")
    solution = row.get("extra_info", {}).get("solution")
    if solution is None:
        raise ValueError(f"{where}: neither `messages` nor `extra_info.solution` to train on")
    return list(row["prompt"]) + [{"role": "assistant", "content": f"```python\n{solution}\n```"}]


def checked_messages(messages, where: str) -> list[dict]:
    """The messages of a conversation, refused with the row and message named unless every role is one of
    task_rows.ROLES and an assistant message is there to train on."""
    if not isinstance(messages, list):
        raise ValueError(f"{where}: messages: expected a list, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in task_rows.ROLES:
            hint = f" (ShareGPT's {role!r} is {SHAREGPT_ROLES[role]!r})" if role in SHAREGPT_ROLES else ""
            raise ValueError(f"{where}: messages[{i}].role: expected one of {task_rows.ROLES}, got {role!r}{hint}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message to train on")
    return list(messages)


def load_conversations(path: str) -> list[tuple[list[dict], list[bytes], list[dict] | None]]:
    """Each row's messages, images (encoded bytes; a relative path is read from the data file's folder) and tool
    signatures (None without)."""
    if path.endswith(".jsonl"):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        rows = task_rows.load_rows(path)
    out = []
    for i, row in enumerate(rows):
        where, messages = f"{path} row {i}", conversation(row, f"{path} row {i}")
        images = [task_rows.image_bytes(image, Path(path).parent) for image in row.get("images") or []]
        if len(images) != task_rows.count_image_parts(messages):
            raise ValueError(f"{where}: images: {len(images)} images but the messages have "
                             f"{task_rows.count_image_parts(messages)} image parts")
        out.append((messages, images, row.get("tools") or None))
    return out


def encode(tokenizer, conversations: list[tuple[list[dict], list[bytes], list[dict] | None]],
           eot: str) -> list[tuple[list[int], list[int], list[bytes]]]:
    """(ids, loss mask, images) of each conversation: chat.encode_conversation's ids and mask (1 on assistant tokens
    only: image placeholders and tool/observation turns are 0; the prompt with its tool signatures), its images one
    per placeholder."""
    pad = chat.image_pad_id(tokenizer)
    encoded = [(*chat.encode_conversation(tokenizer, messages, eot, tools), images)
               for messages, images, tools in conversations]
    for i, (ids, _, images) in enumerate(encoded):
        if images and ids.count(pad) != len(images):
            raise ValueError(f"conversation {i}: {len(images)} images but the chat template renders "
                             f"{ids.count(pad)} image placeholders")
    return encoded


def main(args: Args) -> dict:
    rank, world, device = policy.init_distributed()
    if args.batch_size < 1 or args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} must be > 0 and divide by the world size {world}")
    if args.steps < 0:
        raise ValueError(f"--steps must be >= 0, got {args.steps}")
    sequence_parallel.check_world(args.sequence_parallel, world)
    runlog.check_output_dir(args.output_dir, args.resume, args.overwrite, dataclasses.asdict(args))
    policy.check_model_path(args.model)
    named, args.model = args.model, hub.fetch(args.model, "--model")  # a hub name: downloaded once per node
    sequence_parallel.check_model(args.model, args.sequence_parallel, args.attn_implementation)
    torch.manual_seed(args.seed)
    tokenizer = policy.load_tokenizer(args.model)
    eot = chat.end_of_turn(tokenizer, args.end_of_turn)
    encoded = encode(tokenizer, load_conversations(args.data), eot)
    untrained = [i for i, (_, mask, _) in enumerate(encoded) if not any(mask)]
    if untrained:  # a loss over zero tokens is NaN and trains nothing
        raise ValueError(f"{args.data}: {len(untrained)} conversations have no token to train on (first: row "
                         f"{untrained[0]}); the assistant turns must end with {eot!r}, or set --end-of-turn")
    shared = shared_prefix_length(encoded)
    model = policy.load_model(args.model, dtype=torch.bfloat16 if args.lora_rank and args.mixed_precision
                              else torch.float32, attn_implementation=args.attn_implementation)
    if args.lora_rank:
        policy.add_lora(model, args.lora_rank, args.lora_alpha, args.lora_targets, seed=args.seed)
    model = policy.shard_model(model.to(device), mixed_precision=args.mixed_precision,
                               activation_checkpointing=args.activation_checkpointing,
                               compile_layers=args.compile_layers)
    group = sequence_parallel.make_group(args.sequence_parallel)
    model = sequence_parallel.attach(model, group)
    optimizer = policy.adamw(model, args.lr, args.weight_decay)
    scheduler = policy.lr_schedule(optimizer, args.warmup_steps, args.steps, "cosine", floor=0.1)
    step = 0
    checkpoint, state = (load_newest_checkpoint(args.output_dir, lambda path: load_checkpoint(
        path, model, optimizer)) if args.resume else (None, None))
    if checkpoint is not None:
        scheduler.load_state_dict(state["scheduler"])
        step = state["step"]
    out = Path(args.output_dir)
    log = runlog.start(args.output_dir, rank, dataclasses.asdict(args) | {"model": named}, None,
                       resume_step=step if args.resume else None)
    per_rank = args.batch_size // world
    metrics = {}
    bar = tqdm(total=args.steps, initial=step, desc="sft", disable=rank != 0)
    while step < args.steps:
        # A seeded permutation per epoch: resuming at `step` replays exactly the same batches.
        picked = task_rows.in_epoch_order(encoded, step * args.batch_size + rank * per_rank, per_rank, args.seed)
        # --sequence-parallel: a group's ranks train on their conversations together; sums over ranks count each N
        # times, the loss's normaliser too
        picked, _ = sequence_parallel.group_samples(picked, group)
        tokens = collectives.sum_over_ranks(sum(sum(mask) for _, mask, _ in picked))
        micro_batches = [[picked[i] for i in micro] for micro in collectives.same_count_on_every_rank(policy.pack(
            list(range(len(picked))), [ids for ids, _, _ in picked], args.micro_batch_tokens,
            score_from=[shared] * len(picked), model=model, image_tokens=image_tokens(model, picked)))]
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for micro in micro_batches:
            weight = 1.0 if micro else 0.0  # an empty micro-batch keeps FSDP collectives in step across ranks
            # FSDP averages grads over ranks
            loss = sft_loss(model, micro or picked[:1], tokens, shared) * weight * world
            loss.backward()
            loss_sum += loss.item() / world
        grad_norm = policy.clip_grad_norm(model, args.max_grad_norm)
        stepped = policy.step_if_finite(optimizer, grad_norm, "train")
        scheduler.step()
        step += 1
        metrics = {"step": step, "train/loss": collectives.sum_over_ranks(loss_sum), **stepped,
                   "train/lr": scheduler.get_last_lr()[0], "train/tokens": tokens / args.sequence_parallel}
        log.metrics(metrics)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['train/loss']:.4f}")
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            save_checkpoint(args.output_dir, step, model, optimizer,
                            {"step": step, "scheduler": scheduler.state_dict()}, hf_source_dir=args.model,
                            keep_last=args.keep_checkpoints)
    bar.close()
    save_hf(model, args.model, out / "hf")
    if rank == 0:
        print(f"sft done: final loss {metrics.get('train/loss', float('nan')):.4f}, Hugging Face folder {out / 'hf'}")
    return metrics


def shared_prefix_length(encoded: list[tuple[list[int], list[int], list[bytes]]]) -> int:
    """How many first tokens every conversation shares and trains none of (a system prompt with tool signatures, the
    template's opening): the packed forwards run them once per micro-batch (packed_logprobs' share_prefixes), at
    least 1."""
    first = encoded[0][0]
    shared = len(first)
    for ids, mask, _ in encoded:
        differs = next((i for i, (a, b) in enumerate(zip(ids[:shared], first)) if a != b), shared)
        shared = min(shared, mask.index(1), differs)
    return max(shared, 1)


def image_tokens(model, picked: list[tuple[list[int], list[int], list[bytes]]]) -> list[tuple[int, int]] | None:
    """What each conversation's image placeholders add when expanded, for packing a vision-language model's
    micro-batches by the tokens it runs; None for a text model."""
    if not vision.is_vision_model(model.config):
        return None
    return [vision.added_tokens(model.config, ids, images) for ids, _, images in picked]


def sft_loss(model, micro: list[tuple[list[int], list[int], list[bytes]]], total_tokens: float,
             shared: int = 1) -> torch.Tensor:
    """Negative log-likelihood of the masked-in (assistant) tokens of one packed micro-batch of (ids, mask, images),
    over `total_tokens`; the first `shared` tokens, equal in every conversation and untrained, run once. A
    vision-language model's forward gets the images (a text model sees the placeholders)."""
    images = [list(i) for _, _, i in micro] if vision.is_vision_model(model.config) else None
    logprobs, _ = policy.packed_logprobs(model, [ids for ids, _, _ in micro], score_from=[shared] * len(micro),
                                         share_prefixes=True, images=images)
    mask = torch.tensor([m for _, mask, _ in micro for m in mask], dtype=torch.float32, device=logprobs.device)
    return -losses.masked_sum(logprobs, mask) / total_tokens


if __name__ == "__main__":
    with cli.one_line_errors():
        main(cli.parse_args(Args))
    policy.exit_distributed()
