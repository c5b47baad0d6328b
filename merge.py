"""A training checkpoint (DCP, any world size) -> a Hugging Face folder, verified against the checkpoint itself.

    python merge.py runs/grpo/checkpoints/step_00000100 runs/grpo/hf [--dtype bfloat16]

The weights are written in the run's dtype (the checkpoint's hf/config.json: bfloat16 for a Qwen2.5 hub model, float32
for a tiny one) unless --dtype says otherwise.

Reads only the model part of the checkpoint (never the optimizer), restores it in fp32 into a model built from the
checkpoint's hf/ config, and writes safetensors shards + index, config, generation config and the tokenizer files
(chat template included). Then it loads the written folder back with `from_pretrained` and compares its logits on a
few prompts with the restored model's, printing the max abs difference; it exits non-zero past the tolerance. A
vision-language checkpoint (Qwen2.5-VL) is built and reloaded as such (vision tower included), and the prompts
include one with an image.

A LoRA run's checkpoint holds its adapters alone and PEFT's adapter_config.json naming the base model: the base is
loaded from there, the adapters put in PEFT's layers (the reference logits are theirs), merged by PEFT
(`merge_and_unload`) and written as a plain model, whose logits are then checked against the adapters' the same way.
"""
from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed.checkpoint as dcp
import tyro
from peft import LoraConfig
from peft.tuners.lora import LoraModel
from PIL import Image
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer,
                          GenerationConfig)

import cli
import vision

# Written by save_pretrained itself; every other file in hf/ (tokenizer, chat template, ...) is copied as is.
WRITTEN_BY_SAVE = {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json"}
# Module-wrapper prefixes that may survive in parameter names (activation checkpointing, torch.compile).
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
# Max abs logit difference allowed, relative to the largest logit: what rounding the weights to `dtype` can explain.
RELATIVE_TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 5e-3}
PROMPTS = [
    "def fibonacci(n):",
    "Write a Python function that returns the longest palindromic substring of a string.",
    "import sys\n\nfor line in sys.stdin:\n",
]
IMAGE_QUESTION = "What is in the image?"


@dataclass
class Args:
    checkpoint: tyro.conf.Positional[Path]
    """a checkpoint folder: <output_dir>/checkpoints/step_XXXXXXXX (DCP files + hf/)"""
    out: tyro.conf.Positional[Path]
    """where to write the Hugging Face folder"""
    dtype: Literal["bfloat16", "float16", "float32"] | None = None
    """dtype of the written weights (default: the run's, as its model's config.json names it)"""
    max_shard_size: str = "5GB"
    """largest safetensors file (bigger models are split, with an index)"""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """where the verification forward passes run"""
    tolerance: float | None = None
    """max abs logit difference allowed (default: relative to the largest logit, by dtype)"""


