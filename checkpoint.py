"""Training checkpoints: the folder layout (<output_dir>/checkpoints/step_XXXXXXXX, written atomically, pruned to
the last few), saving and restoring model, optimizer and RNG state with DCP (any world size reads what any wrote), the
newest readable checkpoint for a resume, and the model as a Hugging Face folder (the final one, the best so far).

Saving, loading and exporting are collective: every rank calls them, in step, with or without torchrun.
"""

import json
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from huggingface_hub import save_torch_state_dict, snapshot_download
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

import collectives
import policy


_CHECKPOINT = re.compile(r"step_(\d+)")
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".index.json")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _copy_hf_files(hf_source_dir, dest: Path) -> None:
    """Config, generation config, tokenizer and processor files of the source model: everything but weights."""
    source = Path(hf_source_dir)
    if not source.is_dir():
        source = Path(snapshot_download(str(hf_source_dir), local_files_only=True))
    dest.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_FILES):
            shutil.copy2(f, dest / f.name)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _model_state(model) -> dict:
    """What a checkpoint holds of the model: its state dict, or a LoRA model's adapters alone (its frozen base is the
    model it was loaded from)."""
    state = get_model_state_dict(model)
    if policy.lora_config(model) is None:
        return state
    return {name: tensor for name, tensor in state.items() if policy.is_adapter_weight(name)}


def save_checkpoint(output_dir, step: int, model, optimizer, trainer_state: dict, hf_source_dir,
                    keep_last: int | None = None) -> Path:
    """<output_dir>/checkpoints/step_XXXXXXXX: a DCP checkpoint of {"model", "optimizer"} (sharded, any world size
    can read it; a LoRA model's adapters only, with PEFT's adapter_config.json naming the base), trainer_state.json,
    rng/rank{r}.pt and hf/ (config + tokenizer files of `hf_source_dir`). Written
    into a temp dir that rank 0 renames once every rank is done, so a crash mid-save leaves the last good checkpoint
    as the newest. keep_last: how many checkpoints stay, the one just written always among them (older ones beyond
    that are deleted). Collective: call on every rank."""
    root = Path(output_dir) / "checkpoints"
    final, tmp = root / f"step_{step:08d}", root / f".tmp_step_{step:08d}"
    rank = collectives.rank()
    payload = json.dumps(trainer_state, indent=1)  # fail before writing anything if it is not JSON
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
        (tmp / "rng").mkdir(parents=True)
    _barrier()
    state = {"model": _model_state(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=tmp)
    torch.save(_rng_state(), tmp / "rng" / f"rank{rank}.pt")
    if rank == 0:
        _copy_hf_files(hf_source_dir, tmp / "hf")
        if policy.lora_config(model) is not None:
            policy.lora_config(model).save_pretrained(tmp)
        (tmp / "trainer_state.json").write_text(payload)
    _barrier()
    if rank == 0:
        if final.exists():  # the same step saved again (a resumed run): swap, then drop the old copy
            old = root / f".old_step_{step:08d}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        found = _complete_checkpoints(root)
        older = [p for p in found if _step_of(p) < step]
        # A later step than this one was left by a run this one resumed before it (an unreadable checkpoint was
        # skipped): kept, it would be the one a resume picks.
        stale = [p for p in found if _step_of(p) > step]
        if keep_last:
            stale += older[: max(0, len(older) - (keep_last - 1))]
        for path in stale:
            shutil.rmtree(path)
    _barrier()
    return final


def _step_of(checkpoint: Path) -> int:
    return int(_CHECKPOINT.fullmatch(checkpoint.name).group(1))


def _complete_checkpoints(root: Path) -> list[Path]:
    found = [p for p in root.glob("step_*") if _CHECKPOINT.fullmatch(p.name) and (p / "trainer_state.json").is_file()]
    return sorted(found, key=_step_of)


def latest_checkpoint(output_dir) -> Path | None:
    """The newest complete checkpoint under <output_dir>/checkpoints, or None (temp dirs of interrupted saves are
    never returned)."""
    found = _complete_checkpoints(Path(output_dir) / "checkpoints")
    return found[-1] if found else None


def load_newest_checkpoint(output_dir, load: Callable[[Path], dict]) -> tuple[Path | None, dict | None]:
    """(checkpoint, trainer state) of the newest checkpoint under <output_dir>/checkpoints that `load` (e.g. a call of
    load_checkpoint) reads without error; an unreadable one (a truncated or missing file) is skipped with a warning
    naming it and the error, and the one before it is tried. (None, None) when there is none. Collective."""
    for path in reversed(_complete_checkpoints(Path(output_dir) / "checkpoints")):
        try:
            return path, load(path)
        except (OSError, EOFError, ValueError, RuntimeError, AssertionError, KeyError, pickle.UnpicklingError,
                CheckpointException) as e:
            if collectives.rank() == 0:
                reason = (str(e).strip().splitlines() or [""])[0]
                print(f"warning: checkpoint {path} is unreadable ({type(e).__name__}: {reason}); trying the one "
                      f"before it", flush=True)
    return None, None


def load_checkpoint(path, model, optimizer=None) -> dict:
    """Restores model (and optimizer) state and this rank's RNG streams from `path`; returns the trainer state.
    Collective: call on every rank, after `shard_model` and before the first step."""
    path = Path(path)
    try:  # read first: a checkpoint whose state is cut short fails before any weight changes
        trainer_state = json.loads((path / "trainer_state.json").read_text())
    except ValueError as e:
        raise ValueError(f"{path / 'trainer_state.json'}: {e}") from e
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path / '.metadata'}: missing")
    state = {"model": _model_state(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=policy.lora_config(model) is None))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    rng_file = path / "rng" / f"rank{collectives.rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        print(f"warning: {rng_file} missing (saved by fewer ranks, or removed): rank {collectives.rank()} keeps its own "
              f"RNG streams, so sampling from here on differs from the run that was interrupted")
    return trainer_state


