"""The model being trained: load a Hugging Face causal LM (or a value model for PPO's critic), shard it with FSDP2,
attend within packed sequences (`packed_sdpa`), compute per-token logprobs and values of packed sequences (in chunks,
each distinct prefix run once; spread over ranks by sequence_parallel.py), plan micro-batches, and stream full
weights to an inference engine. Also the run's distributed reductions, its optimizer and learning-rate schedule.
Checkpoints are checkpoint.py's.

Every function works on a plain model and on a `shard_model`-ed one, with or without torchrun.
"""

import functools
import itertools
import logging
import math
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import create_block_mask
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.nn.utils.rnn import pad_sequence
import transformers
from peft import LoraConfig, inject_adapter_in_model
from transformers import (AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText,
                          AutoModelForTokenClassification, AutoTokenizer, GenerationConfig)
from transformers.integrations.flex_attention import flex_attention_forward
from transformers.masking_utils import AttentionMaskInterface

import collectives
import hub
import sequence_parallel
import vision


@torch.compiler.disable  # data-dependent boundaries: under compile_layers each new packing would recompile
def packed_sdpa(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, position_ids=None,
                sliding_window=None, **kwargs):
    """Attention for packed forwards (`attn_implementation="packed_sdpa"`): causal sdpa on each sequence of the pack
    by itself, read off the position ids. A sequence starts where they restart at 0. A *branch* is a run of tokens
    whose positions start at p > 0 and do not continue the tokens before it: it continues the first p tokens of the
    path it leaves, the tokens the row's previous token attended at positions below p, and attends to them and to
    itself. So a row laid out as a prefix tree in pre-order (`packed_logprobs(share_prefixes=True)`: a GRPO group's
    prompt, a session's segments) runs each distinct prefix once. sdpa given the pack would build and apply a
    [tokens, tokens] mask, work quadratic in the micro-batch; this is quadratic only in each sequence. No KV cache and
    no padding: engines decode with sdpa."""
    if query.shape[0] != 1 or position_ids is None or position_ids.dim() != 2 or query.shape[2] != key.shape[2]:
        raise ValueError("attn_implementation='packed_sdpa' serves packed forwards only (one row of sequences, 2-d "
                         "position ids, no KV cache); decode with sdpa")
    if sliding_window is not None:
        raise ValueError(f"packed_sdpa attends to whole sequences; this layer has a sliding window of {sliding_window} "
                         "tokens: train with --attn-implementation flex_attention or sdpa")
    positions = position_ids[0]
    # pieces: runs of consecutive positions; each starts a sequence (position 0) or a branch of the current path
    cut = torch.ones_like(positions, dtype=torch.bool)
    cut[1:] = positions[1:] != positions[:-1] + 1
    starts = cut.nonzero().squeeze(1)
    starts, firsts = torch.stack([starts, positions[starts]]).tolist()  # one wait for the device per layer
    if firsts[0] != 0:
        raise ValueError("packed_sdpa: the position ids must start at 0 (they restart at 0 for every packed sequence)")
    lengths = [b - a for a, b in zip(starts, starts[1:] + [query.shape[2]])]

    def attend(q, k, v, mask=None):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling, enable_gqa=True)

    # split, not slicing: its backward is one cat, where each slice's backward zero-fills a full-size gradient
    qs, ks, vs = query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2)
    out = [None] * len(lengths)
    path = []  # the current path: (piece, its first n tokens) runs, from position 0
    branches = {}  # (the runs of a prefix, branch length) -> branch pieces
    for i, first in enumerate(firsts):
        prefix, depth = [], 0
        for piece, n in path:
            if depth == first:
                break
            prefix.append((piece, min(n, first - depth)))
            depth += prefix[-1][1]
        if depth < first:
            raise ValueError(f"packed_sdpa: tokens at positions {first}.. continue a sequence whose first {depth} "
                             "tokens are all that precede them")
        path = prefix + [(i, lengths[i])]
        if first == 0:
            out[i] = attend(qs[i], ks[i], vs[i])
        else:
            branches.setdefault((tuple(prefix), lengths[i]), []).append(i)
    for (prefix, length), pieces in branches.items():  # equal-length branches of one prefix: one batched call
        n, shared = len(pieces), sum(m for _, m in prefix)
        k = torch.cat([torch.cat([ks[p][:, :, :m] for p, m in prefix], 2).expand(n, -1, -1, -1),
                       torch.cat([ks[i] for i in pieces])], 2)
        v = torch.cat([torch.cat([vs[p][:, :, :m] for p, m in prefix], 2).expand(n, -1, -1, -1),
                       torch.cat([vs[i] for i in pieces])], 2)
        sees = torch.ones(length, shared + length, dtype=torch.bool, device=query.device).tril(shared)
        for i, o in zip(pieces, attend(torch.cat([qs[i] for i in pieces]), k, v, sees).split(1)):
            out[i] = o
    return torch.cat(out, dim=2).transpose(1, 2), None  # [1, tokens, heads, head_dim], as transformers' return


# Both packed attentions run sequence-parallel when a forward passes `sequence_parallel` (sequence_parallel.ulysses).
AttentionInterface.register("packed_sdpa", sequence_parallel.ulysses(packed_sdpa))
AttentionInterface.register("flex_attention", sequence_parallel.ulysses(flex_attention_forward))
AttentionMaskInterface.register("packed_sdpa", lambda *args, **kwargs: None)  # sequences come from position ids


