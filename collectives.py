"""Collectives over the training ranks: sums, means, gathers, the "is any rank still busy" flag, global mean/var.

Every function here is a collective under torchrun: all ranks call it, in the same order, or the job hangs. One rule
without a process group (a notebook, a plain `python` script, a model loaded without `policy.init_distributed`): the
world is this process alone, and each function returns what a single rank would.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def rank() -> int:
    """This process's rank; 0 without a process group."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks; 1 without a process group."""
    return dist.get_world_size() if dist.is_initialized() else 1


def sum_over_ranks(value: float) -> float:
    """`value` summed over every rank (in float64)."""
    if world_size() == 1:
        return float(value)
    x = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(x)
    return x.item()


def sum_tensor_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """A CPU tensor summed over every rank (a new tensor)."""
    x = x.clone()
    if world_size() > 1:
        dist.all_reduce(x)
    return x


def same_count_on_every_rank(micro_batches: list[list]) -> list[list]:
    """`micro_batches` padded with empty ones to the largest count over ranks: FSDP's forwards and backwards are
    collectives, so every rank runs as many as the busiest (an empty one runs a dummy forward, policy.py)."""
    if world_size() == 1:
        return micro_batches
    count = torch.tensor(len(micro_batches))
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return micro_batches + [[] for _ in range(int(count) - len(micro_batches))]


def any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank: how ranks that must make the same number of engine calls (FSDP weight
    streaming, a TP-sharded vLLM engine) agree that one of them is still busy."""
    return any_ranks(flag)[0]


def any_ranks(*flags: bool, group=None) -> list[bool]:
    """`any_rank` of several flags in one collective, over the ranks of `group` (a process group) if given."""
    x = torch.tensor([float(bool(f)) for f in flags])
    if world_size() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return [v > 0 for v in x.tolist()]


def sum_dicts_over_ranks(stats: dict) -> dict:
    """Key-wise sum over ranks; one collective whatever keys each rank has."""
    total = {}
    for part in gather_objects([dict(stats)]):
        for k, v in part.items():
            total[k] = total.get(k, 0.0) + v
    return total


def mean_dicts_over_ranks(stats: dict) -> dict:
    """Key-wise mean over ranks (every rank holds the same keys); one collective."""
    return {k: v / world_size() for k, v in sum_dicts_over_ranks(stats).items()}


def gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` (same shape on each), concatenated in rank order along dim 0."""
    if world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(parts, x)
    return torch.cat(parts)


def gather_objects(items: list) -> list:
    """Every rank's list of picklable items, concatenated in rank order."""
    if world_size() == 1:
        return list(items)
    parts = [None] * world_size()
    dist.all_gather_object(parts, items)
    return [item for part in parts for item in part]


def global_mean_var(x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased variance of x's masked-in entries over every rank's batch (two collectives: the mean first,
    then squared deviations from it, which stays exact where sum-of-squares would cancel)."""
    on = mask.bool()
    moments = torch.stack([on.sum().double(), torch.where(on, x, 0).double().sum()])
    if world_size() > 1:
        dist.all_reduce(moments)
    mean = (moments[1] / moments[0].clamp(min=1)).item()
    square = torch.where(on, x.double() - mean, 0).pow(2).sum()
    if world_size() > 1:
        dist.all_reduce(square)
    return mean, (square / (moments[0] - 1).clamp(min=1)).item()
