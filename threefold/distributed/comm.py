"""Small named collectives used by the training loop; each says which group it talks to."""
from __future__ import annotations

import torch
import torch.distributed as dist

from threefold.distributed.grid import Group


def all_reduce_sum(values: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum a small tensor of scalars (loss, token counts) over `group`, in place."""
    if group.size > 1:
        dist.all_reduce(values, group=group.pg)
    return values


def all_reduce_max(values: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group.pg)
    return values
