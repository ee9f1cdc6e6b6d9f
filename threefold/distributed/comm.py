"""Small named collectives used by the training loop; each says which group it talks to."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from threefold.distributed.grid import Group


def all_reduce_gradients(grads: list[torch.Tensor], group: Group) -> None:
    """Sum gradients over `group` with one flat all-reduce (the loss is already scaled by
    1/global tokens, so the sum is the global mean). The bucketed, overlapped version that
    hides this behind backward lives in data_parallel."""
    if group.size == 1 or not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group.pg)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def all_reduce_sum(values: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum a small tensor of scalars (loss, token counts) over `group`, in place."""
    if group.size > 1:
        dist.all_reduce(values, group=group.pg)
    return values


def all_reduce_max(values: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group.pg)
    return values
