"""The all-to-all of expert parallelism, as an autograd function that is its own conjugate:
rows sent to rank j in forward come back from rank j as gradients in backward, so backward is
the same exchange with the split sizes swapped. Splits are uneven (routing decides them).
"""

from __future__ import annotations

import torch

from threefold.distributed import comm
from threefold.distributed.comm import Group


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: Group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    return comm.all_to_all(out, x, group, out_splits=recv, in_splits=send)  # timed as ep_a2a


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Group) -> torch.Tensor:
    """Rows [sum(send[:j]), sum(send[:j+1])) of `x` go to rank j; rank i's rows for us arrive
    as block i of the result (recv[i] rows)."""
    return x if group.size == 1 else _AllToAll.apply(x, send, recv, group)


def exchange_counts(counts: torch.Tensor, group: Group) -> torch.Tensor:
    """counts [ranks, k]: row j is what we send to rank j -> [ranks, k]: row i is what rank i
    sends us. One small all-to-all that tells every rank the split sizes of the big one."""
    return comm.all_to_all(torch.empty_like(counts), counts.contiguous(), group)
