"""Ulysses sequence parallelism for the update (`--sequence-parallel N`): one long packed row spread over N
consecutive ranks, each holding 1/N of its tokens through embeddings, norms, MLPs and the output layer. Attention
needs every token, so around it one all-to-all trades the token split for a split of the heads (each rank attends
the whole row with H/N heads) and a second trades it back (DeepSpeed-Ulysses, arXiv 2309.14509; verl's
`ulysses_sequence_parallel_size`). The per-token outputs are then gathered, so every rank of a group computes the
same loss; the gather's backward sums the ranks' gradients, each rank keeps its own tokens' share, and FSDP's
average over all ranks puts them together.

policy.py calls this module: `ulysses` wraps its attentions, `Spread` cuts its packed rows. Parameters stay sharded
over every rank (FSDP2); the ranks of one group hold the same samples (`group_samples`).
"""

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoConfig

import collectives


ATTENTIONS = ("packed_sdpa", "flex_attention")  # the attentions `ulysses` wraps (policy.py registers them)


@dataclass(frozen=True)
class Group:
    """This rank's sequence-parallel group: `size` consecutive ranks, this one the `rank`-th of them."""

    size: int
    rank: int
    process_group: object  # torch.distributed ProcessGroup, None for size 1


def check_heads(config, size: int, model: str | None = None) -> None:
    """Refuse a group size the model's attention heads cannot be split over: each rank attends with H/N query heads,
    so N must divide them; and each needs the key/value heads of its query heads, so N must divide the key/value
    heads or be a multiple of them (then each is repeated). A vision-language model's language model decides.
    `model` names the model in the message (default: its type)."""
    if size < 1:
        raise ValueError(f"--sequence-parallel {size}: must be at least 1")
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    allowed = [n for n in range(1, heads + 1) if not heads % n and not (kv_heads % n and n % kv_heads)]
    if size not in allowed:
        raise ValueError(f"--sequence-parallel {size}: {model or getattr(config, 'model_type', 'the model')} has "
                         f"{heads} attention heads and {kv_heads} key/value heads; N must divide the attention heads "
                         f"and divide the key/value heads or be a multiple of them: one of "
                         f"{', '.join(map(str, allowed))}")


def check_model(path: str | None, size: int, attention: str) -> None:
    """`check_heads` of the model folder at `path` (nothing for None or a size of 1), and refuse an attention that
    `ulysses` does not wrap; before anything loads."""
    if path is None or size == 1:
        return
    if attention not in ATTENTIONS:
        raise ValueError(f"--sequence-parallel {size}: needs --attn-implementation {' or '.join(ATTENTIONS)}, not "
                         f"{attention}")
    check_heads(AutoConfig.from_pretrained(path, local_files_only=True), size, path)


def check_world(size: int, world: int) -> None:
    """Refuse a group size that does not divide the ranks."""
    if size > 1 and world % size:
        raise ValueError(f"--sequence-parallel {size}: must divide the number of ranks ({world})")