def save_hf(model, hf_source_dir, out_dir) -> Path:
    """The model's current weights as a Hugging Face folder (safetensors shards + the source's config and tokenizer
    files), in the training dtype; a LoRA model's adapters merged into its weights. Collective: call on every rank;
    rank 0 writes."""
    out = Path(out_dir)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if collectives.rank() == 0:
        if policy.lora_config(model) is not None:
            state = policy.merge_adapters(state, policy.lora_config(model))
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied to the embeddings; HF checkpoints omit it
        _copy_hf_files(hf_source_dir, out)
        # Gathered tensors can be views into one larger buffer; safetensors wants each to own its storage.
        save_torch_state_dict({name: tensor.clone() for name, tensor in state.items()}, out)
    _barrier()
    return out


def save_best(model, hf_source_dir, out_dir, record: dict) -> Path:
    """The model as a Hugging Face folder at out_dir (`save_hf`) with `record` (step, metrics) in best.json, written
    beside it and swapped in whole: a crash mid-save leaves the previous best. Collective: call on every rank."""
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}_tmp")
    if collectives.rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
    _barrier()
    save_hf(model, hf_source_dir, tmp)
    if collectives.rank() == 0:
        (tmp / "best.json").write_text(json.dumps(record, indent=1))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    _barrier()
    return out


def check_best_metric(name: str) -> None:
    """--best-metric must name an evaluation metric ("" keeps no best policy)."""
    if name and not name.startswith(("val-core/", "val-aux/")):
        raise ValueError(f"--best-metric {name}: must be an evaluation metric (val-core/... or val-aux/...), e.g. "
                         "val-core/all/test_pass_rate or val-core/all/pass@1")


def keep_best(best: dict, name: str, metrics: dict, step: int, model, hf_source_dir: str, output_dir: str) -> dict:
    """The best-policy rule of every trainer: the policy goes to <output_dir>/best (best.json: step and metrics) when
    the evaluation metric `name` beats every earlier evaluation's (ties keep the earlier). Returns the record
    {"step", "metric", "value"} of the policy kept now ({} and nothing kept for name ""). Collective."""
    if not name:
        return best
    if name not in metrics:
        raise ValueError(f"--best-metric {name}: this evaluation has no such metric (test pass rates exist only where "
                         "rewards count tests; pass e.g. --best-metric val-core/all/pass@1, or '' to keep none); it "
                         "has " + ", ".join(sorted(k for k in metrics if not k.startswith("val-aux/error/"))))
    if best and metrics[name] <= best["value"]:
        return best
    save_best(model, hf_source_dir, Path(output_dir) / "best", {"step": step, "metrics": metrics})
    return {"step": step, "metric": name, "value": metrics[name]}
