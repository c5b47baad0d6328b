"""Samples of a model (a Hugging Face folder or a kiln checkpoint) for every row of a data set, data-parallel under
torchrun, in the file `python rewards.py score` grades:

    torchrun --nproc-per-node 8 generate.py --model runs/grpo/best --data data/apps_test.parquet --n-samples 8 \
        --temperature 0.8 --engine vllm --out runs/eval/samples.jsonl

Rollouts are the trainers' own (`rollout.collect`): multi-turn rows (--tools) go through the same agent loop.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch
from tqdm import tqdm

import chat
import cli
import collectives
import containers
import merge
import hub
import policy
import task_rows
import vision
from engines import Engine, HFEngine, Sampling, VLLMEngine, derive_seed
from rollout import AgentLimits, Sample, collect, load_rows_within, placeholder_only


@dataclass
class GenerateArgs:
    model: str
    """a Hugging Face folder or hub name, or a kiln checkpoint folder (<output_dir>/checkpoints/step_*)"""
    data: str
    """rows to answer (parquet / jsonl / HF dataset name) in kiln's row schema"""
    out: str = "samples.jsonl"
    """JSONL, one sample a line ({"task_id", "sample", "completion", ...}): what `python rewards.py score` reads"""
    n_samples: int = 1
    """samples per row, the n of pass@k (k <= n; needs a temperature > 0). Not `--n`: torchrun would take that for
    an abbreviation of its own --nnodes / --nproc-per-node"""
    engine: Literal["hf", "vllm"] = "hf"
    """vLLM on GPUs, or the model's own Hugging Face decoding loop (CPU, debugging)"""
    seed: int = 0
    """sampling seed (each sample draws from its own seed, derived from it, the round, the rank and the sample)"""
    max_prompt_tokens: int = 1024
    """rows whose prompt is longer are skipped (and counted on the console)"""
    max_new_tokens: int = 1024
    """generation budget per sample (per turn with tools)"""
    temperature: float = 0.0
    """sampling temperature; 0 = greedy"""
    top_p: float = 1.0
    """nucleus sampling"""
    batch_size: int = 64
    """rows per rank in one engine call (the progress bar moves by batch_size x ranks)"""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """weights on GPUs (the HF engine on CPU always computes in float32)"""
    end_of_turn: str | None = None
    """token that closes an assistant turn (default: found in the chat template, e.g. <|im_end|>, <|eot_id|>)"""
    tools: Literal["none", "python", "codev", "swe"] = "none"
    """multi-turn agent rollouts with these tools, as in training (python: a sandboxed interpreter per trajectory,
    called with <tool_call>; codev: the same, called with CodeV's <code> tags; swe: bash and an editor in a container
    per trajectory, swebench rows, the completion is its diff)"""
    max_turns: int = 4
    """assistant turns per trajectory (tools on)"""
    max_total_tokens: int = 4096
    """prompt + all turns and tool outputs per trajectory (tools on)"""
    max_tool_response_tokens: int = 512
    """longer tool outputs are cut and marked (tools on)"""
    max_agent_seconds: float = 1800.0
    """wall clock per trajectory (tools on)"""
    vllm_gpu_memory_utilization: float = 0.85
    """fraction of GPU memory vLLM may take"""
    vllm_max_model_len: int = 4096
    """vLLM context length"""
    vllm_tensor_parallel_size: int = 1
    """ranks per vLLM engine (consecutive ranks form a group)"""


def check_generate_args(args: GenerateArgs) -> None:
    """Refuse what would waste a run, before any model is loaded."""
    if args.n_samples < 1 or args.batch_size < 1:
        raise ValueError(f"--n-samples ({args.n_samples}) and --batch-size ({args.batch_size}) must be at least 1")
    if args.n_samples > 1 and args.temperature <= 0:
        raise ValueError(f"--n-samples {args.n_samples} with --temperature {args.temperature}: greedy samples of a "
                         "row are all the same; sample with a temperature > 0 (e.g. 0.8) for pass@k")
    out = Path(args.out)
    if out.is_dir():
        raise ValueError(f"--out {args.out} is a directory; name the JSONL file to write")
    if any(parent.exists() and not parent.is_dir() for parent in out.resolve().parents):
        raise ValueError(f"--out {args.out}: a folder on its path is a file")


def is_checkpoint(path) -> bool:
    """Whether `path` is a kiln (DCP) checkpoint folder rather than a Hugging Face model."""
    return (Path(path) / ".metadata").is_file()


def hf_folder(model: str):
    """Where the config and tokenizer of `model` are: a kiln checkpoint's hf/ folder, or the model itself."""
    return Path(model) / "hf" if is_checkpoint(model) else model