@functools.cache  # one set of process groups for all the models of a run
def make_group(size: int) -> Group:
    """This rank's group of `size` consecutive ranks, from a (data, sequence) device mesh over the world. Collective
    (every rank builds every group)."""
    world = collectives.world_size()
    check_world(size, world)
    if size == 1:
        return Group(1, 0, None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (world // size, size), mesh_dim_names=("data", "sequence"))
    return Group(size, mesh["sequence"].get_local_rank(), mesh["sequence"].get_group())


def attach(model, group: Group):
    """Mark `model` as run sequence-parallel over `group` (policy.py's packed forwards read it); returns it. Refuses a
    model whose heads the group cannot split, or whose attention is not one that `ulysses` wraps (the others would
    attend within each rank's tokens)."""
    if group.size > 1:
        check_heads(model.config, group.size)
        attention = getattr(model.config.get_text_config(), "_attn_implementation", None)
        if attention not in ATTENTIONS:
            raise ValueError(f"--sequence-parallel {group.size}: needs --attn-implementation "
                             f"{' or '.join(ATTENTIONS)}, not {attention}")
    model.sequence_parallel = group
    return model


def of(model) -> Group | None:
    """The group `model` runs sequence-parallel over, None when it runs alone."""
    group = getattr(model, "sequence_parallel", None)
    return group if group is not None and group.size > 1 else None


@dataclass
class Spread:
    """One packed row's split over a group: the row right-padded to a multiple of the group's size (the pad is one
    more sequence, positions 0, 1, ..., never scored), and rank r's tokens are rows [r * local, (r + 1) * local).
    Passed to the attention as the `sequence_parallel` keyword: it needs the whole row's text positions."""

    group: Group
    length: int  # the padded row's tokens
    positions: torch.Tensor  # [1, length] text positions of the whole padded row

    @property
    def local(self) -> int:
        return self.length // self.group.size

    def mine(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """This rank's slice of a whole-row tensor along `dim`."""
        return x.narrow(dim, self.group.rank * self.local, self.local)


def pad_length(length: int, size: int) -> int:
    """Tokens to add to a row of `length` so that `size` ranks hold equal shares."""
    return -length % size


class _Exchange(torch.autograd.Function):
    """all_to_all_single over a group, equal chunks along dim 0: rank i's chunk j goes to rank j as its chunk i. The
    exchange is its own adjoint, so the backward is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, x = group, x.contiguous()  # (empty_like would copy a view's strides: the exchange writes rows)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _Gather(torch.autograd.Function):
    """Every rank's x (equal shapes) concatenated along dim 0, in rank order. Each rank goes on to compute the same
    loss from the result, so the total objective sums over ranks: the backward sums the group's gradients and keeps
    this rank's part."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rows, x = group, len(x), x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(0, dist.get_rank(ctx.group) * ctx.rows, ctx.rows), None


def gather_rows(x: torch.Tensor, spread: Spread) -> torch.Tensor:
    """The whole row of a per-token tensor whose dim 0 is this rank's `spread.local` tokens; differentiable (`_Gather`:
    every rank computes the same loss from the gathered row)."""
    return _Gather.apply(x, spread.group.process_group)


def gather_scored(out: torch.Tensor, owner: torch.Tensor, spread: Spread) -> torch.Tensor:
    """The outputs of every scored token, in order, where each rank computed `out` for the scored tokens whose
    predicting row it holds (`owner == its rank`, in order); differentiable as `gather_rows`."""
    counts = torch.bincount(owner, minlength=spread.group.size).tolist()
    padded = torch.nn.functional.pad(out, (0, 0) * (out.dim() - 1) + (0, max(counts) - len(out)))
    parts = _Gather.apply(padded, spread.group.process_group).split(max(counts))
    whole = torch.cat([p[:n] for p, n in zip(parts, counts)])  # the scored tokens grouped by owner, in order
    return whole[torch.argsort(torch.argsort(owner, stable=True))]


@torch.compiler.disable  # collectives: under --compile-layers the layer's graph breaks here, around the exchange
def _seq_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[1, H, local, d] (all heads, this rank's tokens) -> [1, H/N, N * local, d] (its heads, every token)."""
    _, heads, local, dim = x.shape
    n = group.size
    received = _Exchange.apply(x.reshape(n, heads // n, local, dim), group.process_group)
    return received.transpose(0, 1).reshape(1, heads // n, n * local, dim)


@torch.compiler.disable
def _heads_to_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[1, N * local, H/N, d] (attention's output layout: every token, this rank's heads) -> [1, local, H, d]."""
    _, length, heads, dim = x.shape
    n = group.size
    received = _Exchange.apply(x.reshape(n, length // n, heads, dim), group.process_group)
    return received.transpose(0, 1).reshape(1, length // n, n * heads, dim)


def ulysses(attention):
    """`attention` (a transformers attention function: module, q, k, v [1, heads, tokens, d], mask, ...) that, given
    the keyword `sequence_parallel` (a `Spread`), attends the whole row with this rank's share of the heads: key/value
    heads repeated first when there are fewer than ranks, then all-to-all, `attention` with the whole row's positions,
    all-to-all back. Without the keyword it is `attention` itself."""

    def attend(module, query, key, value, attention_mask, *args, sequence_parallel: Spread | None = None,
               **kwargs):
        if sequence_parallel is None:
            return attention(module, query, key, value, attention_mask, *args, **kwargs)
        group = sequence_parallel.group
        if key.shape[1] < group.size:  # check_heads: then the ranks are a multiple of the key/value heads
            key, value = (x.repeat_interleave(group.size // key.shape[1], dim=1) for x in (key, value))
        kwargs["position_ids"] = sequence_parallel.positions
        out, weights = attention(module, *(_seq_to_heads(x, group) for x in (query, key, value)), attention_mask,
                                 *args, **kwargs)
        return _heads_to_seq(out, group), weights

    attend.__wrapped__ = attention
    return attend


def group_samples(items: list, group: Group | None) -> tuple[list, slice]:
    """The items of every rank of `group`, concatenated in rank order (each rank of a group then runs the same
    micro-batches), and where this rank's are among them; `items` alone without a group. Collective over the group."""
    if group is None or group.size == 1:
        return list(items), slice(0, len(items))
    parts = [None] * group.size
    dist.all_gather_object(parts, list(items), group=group.process_group)
    before = sum(len(p) for p in parts[: group.rank])
    return [item for part in parts for item in part], slice(before, before + len(items))


@contextlib.contextmanager
def local_inputs(model, spread: Spread | None):
    """While a forward of `model` runs inside: its decoder stack gets this rank's slice of the whole row's embeddings
    (or ids) and positions. Cut at the decoder, so that a vision model merges its images into the whole row first."""
    if spread is None:
        yield
        return

    def cut(module, args, kwargs):
        for name, dim in (("input_ids", 1), ("inputs_embeds", 1), ("position_ids", -1)):
            if kwargs.get(name) is not None:
                kwargs[name] = spread.mine(kwargs[name], dim)
        if args and args[0] is not None:  # input_ids given positionally (transformers' token-classification models)
            args = (spread.mine(args[0], 1), *args[1:])
        return args, kwargs

    handle = model.get_decoder().register_forward_pre_hook(cut, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