def load_model(path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """A Hugging Face causal LM from a local folder (or the local hub cache), on CPU, in `dtype`. A vision-language
    model (Qwen2.5-VL) loads with its vision tower: `attn_implementation` goes to the language model, sdpa to the
    vision tower (it attends within each image's windows; the packed attentions are for text rows). flex_attention
    is refused for it (`check_attention`)."""
    if not vision.is_vision_model(AutoConfig.from_pretrained(path, local_files_only=True)):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                    local_files_only=True)
    return AutoModelForImageTextToText.from_pretrained(
        path, dtype=dtype, local_files_only=True,
        attn_implementation={"text_config": attn_implementation, "vision_config": "sdpa"})


def add_lora(model, rank: int, alpha: float, targets: str = "all-linear", seed: int = 0):
    """LoRA adapters (PEFT) on the `targets` linear layers of `model`, in place, its other weights frozen: each adapted
    layer computes W x + (alpha / rank) B A x, with B = 0 at the start (the model computes what it did) and A drawn
    from `seed` (the same on every rank: FSDP2 takes the ranks' replicas to be equal). targets: "all-linear" (every
    linear layer but the output layer) or module names, comma-separated (q_proj,k_proj,v_proj,o_proj). The adapters
    are fp32 whatever the base's dtype. The model's class and its parameter names stay Hugging Face's, the adapted
    layers' weights under `<layer>.base_layer.` and the adapters under `<layer>.lora_A.default.` / `lora_B`."""
    if rank < 1 or alpha <= 0:
        raise ValueError(f"LoRA needs --lora-rank >= 1 and --lora-alpha > 0, got {rank} and {alpha}")
    names = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    source = Path(str(model.name_or_path))
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=names, bias="none",
                        base_model_name_or_path=str(source.resolve()) if source.is_dir() else str(source))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        try:
            inject_adapter_in_model(config, model)
        except ValueError as e:  # PEFT's "Target modules ... not found in the base model"
            raise ValueError(f"--lora-targets {targets}: {e}") from e
    for name, param in model.named_parameters():
        if is_adapter_weight(name):
            param.data = param.data.float()
    return model


def lora_config(model) -> LoraConfig | None:
    """The PEFT config of the model's LoRA adapters (`add_lora`), None for a model without."""
    return getattr(model, "peft_config", {}).get("default")


