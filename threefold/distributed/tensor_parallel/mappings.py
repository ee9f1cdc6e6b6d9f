"""The collectives of tensor and sequence parallelism, as conjugate autograd pairs.

Each function takes the group it talks to; the collectives underneath are threefold's
communication layer (distributed/comm.py), which records calls and bytes in `group.stats`.
The pairs (Megatron's f/g and their sequence-parallel forms; the forward of one is the
backward of the other):

    copy_to_region            fwd identity          bwd all-reduce      enter TP (replicated input)
    reduce_from_region        fwd all-reduce        bwd identity        leave TP (partial sums)
    gather_from_sequence_region  fwd all-gather(seq)  bwd reduce-scatter  enter TP from the SP region
    reduce_scatter_to_sequence_region  fwd reduce-scatter  bwd all-gather  leave TP into the SP region
    scatter_to_sequence_region   fwd split(seq)     bwd all-gather      replicated -> SP region, no traffic
    gather_to_replicated         fwd all-gather(seq)  bwd split         SP region -> replicated (its conjugate)
    gather_from_tensor_region    fwd all-gather(last dim)  bwd split    e.g. full logits for inspection

Activations are [seq, batch, ...], so "seq" is dimension 0 and every buffer is contiguous.
A group of size 1 makes every function the identity (and records nothing).

threefold's own column-parallel layers enter the region through `region.enter`: the first or
the third pair, whose backward also runs the layers' deferred weight-gradient matmuls while its
collective is in flight (parallel.tp_comm_overlap). The two pairs stay here for code that
enters the region without such layers.
"""

from __future__ import annotations

import torch

from threefold.distributed.comm import Group, all_gather_dim0, all_reduce, reduce_scatter_dim0

# The raw collectives are comm's (each checks the device, records its bytes and, when log.spans
# is on, times itself as tp_comm on the TP group); this module adds the autograd pairs.
all_reduce_ = all_reduce


def split_dim(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's contiguous 1/size slice of `dim` (no communication)."""
    size = x.shape[dim]
    if size % group.size:
        raise ValueError(f"split: dimension {dim} ({size}) is not divisible by {group.size}")
    n = size // group.size
    return x.narrow(dim, group.rank * n, n).contiguous()


def all_gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    stacked = all_gather_dim0(x.unsqueeze(0), group)  # [size, ...]
    return stacked.movedim(0, -2).flatten(-2)


# --- conjugate autograd pairs ----------------------------------------------------------------


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # Out of place: the engine may hand the same gradient buffer to another branch.
        return all_reduce_(grad.contiguous().clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        # In place on a temporary (the output of a matmul); a misuse on a saved tensor fails
        # loudly in backward through autograd's version counter.
        return all_reduce_(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        # The gathered tensor feeds tensor-parallel layers: each rank holds a partial gradient.
        return reduce_scatter_dim0(grad, ctx.group), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_dim(x, group, 0)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


class _GatherToReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        # What follows runs replicated on every rank, so each holds the whole gradient already.
        return split_dim(grad, ctx.group, 0), None


class _GatherFromTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_dim(grad, ctx.group, grad.dim() - 1), None


def copy_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum of every rank's `x` (x is reduced in place: pass a temporary)."""
    return x if group.size == 1 else _ReduceFromRegion.apply(x, group)


def gather_from_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherFromSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceScatterToSequenceRegion.apply(x, group)


def scatter_to_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ScatterToSequenceRegion.apply(x, group)


def gather_to_replicated(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherToReplicated.apply(x, group)


def gather_from_tensor_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherFromTensorRegion.apply(x, group)


def leave_region(x: torch.Tensor, group: Group, sp: bool) -> torch.Tensor:
    """Output of row-parallel layers: reduce-scattered into sequence shards under SP, else all-reduced."""
    return reduce_scatter_to_sequence_region(x, group) if sp else reduce_from_region(x, group)