def load_generator(args: GenerateArgs, tokenizer, device: torch.device) -> Engine:
    """The engine that samples `args.model`. A kiln checkpoint is read as merge.py reads it (the model entries alone,
    fp32, whatever world size wrote it; a LoRA checkpoint's adapters merged into its base; its hf/ folder gives config
    and tokenizer) on every rank: for big models,
    `python merge.py` it once and generate from the Hugging Face folder."""
    checkpoint = Path(args.model) if is_checkpoint(args.model) else None
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    if args.engine == "vllm":
        engine = VLLMEngine(str(checkpoint / "hf") if checkpoint else args.model, seed=args.seed, dtype=args.dtype,
                            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                            max_model_len=args.vllm_max_model_len, tensor_parallel_size=args.vllm_tensor_parallel_size,
                            **({"load_format": "dummy"} if checkpoint else {}))
        if checkpoint:  # random weights until the checkpoint's arrive through the trainers' weight path
            engine.load_weights(merge.checkpoint_model(checkpoint).state_dict().items() if merge.is_lora(checkpoint)
                                else merge.read_model_state(checkpoint).items())
        return engine
    if checkpoint:
        model = merge.checkpoint_model(checkpoint)
    else:
        model = policy.load_model(args.model)
    model = model.to(device=device, dtype=dtype).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return HFEngine(model, pad_token_id=pad, tokenizer=tokenizer)


def sample_line(sample: Sample, index: int) -> dict:
    """One line of the samples file: task_id and completion (all `rewards.py score` reads), then which sample of the
    row it is, why it ended, its generated tokens and, with tools, its turns and tool calls."""
    line = {"task_id": task_rows.row_id(sample.row), "sample": index, "completion": sample.text,
            "finish_reason": sample.finish_reason, "completion_tokens": sum(sample.loss_mask)}
    return line | {k: sample.info[k] for k in ("turns", "tool_calls", "tool_errors") if k in sample.info}


def generate_lines(engine: Engine, tokenizer, rows: list[dict], args: GenerateArgs, sampling: Sampling,
                   count_image: Callable[[bytes], int] = placeholder_only) -> list[dict]:
    """`args.n_samples` samples of every row, as sample lines in row order, on every rank, budgets counting each image
    as `count_image` tokens. Each round takes the next batch_size x world rows, this rank answers every world-th of
    them, and the lines are gathered. Every rank runs every round, with or without rows of its own: multi-turn rounds
    and tensor-parallel engines are collectives."""
    rank, world = collectives.rank(), collectives.world_size()
    limits = AgentLimits(args.max_turns, args.max_total_tokens, args.max_tool_response_tokens, args.max_agent_seconds)
    per_round = args.batch_size * world
    lines: list[tuple[int, dict]] = []
    bar = tqdm(total=len(rows), desc="generate", unit="row", disable=rank != 0)
    for start in range(0, len(rows), per_round):
        positions = list(range(start + rank, min(start + per_round, len(rows)), world))
        round_sampling = dataclasses.replace(sampling, seed=derive_seed(args.seed, start, rank))  # seeds its samples
        samples, _ = collect(engine, tokenizer, [rows[p] for p in positions], args.n_samples, round_sampling,
                             args.tools, limits, first_group=start + rank, eot=args.end_of_turn, count_image=count_image)
        lines += collectives.gather_objects([(positions[i // args.n_samples], sample_line(s, i % args.n_samples))
                                        for i, s in enumerate(samples)])
        bar.update(min(per_round, len(rows) - start))
    bar.close()
    lines.sort(key=lambda pl: (pl[0], pl[1]["sample"]))
    return [line for _, line in lines]


def generate(args: GenerateArgs) -> Path:
    """Samples of args.model for every row of args.data in args.out (rank 0 writes it, once everything is done)."""
    check_generate_args(args)
    rank, world, device = policy.init_distributed()
    args.model = hub.fetch(args.model, "--model")  # a hub name: downloaded once per node
    if rank == 0:  # made before the model loads: a folder that cannot be made fails now, not after generating
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed + rank)
    seconds = {}
    start = time.perf_counter()
    hf_dir = hf_folder(args.model)
    tokenizer = policy.load_tokenizer(hf_dir)
    count_image = vision.image_counter(hf_dir) or placeholder_only  # as the model's own image processor expands them
    rows = load_rows_within(args.data, tokenizer, args.max_prompt_tokens, verbose=rank == 0, tools=args.tools,
                            count_image=count_image)
    if args.tools == "swe":  # containers of dead kiln processes go; this one's go when it ends, however it ends
        containers.sweep(containers.shared_client())
        containers.remove_owned_at_exit(containers.shared_client())
    engine = load_generator(args, tokenizer, device)
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        stop_token_ids=policy.stop_token_ids(tokenizer, hf_dir,
                                                             chat.end_of_turn(tokenizer, args.end_of_turn)))
    seconds["load"] = time.perf_counter() - start
    lines = generate_lines(engine, tokenizer, rows, args, sampling, count_image)
    seconds["generate"] = time.perf_counter() - start - seconds["load"]
    if rank == 0:
        task_rows.write_atomically(args.out, lines)
        print(f"{len(lines)} samples ({args.n_samples} per row, {len(rows)} rows, {world} ranks) in {args.out}; load "
              f"{seconds['load']:.1f}s, generate {seconds['generate']:.1f}s ({len(lines) / seconds['generate']:.1f} "
              f"samples/s). Grade them: python rewards.py score {args.out} --data {args.data}")
    return Path(args.out)


if __name__ == "__main__":
    with cli.one_line_errors():
        generate(cli.parse_args(GenerateArgs))
    policy.exit_distributed()