def is_adapter_weight(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


@torch.no_grad()
def iter_adapter_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every LoRA adapter weight of `model`, in its parameter names: what an engine that holds
    the base already needs. Under FSDP2 each is gathered (a collective: every rank iterates, in step)."""
    for name, param in model.named_parameters():
        if is_adapter_weight(name):
            yield _hf_name(name), param.full_tensor() if isinstance(param, DTensor) else param.detach().clone()


def merge_adapters(state: dict[str, torch.Tensor], config: LoraConfig) -> dict[str, torch.Tensor]:
    """A state dict of a model with LoRA adapters (`add_lora`'s names) as the plain model's: each adapted layer's
    weight W + (alpha / r) B A under the layer's own name, the adapters gone."""
    scale = config.lora_alpha / config.r
    merged = {}
    for name, tensor in state.items():
        if is_adapter_weight(name):
            continue
        layer, base, param = name.partition(".base_layer.")
        if base and param == "weight":
            a, b = state[f"{layer}.lora_A.default.weight"], state[f"{layer}.lora_B.default.weight"]
            tensor = (tensor.float() + scale * (b.float() @ a.float())).to(tensor.dtype)
        merged[f"{layer}.{param}" if base else name] = tensor
    return merged


ATTENTIONS = ("packed_sdpa", "sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def check_attention(path, attn_implementation: str) -> None:
    """Refuse, before anything loads, an attention the model cannot train with: one transformers does not know, or
    flex_attention for a vision-language model (transformers refuses it for Qwen2.5-VL's language model)."""
    if attn_implementation not in ATTENTIONS:
        raise ValueError(f"--attn-implementation {attn_implementation}: unknown; use one of {', '.join(ATTENTIONS)}")
    if attn_implementation == "flex_attention" and vision.is_vision_model(
            AutoConfig.from_pretrained(path, local_files_only=True)):
        raise ValueError(f"{path}: a vision-language model cannot train with flex_attention; use "
                         "--attn-implementation packed_sdpa or flash_attention_2")


def check_model_path(path: str, flag: str = "--model") -> None:
    """Refuse, before anything loads, a model that is neither a folder nor a hub name, and, offline
    (HF_HUB_OFFLINE=1), a hub model that is not in the local cache; naming it. `hub.fetch` downloads the others."""
    if Path(path).is_dir():
        return
    if hub.hub_name(path) is None:
        raise ValueError(f"{flag} {path}: model folder does not exist")
    hub.check_cached(path, f"{flag} {path}", "model")


def load_tokenizer(path):
    """The tokenizer saved next to the model (left padding for generation comes from its config)."""
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def stop_token_ids(tokenizer, path, end_of_turn: str | None = None) -> list[int]:
    """Token ids that end a generation: the generation config's eos ids, the tokenizer's eos and the chat template's
    end-of-turn token (chat.end_of_turn; a base model's eos is often another token, e.g. Llama 3's)."""
    try:
        eos = GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's eos alone
        eos = None
    eos = eos if isinstance(eos, list) else [eos]
    turn = [tokenizer.convert_tokens_to_ids(end_of_turn)] if end_of_turn is not None else []
    return list(dict.fromkeys(i for i in [*eos, tokenizer.eos_token_id, *turn] if i is not None))


def load_value_model(path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """The model at `path` as transformers' *ForTokenClassification with one label and no dropout (values must not be
    noisy): a scalar per position. From a causal LM checkpoint the new head starts at zero, so every value starts at 0
    and every rank holds the same head (FSDP2 shards assume identical replicas); a saved value model keeps its head."""
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    try:
        model, info = AutoModelForTokenClassification.from_pretrained(
            path, config=config, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True,
            output_loading_info=True)
    except ValueError as e:  # the architecture has no token-classification class in transformers
        raise ValueError(f"{path}: cannot build a value model from {type(config).__name__} ({e})") from e
    missing = set(info["missing_keys"])
    if missing - {"score.weight", "score.bias"}:
        raise ValueError(f"{path}: the value model is missing base weights, e.g. {sorted(missing)[:5]}")
    if "score.weight" in missing:
        with torch.no_grad():
            model.score.weight.zero_()
            if model.score.bias is not None:
                model.score.bias.zero_()
    return model


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world_size, device). Under torchrun joins the job's group (gloo on CPU, nccl + gloo on CUDA); a plain
    `python` run gets a one-process group, so FSDP2, DCP and collectives run the same code either way."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend, device_id=device if cuda else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_rank() != 0:  # one "Loading weights" bar per job, not per rank
        transformers.utils.logging.disable_progress_bar()
    return dist.get_rank(), dist.get_world_size(), device


def exit_distributed(code: int = 0) -> NoReturn:
    """The last call of a script that ran `init_distributed`: destroy the process group, flush output, and exit
    without the interpreter's teardown.

    A gloo worker thread can still be dropping its reference to a finished collective's tensor when the script ends;
    that needs the GIL, and if the interpreter is finalizing by then the process aborts with "terminate called without
    an active exception" (pytorch/pytorch#190489, open). Destroying the group does not join those threads while
    FSDP/DTensor caches still hold it, so the process leaves with `os._exit` once everything is written."""
    if dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# Outputs that selective activation checkpointing keeps: every matmul's and attention's. With them saved, the
# backward's recompute of a layer is only its elementwise work (norms, rotary, activation, residual adds), and the
# inputs each matmul's backward needs come out of that recompute.
_KEPT_BY_SELECTIVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                      torch.ops.aten._scaled_dot_product_flash_attention.default,
                      torch.ops.aten._scaled_dot_product_efficient_attention.default,
                      torch.ops.aten._scaled_dot_product_cudnn_attention.default,
                      torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                      torch.ops.higher_order.flex_attention}


def _keep_matmuls_and_attention(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _KEPT_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


_RECOMPUTE = {  # a partial, not a closure: torch.compile traces a checkpoint's context_fn only in this form
    "full": functools.partial(checkpoint, use_reentrant=False),
    "selective": functools.partial(checkpoint, use_reentrant=False, context_fn=functools.partial(
        create_selective_checkpoint_contexts, _keep_matmuls_and_attention)),
}


def _checkpointed(forward, mode: str):
    """`forward` under activation checkpointing: backward recomputes what the forward did not keep (nothing but the
    inputs with "full"; all but matmul and attention outputs with "selective"). Grad-free forwards run as usual."""
    return functools.partial(_RECOMPUTE[mode], forward)


def shard_model(model, mixed_precision: bool = False, activation_checkpointing: str = "none",
                compile_layers: bool = False):
    """FSDP2 `fully_shard` on every decoder layer (the model's `_no_split_modules`) and then the root, in place.
    mixed_precision: bf16 compute with fp32 master weights and fp32 gradient reduction. activation_checkpointing:
    "none"; "full" keeps only each decoder layer's input and recomputes the layer in backward (least memory, about a
    third more matmul work); "selective" also keeps every matmul and attention output and recomputes only the
    elementwise work (about half the activation memory of "none", no matmul recomputed). compile_layers:
    torch.compile each decoder layer's forward, checkpointing included (fuses its norms, rotary and activation).
    FSDP's hooks stay outside the compiled code; parameter names stay as they are. Needs `init_distributed()`
    first."""
    if not dist.is_initialized():
        raise RuntimeError("shard_model needs a process group: call policy.init_distributed() first")
    if activation_checkpointing not in ("none", *_RECOMPUTE):
        raise ValueError(f"activation_checkpointing must be none, full or selective; got {activation_checkpointing!r}")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
        else MixedPrecisionPolicy()
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (_no_split_modules={layer_classes})")
    for layer in layers:
        if activation_checkpointing != "none":
            layer.forward = _checkpointed(layer.forward, activation_checkpointing)
        if compile_layers:
            layer.forward = torch.compile(layer.forward)
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)  # the root stays unsharded after forward: backward needs it first
    return model


def adamw(model, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (a LoRA model's adapters; no state for a frozen base)."""
    # foreach: torch's default for GPU tensors; on CPU it would step one tensor at a time in Python
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay,
                             foreach=True)


def lr_schedule(optimizer, warmup_steps: int, total_steps: int, decay: str = "constant", floor: float = 0.0):
    """Linear warm-up to the optimizer's learning rate over `warmup_steps`, then constant ("constant") or a cosine down
    to `floor` times it at `total_steps` ("cosine"). Call its step() once per optimizer step."""
    if decay not in ("constant", "cosine"):
        raise ValueError(f"learning-rate decay must be constant or cosine; got {decay!r}")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, total_steps, decay, floor))


def lr_factor(step: int, warmup_steps: int, total_steps: int, decay: str, floor: float) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "cosine":
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


def _chunk_forward(logits, targets, temperature: float, with_entropy: bool, banned):
    """log p(target), log-sum-exp and entropy (None without) of softmax(logits / temperature) for one chunk of rows,
    in fp32 or wider, in place on one [rows, vocab] buffer (two with entropy). Ids in `banned` have probability 0,
    as the engines sample."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)).div_(temperature)
    z[:, banned] = -torch.inf
    chosen = z.gather(1, targets[:, None]).squeeze(1)
    top = z.amax(dim=-1, keepdim=True)
    z.sub_(top)
    z[:, banned] = torch.finfo(z.dtype).min  # exp gives 0 all the same, and 0 * z stays 0 in the entropy
    entropy = None
    if with_entropy:  # H = lse - E_p[z] = log(sum e) - sum(e * z) / sum(e), with e = exp(z - max)
        e = z.exp()
        total = e.sum(-1)
        entropy = total.log() - e.mul_(z).sum(-1) / total
    else:
        total = z.exp_().sum(-1)
    lse = top.squeeze(1) + total.log()
    return chosen - lse, lse, entropy


def _chunk_grad(logits, targets, lse, entropy, grad_logprob, grad_entropy, temperature: float, banned):
    """d loss / d logits of one chunk, in the logits' dtype, from the upstream gradients of its log p(target) and
    entropy (entropy None: no entropy term). dH/dz = -p (log p + H); d log p_y/dz = onehot(y) - p; 0 for banned ids
    (p = 0, and no target is banned)."""
    logp = logits.to(lse.dtype).div_(temperature).sub_(lse[:, None])
    if entropy is None:
        g = logp.exp_().mul_(-grad_logprob)
    else:
        p = logp.exp()
        g = logp.add_(entropy[:, None]).mul_(grad_entropy).add_(grad_logprob).mul_(p).neg_()
    g[:, banned] = 0
    return g.scatter_add_(1, targets[:, None], grad_logprob).div_(temperature).to(logits.dtype)


@functools.cache
def _compiled(fn):
    """torch.compile(fn), made on first use (importing torch.compile's machinery costs about a second). The chunked
    softmax math is compiled on GPUs only: there it is memory-bound (about ten passes over [rows, vocab] in fp32) and
    fuses into a few kernels; on a CPU it stays eager and in place."""
    return torch.compile(fn, dynamic=True)


class _ChunkedChosenLogprobs(torch.autograd.Function):
    """log p(target) and optionally the entropy of softmax(hidden @ weight.T / temperature), row chunk by row chunk,
    in fp32 (fp64 for an fp64 model). Backward recomputes each chunk's logits: at no point is more than one chunk's
    [rows, vocab] alive. The matmuls run in the model's dtype (as the output layer would; in bf16 that is the tensor
    cores), the softmax math in fp32 or wider. Ids in `banned` (a vision model's placeholders) are out of the
    distribution; no target may be one."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy, banned):
        forward_math = _compiled(_chunk_forward) if hidden.is_cuda else _chunk_forward
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        out = torch.empty(len(hidden), 2 if with_entropy else 1, dtype=dtype, device=hidden.device)
        lse = torch.empty(len(hidden), dtype=dtype, device=hidden.device)
        for i in range(0, len(hidden), chunk_size):
            rows = slice(i, i + chunk_size)
            logprob, lse[rows], entropy = forward_math(hidden[rows] @ weight.T, targets[rows], temperature,
                                                       with_entropy, banned)
            out[rows, 0] = logprob
            if with_entropy:
                out[rows, 1] = entropy
        ctx.save_for_backward(hidden, weight, targets, lse, out, banned)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse, out, banned = ctx.saved_tensors
        grad_math = _compiled(_chunk_grad) if hidden.is_cuda else _chunk_grad
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if want_weight else None
        for i in range(0, len(hidden), ctx.chunk_size):
            rows = slice(i, i + ctx.chunk_size)
            entropy, grad_entropy = (out[rows, 1], grad_out[rows, 1, None]) if ctx.with_entropy else (None, None)
            g = grad_math(hidden[rows] @ weight.T, targets[rows], lse[rows], entropy, grad_out[rows, 0, None],
                          grad_entropy, ctx.temperature, banned)
            if want_hidden:
                grad_hidden[rows] = g @ weight
            if want_weight and g.dtype == grad_weight.dtype:  # fp32 (or fp64) model: accumulate in place
                grad_weight.addmm_(g.T, hidden[rows].to(g.dtype))
            elif want_weight:  # bf16: a tensor-core matmul, then the fp32 sum (an fp32 matmul would skip them)
                grad_weight.add_(g.T @ hidden[rows].to(g.dtype))
            del g
        return grad_hidden, grad_weight.to(weight.dtype) if want_weight else None, None, None, None, None, None


def shares_prefixes(model) -> bool:
    """Whether `packed_logprobs(share_prefixes=True)` runs a shared prefix once for this model: packed_sdpa reads
    branches off the position ids, flex_attention is given a block mask that says the same. flash_attention_2 and
    sdpa take every break in the positions for a new sequence, so they get each sequence whole (the same numbers,
    more tokens)."""
    return vision.text_attention(model.config) in ("packed_sdpa", "flex_attention")


def branch_block_mask(positions: torch.Tensor):
    """flex_attention's BlockMask for a packed row with branches, what packed_sdpa attends: the row is a prefix tree
    laid out in pre-order, and a token sees its ancestors and itself. Token k's subtree is the tokens after it up to
    the next one at its position or lower, so q sees k iff k <= q <= the end of k's subtree (O(tokens), no
    [tokens, tokens] mask materialised; built by the compiled `create_block_mask`)."""
    # [1, tokens], read at [batch, kv]: inductor's CPU flex kernel fails to compile a 1-d read at [kv] once the
    # shapes go dynamic (transformers' own packed-sequence mask reads 2-d too)
    subtree_end = torch.tensor(_subtree_ends(positions.tolist()), device=positions.device)[None]

    def sees(batch, head, q, kv):
        return (kv <= q) & (q <= subtree_end[batch, kv])

    return _compiled(create_block_mask)(sees, None, None, len(positions), len(positions), device=positions.device)


def _subtree_ends(positions: list[int]) -> list[int]:
    """For each token of a row in pre-order, the index of the last token of its subtree: one before the next token at
    its position or lower (a sibling, a branch off an ancestor, a new sequence), else the row's last."""
    ends, open_tokens = [len(positions) - 1] * len(positions), []
    for row, position in enumerate(positions):
        while open_tokens and positions[open_tokens[-1]] >= position:
            ends[open_tokens.pop()] = row - 1
        open_tokens.append(row)
    return ends


def minibatch(groups: list[int], count: int, which: int) -> list[int]:
    """Indices of minibatch `which` of `count` over samples whose group ids are `groups` (a group's samples adjacent):
    whole groups, in order, the groups spread as evenly as they divide. Whole groups keep each group's advantages
    together (GRPO's are zero-mean within one) and let its samples share their prompt in one micro-batch; a rank with
    fewer groups than minibatches has empty ones."""
    starts = [i for i, g in enumerate(groups) if i == 0 or g != groups[i - 1]] + [len(groups)]
    n = len(starts) - 1
    return list(range(starts[n * which // count], starts[n * (which + 1) // count]))


def pack(index: list[int], sequences: list[list[int]], max_tokens: int, score_from: list[int] | None = None,
         model=None, image_tokens: list[tuple[int, int]] | None = None) -> list[list[int]]:
    """Micro-batches for packed forwards: the samples `index` (with `sequences`) greedily packed into at most
    `max_tokens` tokens each (a longer sample goes alone); this rank's plan alone (collectives.same_count_on_every_rank
    pads it so that every rank runs the same number of forwards). Given `score_from` and a `model` that shares prefixes
    (the forwards pass share_prefixes=True), a sample costs only what its micro-batch does not hold yet: past its
    longest common prefix with a sample already there (a vision model: past its first score_from tokens, when the one
    before it starts with the same ones). image_tokens: per sample, the tokens its image placeholders add when
    expanded, in all and within its first score_from tokens (a vision model's)."""
    share = model is not None and score_from is not None and shares_prefixes(model)
    tree = share and not vision.is_vision_model(model.config)
    micro, current, members, used = [], [], [], 0
    for k, (i, s) in enumerate(zip(index, sequences)):
        added, added_in_prefix = image_tokens[k] if image_tokens else (0, 0)
        n = len(s) + added
        first = score_from[k] if share else 0
        if tree and current:
            n -= max(_shared_length(sequences[m], s) for m in members)
        elif share and current and score_from[k - 1] == first and sequences[k - 1][:first] == s[:first]:
            n -= first + added_in_prefix
        if current and used + n > max_tokens:
            micro.append(current)
            current, members, used, n = [], [], 0, len(s) + added
        current.append(i)
        members.append(k)
        used += n
    if current:
        micro.append(current)
    return micro


def _shared_length(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists (by halving: each test is one list comparison)."""
    same, differ = 0, min(len(a), len(b)) + 1  # a[:same] == b[:same]; a[:differ] != b[:differ] (or past the end)
    while differ - same > 1:
        middle = (same + differ) // 2
        if a[:middle] == b[:middle]:
            same = middle
        else:
            differ = middle
    return same


def _checked(sequences: list[list[int]], score_from: list[int] | None, caller: str) -> list[int]:
    """score_from, defaulted to 1 per sequence, after checking it and the sequences."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError(f"{caller} needs at least one sequence and no empty ones")
    score_from = [1] * len(sequences) if score_from is None else score_from
    if len(score_from) != len(sequences) or any(not 1 <= f <= len(s) for f, s in zip(score_from, sequences)):
        raise ValueError(f"score_from needs one position per sequence, each in [1, its length]; got {score_from} for "
                         f"lengths {[len(s) for s in sequences]}")
    return score_from


def _layout(sequences: list[list[int]], score_from: list[int], share: bool, prefix_keys: list | None = None):
    """The packed row of `sequences`: token ids, position ids, and for every scored token (position >= its
    score_from) the row index of the hidden state that predicts it and its index in the concatenated sequences; and
    the pieces laid out, (sequence, its first token in the row) each. With `share` the row is a prefix tree: the
    sequences in sorted order (the tree's pre-order), each laid out only from where it leaves the one before it (its
    longest common prefix with any earlier one), positions continuing from there (what packed_sdpa attends as a
    branch); every distinct prefix runs once. With `prefix_keys` (a vision model's: digests of each sequence's images
    before score_from) a sequence shares only its whole first score_from tokens, with one whose first tokens and keys
    are the same."""
    ids, positions, source, dest, pieces = [], [], [], [], []
    offsets = list(itertools.accumulate((len(s) for s in sequences), initial=0))
    order = range(len(sequences))
    if share:
        order = sorted(order, key=lambda i: sequences[i] if prefix_keys is None
                       else (sequences[i][:score_from[i]], prefix_keys[i]))
    path, before = [], None  # row index of each token of the previous sequence; that sequence
    for i in order:
        s, first = sequences[i], score_from[i]
        begin = 0
        if share and before is not None and prefix_keys is None:
            begin = _shared_length(sequences[before], s)
        elif share and before is not None and (s[:first], prefix_keys[i]) == (
                sequences[before][:score_from[before]], prefix_keys[before]):
            begin = first
        path = path[:begin] + list(range(len(ids), len(ids) + len(s) - begin))
        pieces.append((i, begin))
        ids += s[begin:]
        positions += range(begin, len(s))
        for j in range(first, len(s)):  # token j is predicted by the hidden state of token j - 1
            source.append(path[j - 1])
            dest.append(offsets[i] + j)
        before = i
    return ids, positions, source, dest, pieces


@dataclass
class PackedRow:
    """One packed forward's inputs, on the model's device, and where its scored outputs go."""

    ids: torch.Tensor  # [1, L]
    positions: torch.Tensor  # [1, L] text positions; a vision model's [4, 1, L]: text, then mrope's t, h, w
    source: torch.Tensor  # row index of the hidden state that predicts each scored token
    dest: torch.Tensor  # that token's index in the concatenated sequences given (unexpanded)
    targets: torch.Tensor  # that token's id
    mask: object  # the attention mask to pass: None, or flex_attention's block mask for a row with branches
    attention_options: dict  # extra keyword arguments for the attention function (flex_attention's kernel options)
    vision_inputs: dict  # pixel_values and image_grid_thw, in the order their placeholders occur in the row
    spread: sequence_parallel.Spread | None  # the row's split over a sequence-parallel group, None without one


# Compiled, a forward-only flex_attention with fewer than 128 query tokens runs inductor's flex_decoding kernel, whose
# logprobs disagree with eager ones (bench/RESULTS.md, update_mfu.py). A checkpointed layer's forward is forward-only,
# and short rows occur (tests, small micro-batches): always the main kernel.
_FLEX_KERNEL_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True}


def _packed_row(model, sequences: list[list[int]], score_from: list[int], share_prefixes: bool,
                images: list[list] | None = None) -> PackedRow:
    """`_layout` of the sequences, and for a vision model its images: each placeholder expanded to its image's tokens,
    mrope positions of each whole sequence (a branch takes its own part of them), the pixels of each piece's images
    (a branch never repeats the images of the prompt it shares), and a blank image sequence, never scored, when there
    are none (FSDP2: every forward on every rank runs the vision tower). Tokens whose target is a banned placeholder
    are not scored."""
    share = share_prefixes and shares_prefixes(model)
    config, device = model.config, next(model.parameters()).device
    given = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    vision_inputs, prefix_keys, multimodal = {}, None, vision.is_vision_model(config)
    if multimodal:
        batch = vision.expand_batch(config, sequences, images, score_from)
        sequences, score_from, prefix_keys = batch.sequences, batch.score_from, batch.prefix_keys
    ids, positions, source, dest, pieces = _layout(sequences, score_from, share, prefix_keys)
    branched = len(ids) < sum(map(len, sequences))  # some sequence was laid out from its score_from on
    source, dest = torch.tensor(source, dtype=torch.long), torch.tensor(dest, dtype=torch.long)
    positions, mask = torch.tensor(positions, dtype=torch.long)[None], None
    if multimodal:
        mrope, vision_inputs = vision.row_inputs(model, batch, pieces, device)
        positions = torch.cat([positions, mrope])[:, None]  # [4, 1, L]
        targets = torch.tensor([t for s in sequences for t in s], dtype=torch.long)[dest]
        keep = ~torch.isin(targets, torch.tensor(vision.banned_token_ids(config)))
        source, dest = source[keep], batch.given_index()[dest[keep]]
    group, spread = sequence_parallel.of(model), None
    if group is not None:  # the pad is one more sequence, never scored
        pad = sequence_parallel.pad_length(len(ids), group.size)
        ids += [0] * pad
        positions = torch.cat([positions, torch.arange(pad).expand(*positions.shape[:-1], pad)], -1)
        spread = sequence_parallel.Spread(group, len(ids), (positions[0] if multimodal else positions).to(device))
    flex = vision.text_attention(config) == "flex_attention"
    if flex and not multimodal and (branched or spread is not None):  # sequence-parallel: a local row's positions
        mask = branch_block_mask(positions[0].to(device))               # cannot say where the whole row's start
    options = {"kernel_options": _FLEX_KERNEL_OPTIONS} if flex else {}
    return PackedRow(torch.tensor(ids, dtype=torch.long, device=device)[None], positions.to(device),
                     source.to(device), dest.to(device), given[dest].to(device), mask, options, vision_inputs, spread)


def packed_logprobs(model, sequences: list[list[int]], temperature: float = 1.0, chunk_size: int = 512,
                    with_entropy: bool = False, score_from: list[int] | None = None, share_prefixes: bool = False,
                    images: list[list] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs (and entropies) of `sequences` in one packed forward: ids concatenated into one row,
    position ids restarting per sequence, no padding. Flat fp32 outputs aligned with the concatenated ids: entry j is
    log p(ids[j] | earlier ids of its sequence) under softmax(logits / temperature), and 0 at each sequence's first
    token. `score_from[i]` (default 1) is the first position of sequence i that is scored, e.g. its prompt length:
    earlier positions are 0 too, and the output layer never runs on them (RL scores completions only, and the head is
    a large share of the work at vocab 152k). share_prefixes: the row is a prefix tree (`_layout`): tokens that
    sequences start with alike (a GRPO group's prompt, a session's history) run once, where the model can
    (`shares_prefixes`); the outputs are the same. The model's output layer is swapped for a chunked chosen-token
    computation for this one call, so the [tokens, vocab] logits never exist, and FSDP2's root hooks still gather the
    head's weight as usual.
    A vision model: `images[i]` are sequence i's images (PNG bytes or PIL), one per `<|image_pad|>` in its ids, in
    order; its image and video placeholders are out of the distribution (as the engines sample) and their own
    positions are 0."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    score_from = _checked(sequences, score_from, "packed_logprobs")
    row = _packed_row(model, sequences, score_from, share_prefixes, images)
    banned = torch.tensor(vision.banned_token_ids(model.config), dtype=torch.long, device=row.ids.device)
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}: an output layer with a bias is not supported")

    def chosen_token_head(hidden):
        if row.spread is None:
            return _ChunkedChosenLogprobs.apply(hidden[0, row.source], head.weight, row.targets, temperature,
                                                chunk_size, with_entropy, banned)
        # sequence-parallel: this rank scores the tokens its rows predict, then every rank gets every score
        owner, first = row.source // row.spread.local, row.spread.group.rank * row.spread.local
        mine = owner == row.spread.group.rank
        out = _ChunkedChosenLogprobs.apply(hidden[0, row.source[mine] - first], head.weight, row.targets[mine],
                                           temperature, chunk_size, with_entropy, banned)
        return sequence_parallel.gather_scored(out, owner, row.spread)

    head.forward = chosen_token_head
    try:  # use_cache=False matters: with a cache, transformers skips the per-sequence (block-diagonal) mask
        with sequence_parallel.local_inputs(model, row.spread):
            out = model(input_ids=row.ids, position_ids=row.positions, attention_mask=row.mask, use_cache=False,
                        **row.attention_options, **row.vision_inputs, **_spread_keyword(row)).logits
    finally:
        del head.forward
    zeros = out.new_zeros(sum(map(len, sequences)))
    return (zeros.index_copy(0, row.dest, out[:, 0]),
            zeros.index_copy(0, row.dest, out[:, 1]) if with_entropy else None)


def packed_values(value_model, sequences: list[list[int]], score_from: list[int] | None = None,
                  share_prefixes: bool = False) -> torch.Tensor:
    """Per-token values of `sequences` in one packed forward (as packed_logprobs: concatenated ids, positions restarting
    per sequence), flat fp32 aligned like packed_logprobs: entry j is the value of the state before token j, i.e. the
    head on the hidden state that predicts token j, and 0 at each sequence's first token. score_from and
    share_prefixes as in packed_logprobs: positions before score_from[i] are 0, equal prefixes run once."""
    score_from = _checked(sequences, score_from, "packed_values")
    row = _packed_row(value_model, sequences, score_from, share_prefixes)
    with warnings.catch_warnings():  # FSDP2 warns that the head's output is a view; it is only read out of place here
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        with sequence_parallel.local_inputs(value_model, row.spread):
            out = value_model(input_ids=row.ids, position_ids=row.positions, attention_mask=row.mask,
                              use_cache=False, **row.attention_options, **_spread_keyword(row)).logits[0, :, 0].float()
    if row.spread is not None:
        out = sequence_parallel.gather_rows(out, row.spread)
    return out.new_zeros(sum(map(len, sequences))).index_copy(0, row.dest, out[row.source])


def _spread_keyword(row: PackedRow) -> dict:
    """What tells the attentions to run sequence-parallel (`sequence_parallel.ulysses`): nothing without a group."""
    return {} if row.spread is None else {"sequence_parallel": row.spread}


# Completions: the trainers' view of the packed forwards. A sample is anything with `prompt_ids` and `completion_ids`
# (rollout.Sample); per-token results are [B, T] rows over its completion tokens, zero-padded.

# What an idle micro-batch runs (a rank with fewer than another): FSDP's collectives must stay in step across ranks.
_IDLE = [SimpleNamespace(prompt_ids=[0], completion_ids=[0], images=[])]


def completion_micro_batches(model, samples: list, index: list[int], max_tokens: int) -> list[list[int]]:
    """`pack` of the samples `index`, each distinct prefix counted once per micro-batch where `model` shares
    prefixes; the same number of micro-batches on every rank."""
    chosen = [samples[i] for i in index]
    images = _images(model, chosen)
    return collectives.same_count_on_every_rank(pack(
        index, [s.prompt_ids + s.completion_ids for s in chosen], max_tokens, [len(s.prompt_ids) for s in chosen],
        model, images and [vision.added_tokens(model.config, s.prompt_ids, i) for s, i in zip(chosen, images)]))


def _images(model, samples: list) -> list[list] | None:
    """Each sample's images (`Sample.images`, one per placeholder in its ids, in order) for a vision model, else
    None."""
    if not vision.is_vision_model(model.config):
        return None
    return [list(s.images) for s in samples]



def completion_logprobs(model, samples: list, temperature: float = 1.0, chunk_size: int = 512,
                        with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] logprobs (and entropies) of each sample's completion tokens given its prompt: one packed forward from
    the completions' first tokens on, each distinct prefix run once where the model can share it. A vision model
    gets each sample's `images`. No samples (an idle micro-batch): one masked-out token is run and [1, 1]
    returned."""
    samples = samples or _IDLE
    logprobs, entropy = packed_logprobs(model, [s.prompt_ids + s.completion_ids for s in samples],
                                        temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
                                        score_from=[len(s.prompt_ids) for s in samples], share_prefixes=True,
                                        images=_images(model, samples))
    return _completion_rows(logprobs, samples), _completion_rows(entropy, samples) if with_entropy else None


def completion_values(value_model, samples: list) -> torch.Tensor:
    """[B, T] values of each sample's completion tokens (V of the state before each), as completion_logprobs."""
    samples = samples or _IDLE
    values = packed_values(value_model, [s.prompt_ids + s.completion_ids for s in samples],
                           score_from=[len(s.prompt_ids) for s in samples], share_prefixes=True)
    return _completion_rows(values, samples)


@torch.no_grad()
def completion_logprobs_no_grad(model, samples: list, max_tokens: int, temperature: float = 1.0,
                                chunk_size: int = 512) -> torch.Tensor:
    """completion_logprobs of all `samples` without grad, in micro-batches of `max_tokens`: [B, T] fp32 on the CPU,
    whole-batch rows for `rows_of`. Collective."""
    rows = []
    for micro in completion_micro_batches(model, samples, list(range(len(samples))), max_tokens):
        logprobs, _ = completion_logprobs(model, [samples[i] for i in micro], temperature, chunk_size)
        rows += list(logprobs.float().cpu()) if micro else []
    return padded(rows)


@torch.no_grad()
def completion_values_no_grad(value_model, samples: list, max_tokens: int) -> torch.Tensor:
    """completion_values of all `samples` without grad, as completion_logprobs_no_grad. Collective."""
    rows = []
    for micro in completion_micro_batches(value_model, samples, list(range(len(samples))), max_tokens):
        values = completion_values(value_model, [samples[i] for i in micro])
        rows += list(values.float().cpu()) if micro else []
    return padded(rows)


def padded(rows: list) -> torch.Tensor:
    """Ragged per-token rows (lists or 1-d tensors) as one [B, T] fp32 tensor, zero-padded; [0, 0] for none."""
    if not rows:
        return torch.zeros(0, 0)
    return pad_sequence([torch.as_tensor(r, dtype=torch.float32) for r in rows], batch_first=True)


def rows_of(batch: torch.Tensor, micro: list[int], like: torch.Tensor) -> torch.Tensor:
    """Rows `micro` of a whole-batch [B, T] tensor, cut to the width of `like` (the micro-batch's completion tensor)
    and moved to its device; zeros (masked out) for an idle micro-batch."""
    if not micro:
        return torch.zeros(like.shape, device=like.device)
    return batch[micro][:, : like.shape[1]].to(like.device)


def _completion_rows(flat: torch.Tensor, samples: list) -> torch.Tensor:
    """The completion positions of a flat packed output (aligned with the samples' concatenated ids), one row each."""
    rows, start = [], 0
    for s in samples:
        rows.append(flat[start + len(s.prompt_ids) : start + len(s.prompt_ids) + len(s.completion_ids)])
        start += len(s.prompt_ids) + len(s.completion_ids)
    return pad_sequence(rows, batch_first=True)


def clip_grad_norm(model, max_norm: float) -> float:
    """Clips gradients to a total norm of `max_norm`; returns the norm before clipping (global under FSDP2)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()


def step_if_finite(optimizer, grad_norm: float, family: str) -> dict:
    """optimizer.step() unless the (global, so every rank agrees) gradient norm is inf or NaN: that step would write
    NaN into every weight, so it is skipped and counted. Returns {family/grad_norm, family/skipped_step}."""
    finite = math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    elif collectives.rank() == 0:
        print(f"warning: {family} gradient norm is {grad_norm}: optimizer step skipped", flush=True)
    return {f"{family}/grad_norm": grad_norm, f"{family}/skipped_step": float(not finite)}


def _hf_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


@torch.no_grad()  # a decorator, not a `with`: on a generator it never leaks no-grad into the caller's code
def iter_full_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) for every parameter, one FSDP unit at a time: each decoder layer is gathered,
    yielded and resharded before the next, the root's own parameters (embeddings, norm, lm_head) come last. A tied
    lm_head is not repeated (HF checkpoints omit it too). Under FSDP2 the tensors are fresh copies in the compute
    dtype (bf16 with mixed precision); every rank must iterate, in step, and every rank receives everything."""
    units = sorted((m for m in model.modules() if isinstance(m, FSDPModule)), key=lambda m: m is model)
    if not units:
        for name, param in model.named_parameters():
            yield _hf_name(name), param.detach()
        return
    prefix = {module: name for name, module in model.named_modules()}
    done = set()
    for unit in units:
        unit.unshard()
        for name, param in unit.named_parameters(prefix=prefix[unit]):
            if not isinstance(param, DTensor) and name not in done:  # DTensor: another unit's, still sharded
                done.add(name)
                yield _hf_name(name), param.detach().clone()
        unit.reshard()
