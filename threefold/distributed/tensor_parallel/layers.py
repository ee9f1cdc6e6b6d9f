"""Tensor-parallel layers: column/row-parallel linear, vocab-parallel embedding and cross-entropy.

Each module holds only this rank's shard and declares it in `shard_specs` (with `shard_group`),
so init_weights draws exactly that slice of the full tensor and the global gradient norm
counts every logical element once. Parameters that every rank holds but whose gradient is a
per-rank partial sum (norm weights under SP, replicated GQA kv projections, row-parallel
biases under SP) are listed in `tp_sum_grads`; distributed/finalize.py sums them after backward.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from threefold.distributed.comm import MAX, Group
from threefold.distributed.tensor_parallel.mappings import all_reduce_, leave_region
from threefold.distributed.tensor_parallel.region import column_linear, enter
from threefold.model.init import ShardSpec
from threefold.model.loss import chunked_cross_entropy_sum


def _shard(full: int, group: Group, what: str) -> tuple[int, int]:
    """(start, length) of this rank's equal share of `full` rows."""
    if full % group.size:
        raise ValueError(f"{what} ({full}) is not divisible by the tensor-parallel size {group.size}")
    n = full // group.size
    return group.rank * n, n


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store) -> torch.Tensor:
    # A zero-bubble pipeline sets `weight_grad_store` to defer dW (pipeline/weight_grad.py).
    return F.linear(x, weight, bias) if store is None else store.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """y = x A^T with A's output rows split over the group: each rank computes its slice of y.

    With `enter=True` the input first enters the region (copy, or all-gather under SP); set it
    False when the caller did that once for several sibling projections (q, k, v / w1, w3).
    `overlap`: its own entry runs the dW matmul during the input gradient's collective.
    """

    weight_grad_store = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Group,
        *,
        bias: bool = False,
        sp: bool = False,
        enter: bool = True,
        overlap: bool = False,
    ):
        super().__init__()
        self.group, self.sp, self.enter, self.overlap = group, sp, enter, overlap
        self.in_features, self.out_features = in_features, out_features
        start, n = _shard(out_features, group, "out_features")
        self.weight = nn.Parameter(torch.empty(n, in_features))
        self.bias = nn.Parameter(torch.empty(n)) if bias else None
        self.shard_specs = {"weight": ShardSpec(0, start, n, (out_features, in_features))}
        if bias:
            self.shard_specs["bias"] = ShardSpec(0, start, n, (out_features,))
        self.shard_group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter:
            x = enter(x, self.group, self.sp, self.overlap, (self.weight,))
        return column_linear(x, self.weight, self.bias, self.weight_grad_store)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}/{self.group.size}, sp={self.sp}, enter={self.enter}"


class RowParallelLinear(nn.Module):
    """y = x A^T with A's input columns split: the input is the column-parallel output (split
    along its last dim); partial products are all-reduced, or reduce-scattered over the
    sequence under SP. The bias is replicated and added after the reduction."""

    weight_grad_store = None

    def __init__(self, in_features: int, out_features: int, group: Group, *, bias: bool = False, sp: bool = False):
        super().__init__()
        self.group, self.sp = group, sp
        self.in_features, self.out_features = in_features, out_features
        start, n = _shard(in_features, group, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, n))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.shard_specs = {"weight": ShardSpec(1, start, n, (out_features, in_features))}
        self.shard_group = group
        # Under SP each rank adds the bias to its own sequence shard only: partial gradient.
        self.tp_sum_grads = ("bias",) if bias and sp else ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = leave_region(_linear(x, self.weight, None, self.weight_grad_store), self.group, self.sp)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features}/{self.group.size} -> {self.out_features}, sp={self.sp}"


class HeadSliceLinear(nn.Module):
    """A projection held whole on every rank, of which this rank uses rows [start, start+length):
    GQA key/value heads when kv_heads < tp (each kv head serves the query heads of tp/kv_heads
    ranks). The unused rows get a zero gradient here, so summing over the group is exact."""

    def __init__(self, in_features: int, out_features: int, start: int, length: int, *, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.start, self.length = in_features, out_features, start, length
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.tp_sum_grads = ("weight", "bias") if bias else ("weight",)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = slice(self.start, self.start + self.length)
        return column_linear(x, self.weight[rows], None if self.bias is None else self.bias[rows])

    def extra_repr(self) -> str:
        return f"{self.in_features} -> rows [{self.start}, {self.start + self.length}) of {self.out_features}"


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split over the group: each rank looks up the ids it owns
    (zeros elsewhere), then the partial rows are summed - all-reduced, or reduce-scattered over
    the sequence when `scatter` (SP without a position table to add first)."""

    def __init__(self, vocab: int, dim: int, group: Group, *, scatter: bool = False):
        super().__init__()
        self.group, self.scatter, self.vocab, self.dim = group, scatter, vocab, dim
        self.start, n = _shard(vocab, group, "vocab")
        self.weight = nn.Parameter(torch.empty(n, dim))
        self.shard_specs = {"weight": ShardSpec(0, self.start, n, (vocab, dim))}
        self.shard_group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        foreign = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(foreign, 0), self.weight)
        out = out.masked_fill(foreign.unsqueeze(-1), 0.0)
        return leave_region(out, self.group, self.scatter)

    def extra_repr(self) -> str:
        return f"{self.vocab}/{self.group.size} x {self.dim}, scatter={self.scatter}"


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, group: Group, rows: int | None = None
) -> torch.Tensor:
    """Sum of cross-entropy losses (fp32) of logits [..., vocab/size] split over `group`, without
    gathering them (Megatron's algorithm: global row max -> local exp-sums and target logits ->
    one summed all-reduce), one chunk of `rows` tokens upcast to fp32 at a time (model/loss.py)."""
    if group.size == 1:
        return chunked_cross_entropy_sum(logits, targets, rows)
    return chunked_cross_entropy_sum(
        logits,
        targets,
        rows,
        vocab_start=group.rank * logits.shape[-1],
        reduce_max=partial(all_reduce_, group=group, op=MAX),
        reduce_sum=partial(all_reduce_, group=group),
    )