def clean_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def read_model_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's "model" entries as full fp32 CPU tensors, whatever world size wrote them."""
    if not (checkpoint / ".metadata").is_file():
        raise ValueError(f"{checkpoint}: no DCP checkpoint here (.metadata missing); pass a checkpoints/step_* folder")
    reader = dcp.FileSystemReader(str(checkpoint))
    entries = reader.read_metadata().state_dict_metadata
    # DCP flattens {"model": {fqn: tensor}} to "model.<fqn>"; asking only for those skips the optimizer entirely.
    state = {key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in entries.items() if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    if not state:
        raise ValueError(f"{checkpoint}: the checkpoint has no 'model' tensors (keys: {sorted(entries)[:5]} ...)")
    with warnings.catch_warnings():  # one process reading on purpose: DCP warns about that whenever no_dist
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": state}, storage_reader=reader, no_dist=True)
    return {clean_name(name): tensor.float() for name, tensor in state.items()}


def model_class(config):
    """The Auto class a checkpoint's config builds, as policy.load_model picks it: vision-language models (a vision
    tower beside the language model) as image-text-to-text, the others as causal LMs."""
    return AutoModelForImageTextToText if vision.is_vision_model(config) else AutoModelForCausalLM


def restore_model(checkpoint: Path, state: dict[str, torch.Tensor]):
    """A model built from hf/config.json holding exactly the checkpoint's weights (fp32); tied weights stay tied."""
    hf_dir = checkpoint / "hf"
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"{hf_dir}: config.json missing; the checkpoint must carry its hf/ folder")
    config = AutoConfig.from_pretrained(hf_dir)
    model = model_class(config).from_config(config, dtype=torch.float32)
    first_name: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(param), name)
    # alias -> the name it is tied to, e.g. lm_head.weight -> model.embed_tokens.weight
    aliases = {name: first_name[id(param)] for name, param in model.named_parameters(remove_duplicate=False)
               if first_name[id(param)] != name}
    for alias, tied_to in aliases.items():  # a tied copy in the checkpoint must equal what it is tied to
        if alias in state and tied_to in state and not torch.equal(state[alias], state[tied_to]):
            raise ValueError(f"{checkpoint}: {alias} is tied to {tied_to} in the config but differs in the checkpoint")
    result = model.load_state_dict(state, strict=False)
    missing, unexpected = set(result.missing_keys) - set(aliases), set(result.unexpected_keys)
    if missing or unexpected:
        raise ValueError(f"{checkpoint}: checkpoint and {type(model).__name__} disagree: missing "
                         f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    if (hf_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(hf_dir)
    return model.eval()


def restore_lora_model(checkpoint: Path, adapters: dict[str, torch.Tensor]):
    """A LoRA checkpoint's model (fp32): the base its adapter_config.json names, with PEFT's LoRA layers holding the
    checkpoint's adapters; and PEFT's LoraModel over it, which merges them."""
    config = LoraConfig.from_pretrained(checkpoint)
    base = config.base_model_name_or_path
    if not base or not (Path(base) / "config.json").is_file():
        raise ValueError(f"{checkpoint}/adapter_config.json: its base model {base!r} is not a model folder here (the "
                         "LoRA run's --model)")
    model = model_class(AutoConfig.from_pretrained(base)).from_pretrained(base, dtype=torch.float32)
    lora = LoraModel(model, config, "default")
    wanted = {name for name, _ in model.named_parameters() if ".lora_" in name}
    if set(adapters) != wanted:
        raise ValueError(f"{checkpoint}: its adapters and the model's LoRA layers disagree: "
                         f"{sorted(set(adapters) ^ wanted)[:5]}")
    model.load_state_dict(adapters, strict=False)
    return model.eval(), lora


def is_lora(checkpoint: Path) -> bool:
    """Whether a checkpoint holds LoRA adapters (and PEFT's adapter_config.json naming their base)."""
    return (Path(checkpoint) / "adapter_config.json").is_file()


def checkpoint_model(checkpoint: Path):
    """The plain model a checkpoint holds (fp32): its weights, or a LoRA checkpoint's base with its adapters merged by
    PEFT."""
    state = read_model_state(checkpoint)
    if is_lora(checkpoint):
        _, adapters = restore_lora_model(checkpoint, state)
        return adapters.merge_and_unload().eval()
    return restore_model(checkpoint, state)


def verification_inputs(model, tokenizer) -> list[dict]:
    """Forward inputs of the prompts the logits are compared on: PROMPTS as text and, for a vision-language model, a
    chat turn with a seeded noise image, its placeholder expanded as the trainer expands it (vision.py)."""
    inputs = [dict(tokenizer(p, return_tensors="pt")) for p in PROMPTS]
    if vision.is_vision_model(model.config):
        generator = torch.Generator().manual_seed(0)
        image = Image.fromarray(torch.randint(0, 256, (84, 112, 3), dtype=torch.uint8, generator=generator).numpy())
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": IMAGE_QUESTION}]}]
        text = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
        processor = vision.processor_for(model.config)
        pixel_values, grid = vision.pixels(processor, [image])
        ids, _ = vision.expand(tokenizer(text, add_special_tokens=False)["input_ids"], grid,
                               model.config.image_token_id, processor.merge_size)
        input_ids = torch.tensor([ids])
        inputs.append({"input_ids": input_ids, "pixel_values": pixel_values, "image_grid_thw": grid,
                       "mm_token_type_ids": (input_ids == model.config.image_token_id).int()})
    return inputs


@torch.no_grad()
def prompt_logits(model, tokenizer, device: str) -> list[torch.Tensor]:
    model.to(device)
    out = [model(**{k: v.to(device) for k, v in inputs.items()}).logits[0].float().cpu()
           for inputs in verification_inputs(model, tokenizer)]
    model.cpu()
    return out


def run_dtype(checkpoint: Path) -> str:
    """The dtype the run's model came in: its config's `dtype` (`torch_dtype` in older folders), float32 if none."""
    config = json.loads((checkpoint / "hf" / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    if dtype not in RELATIVE_TOLERANCE:
        raise ValueError(f"{checkpoint}/hf/config.json: dtype {dtype!r}; pass --dtype bfloat16, float16 or float32")
    return dtype


def merge(args: Args) -> float:
    """Writes args.out and returns the max abs logit difference to the checkpoint (RuntimeError past tolerance)."""
    state = read_model_state(args.checkpoint)
    dtype = args.dtype or run_dtype(args.checkpoint)
    model, adapters = (restore_lora_model(args.checkpoint, state) if is_lora(args.checkpoint)
                       else (restore_model(args.checkpoint, state), None))
    del state
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint / "hf")
    reference = prompt_logits(model, tokenizer, args.device)
    if adapters is not None:
        model = adapters.merge_and_unload()

    args.out.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, dtype)).save_pretrained(args.out, max_shard_size=args.max_shard_size)
    del model
    for path in (args.checkpoint / "hf").iterdir():
        if path.is_file() and path.name not in WRITTEN_BY_SAVE:
            shutil.copy2(path, args.out / path.name)

    # The written folder, as anyone will load it; fp32 compute, so only the storage dtype differs from `reference`.
    merged = model_class(AutoConfig.from_pretrained(args.out)).from_pretrained(args.out, dtype=torch.float32).eval()
    logits = prompt_logits(merged, AutoTokenizer.from_pretrained(args.out), args.device)
    diff = max((a - b).abs().max().item() for a, b in zip(reference, logits))
    scale = max(1.0, max(r.abs().max().item() for r in reference))
    tolerance = args.tolerance if args.tolerance is not None else RELATIVE_TOLERANCE[dtype] * scale
    agree = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(reference, logits))
    total = sum(r.shape[0] for r in reference)
    print(f"max abs logit difference vs the checkpoint: {diff:.3g} (tolerance {tolerance:.3g} for {dtype}); "
          f"greedy next token agrees at {agree}/{total} positions")
    if diff > tolerance:
        raise RuntimeError(f"{args.out}: logits differ from the checkpoint by {diff:.3g} > {tolerance:.3g}")
    print(f"wrote {args.out}")
    return diff


if __name__ == "__main__":
    with cli.one_line_errors():
        merge(tyro.cli(Args))
