"""The collectives of tensor and sequence parallelism, as conjugate autograd pairs.

Each function takes the group it talks to and records its calls and bytes in `group.stats`
(bytes = the whole logical tensor: see grid.CommStats). The pairs (Megatron's f/g and their
sequence-parallel forms; the forward of one is the backward of the other):

    copy_to_region            fwd identity          bwd all-reduce      enter TP (replicated input)
    reduce_from_region        fwd all-reduce        bwd identity        leave TP (partial sums)
    gather_from_sequence_region  fwd all-gather(seq)  bwd reduce-scatter  enter TP from the SP region
    reduce_scatter_to_sequence_region  fwd reduce-scatter  bwd all-gather  leave TP into the SP region
    scatter_to_sequence_region   fwd split(seq)     bwd all-gather      replicated -> SP region, no traffic
    gather_to_replicated         fwd all-gather(seq)  bwd split         SP region -> replicated (its conjugate)
    gather_from_tensor_region    fwd all-gather(last dim)  bwd split    e.g. full logits for inspection

Activations are [seq, batch, ...], so "seq" is dimension 0 and every buffer is contiguous.
A group of size 1 makes every function the identity (and records nothing).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from threefold.distributed.grid import Group


# torch 2.13 renamed the flat collectives (the old names warn); older versions have only those.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


_UNTIMED = contextlib.nullcontext()


def _timed(group: Group):
    """A tp_comm span on the group's recorder when one is attached (threefold.observe)."""
    return _UNTIMED if group.spans is None else group.spans.span("tp_comm")


# --- the raw collectives, each recorded in the group's stats -------------------------------

def all_reduce_(x: torch.Tensor, group: Group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce `x` in place (x must be contiguous)."""
    group.stats.record("all_reduce", _nbytes(x))
    with _timed(group):
        dist.all_reduce(x, op=op, group=group.pg)
    return x


def all_gather_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate every rank's `x` along dimension 0."""
    x = x.contiguous()
    out = torch.empty((x.shape[0] * group.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    group.stats.record("all_gather", _nbytes(out))
    with _timed(group):
        _all_gather_flat(out, x, group=group.pg)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's 1/size slice of dimension 0."""
    x = x.contiguous()
    if x.shape[0] % group.size:
        raise ValueError(f"reduce-scatter: dimension 0 ({x.shape[0]}) is not divisible by {group.size}")
    out = torch.empty((x.shape[0] // group.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    group.stats.record("reduce_scatter", _nbytes(x))
    with _timed(group):
        _reduce_scatter_flat(out, x, group=group.pg)
    return out


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
