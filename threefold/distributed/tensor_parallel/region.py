"""Entering the tensor-parallel region, and the backward of the layers that read from it.

The column-parallel projections that read one input (wq/wk/wv, w1/w3, the head) share one
entry: forward identity (all-gather over the sequence under SP); backward the all-reduce of
the input gradient (reduce-scatter under SP). A `Region` is that one entry of one forward.

Overlap (parallel.tp_comm_overlap): the projections' backward computes the input gradient dX
only and leaves its weight gradient dW = dY^T X with the region; the entry's backward, which
autograd runs once every projection has added its dX, starts the collective on dX, computes
the deferred dW matmuls while it is in flight, then waits (picotron's and Megatron-Core's
asynchronous input-gradient all-reduce). The entry takes the projections' weights as inputs,
so the dW it returns reaches them through autograd as usual (gradient hooks, bucketing).

Under SP each projection saves only the input's sequence shard (s/tp rows) instead of the
gathered input, and backward gathers it once more for the dW matmuls (Korthikanti et al.
2022, sec. 4.2.2: one extra all-gather in backward instead of s rows kept per layer; counted
in distributed/tp_collectives.py). With overlap that all-gather starts in the first
projection's backward, before its dX matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from threefold.distributed import comm
from threefold.distributed.comm import Group, all_gather_dim0


class Region:
    """One entry into the TP region: its group, and (under SP) the input shard's gathered copy
    and (with overlap) the weight-gradient matmuls deferred to the entry's backward. Holds no
    tensor of its own between forward and backward: the shard is saved through autograd (and so
    through activation checkpointing), the only way it stays alive."""

    def __init__(self, group: Group, sp: bool, overlap: bool, weights: tuple[torch.Tensor, ...]):
        self.group, self.sp, self.overlap, self.weights = group, sp, overlap, weights
        self.users = 0  # projections whose backward has not run yet (SP: when the gathered copy can go)
        self.full = self._gather = None
        self.deferred: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    def defers(self, weight: torch.Tensor) -> bool:
        return self.overlap and any(w is weight for w in self.weights)

    def start_gather(self, shard: torch.Tensor) -> None:
        """Under SP: start gathering the input for the dW matmuls (once per region)."""
        if self.full is None:
            self.full = torch.empty(
                (shard.shape[0] * self.group.size, *shard.shape[1:]), dtype=shard.dtype, device=shard.device
            )
            self._gather = comm.all_gather_into(self.full, shard.contiguous(), self.group, async_op=True)

    def wait_gather(self) -> torch.Tensor:
        if self._gather is not None:
            comm.wait(self._gather, self.group)
            self._gather = None
        return self.full

    def gathered(self, shard: torch.Tensor) -> torch.Tensor:
        self.start_gather(shard)
        return self.wait_gather()

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.full = None

    def weight_grads(self) -> list[torch.Tensor | None]:
        """Run the deferred dW matmuls; one gradient (or None) per weight of `self.weights`."""
        out: list[torch.Tensor | None] = [None] * len(self.weights)
        for weight, grad, inp in self.deferred:
            x = (self.full if inp is None else inp).flatten(0, -2).to(grad.dtype)
            g = grad.t().matmul(x).to(weight.dtype)
            i = next(i for i, w in enumerate(self.weights) if w is weight)
            out[i] = g if out[i] is None else out[i] + g
        self.deferred.clear()
        self.full = None
        return out


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, region: Region, *weights):
        ctx.region = region
        return all_gather_dim0(x, region.group) if region.sp else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        region, group = ctx.region, ctx.region.group
        grad = grad.contiguous()
        if region.sp:
            out = grad.new_empty((grad.shape[0] // group.size, *grad.shape[1:]))
            work = comm.reduce_scatter_into(out, grad, group, async_op=True)
        else:
            # Out of place: the engine may hand the same gradient buffer to another branch.
            out = grad.clone()
            work = comm.all_reduce(out, group, async_op=True)
        if region.deferred and region.sp:
            region.wait_gather()  # started in the first projection's backward
        weight_grads = region.weight_grads()  # while the collective is in flight
        comm.wait(work, group)
        return (out, None, *weight_grads)


def enter(
    x: torch.Tensor, group: Group, sp: bool, overlap: bool = False, weights: tuple[torch.Tensor, ...] = ()
) -> torch.Tensor:
    """The input of column-parallel layers entering the region (identity or all-gather forward;
    all-reduce or reduce-scatter of its gradient backward). `weights`: the projections that read
    it, whose dW may be deferred to run during that collective (`overlap`). The entered tensor
    carries its Region, for those projections' column_linear."""
    if group.size == 1:
        return x
    overlap = overlap and torch.is_grad_enabled()
    weights = tuple(weights) if overlap else ()
    region = Region(group, sp, overlap, weights)
    full = _Enter.apply(x, region, *weights)
    # Lives as long as `full`, which nothing saves: only the forward of the consumers sees it.
    full._tp_region = (x.detach() if sp else None, region)
    return full


class _ColumnLinear(torch.autograd.Function):
    """F.linear on an entered input: saves the input's shard under SP (the gathered input
    otherwise), and with overlap leaves the dW matmul to the region's entry."""

    @staticmethod
    def forward(ctx, x, shard, weight, bias, region: Region):
        region.users += 1
        ctx.region, ctx.has_bias = region, bias is not None
        ctx.save_for_backward(x if shard is None else shard, weight)
        return F.linear(x, weight, bias)  # under autocast: in the autocast dtype

    @staticmethod
    def backward(ctx, grad):
        saved, weight = ctx.saved_tensors
        region = ctx.region
        g2 = grad.flatten(0, -2)
        grad_bias = g2.sum(0).to(weight.dtype) if ctx.has_bias else None
        defer = ctx.needs_input_grad[2] and region.defers(weight)
        if defer and region.sp:
            region.start_gather(saved)  # overlaps the dX matmul below
        grad_x = grad.matmul(weight.to(grad.dtype))
        grad_weight = None
        if defer:
            region.deferred.append((weight, g2, None if region.sp else saved))
        elif ctx.needs_input_grad[2]:
            full = region.gathered(saved) if region.sp else saved
            grad_weight = g2.t().matmul(full.flatten(0, -2).to(grad.dtype)).to(weight.dtype)
        if region.sp and not defer:
            region.release()
        return grad_x, None, grad_weight, grad_bias, None


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store=None) -> torch.Tensor:
    """F.linear of a column-parallel layer. On an input that entered the region it saves only the
    sequence shard (SP) and may defer its dW to the entry (overlap); a zero-bubble store defers dW
    to the pipeline's W action instead (and keeps the gathered input for it)."""
    entered = getattr(x, "_tp_region", None)
    if store is not None:
        return store.linear(x, weight, bias)
    if entered is None or not torch.is_grad_enabled() or not (entered[1].sp or entered[1].defers(weight)):
        return F.linear(x, weight, bias)
    shard, region = entered
    return _ColumnLinear.apply(x, shard, weight, bias, region)
