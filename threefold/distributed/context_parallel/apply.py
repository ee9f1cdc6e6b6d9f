"""Apply context parallelism (parallel.cp) to a plain Transformer, and cut its data to match.

Every sequence of length S is split over the cp group in the load-balanced zigzag layout of
context_parallel/chunks.py: 2cp chunks, cp rank i holding chunks i and 2cp-1-i. Three things
make a cp rank's share of the model behave as the whole sequence would:

  - data: each rank keeps its `local_indices` columns of every micro-batch's input ids and
    labels (`split_microbatches`); the sampler still reads by dp rank, so the cp ranks of one
    dp index read the same samples;
  - positions: RoPE (and GPT-2's learned table) take each token's global position, which the
    model reads from `positions` attributes set here (None without cp: 0..s-1);
  - attention: every block's AttentionCore becomes a `ContextParallelCore`, whose queries meet
    every rank's keys by ring or all-to-all (context_parallel_attention).

Everything else is token-local (norms, MLPs, the loss), so it runs unchanged on S/cp tokens.
An MoE router is token-local too, but its balance losses are over the whole micro-batch: the cp
ranks join the ranks whose routing counts it gathers (`_route_over_cp`), as the TP ranks do.

The loss stays exact: each rank sums its own tokens' losses and the trainer divides by the
global token count, so the gradient's dp_cp sum (grid.dp_cp) and the loss's world sum are those
of the unsplit batch, however the tokens fall. Under SP the cp-local sequence is then split over
tp as before. Applied after tensor/expert parallelism and before recomputation, so a
selectively recomputed core is the cp one.
"""

from __future__ import annotations

import torch
from torch import nn

from threefold.distributed import comm
from threefold.distributed.comm import Group
from threefold.distributed.context_parallel import context_parallel_attention, local_indices
from threefold.distributed.grid import Grid
from threefold.model.moe import moe_layers


class ContextParallelCore(nn.Module):
    """softmax(QK^T/sqrt(d))V, causal over the global sequence, for this rank's zigzag chunks:
    q [batch, heads, s/cp, hd], k/v [batch, kv_heads, s/cp, hd] (GQA as in AttentionCore)."""

    def __init__(self, group: Group, impl: str):
        super().__init__()
        self.group, self.impl = group, impl

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if mask is not None:  # validate refuses data.document_mask with cp > 1
            raise ValueError("context-parallel attention takes no explicit mask")
        return context_parallel_attention(q, k, v, self.group, self.impl)

    def extra_repr(self) -> str:
        return f"impl={self.impl}, group={self.group.name}, size={self.group.size}"


def apply_context_parallel(model: nn.Module, grid: Grid, impl: str, seq_len: int, device: torch.device) -> nn.Module:
    """Swap every block's attention core for the cp one and give the model this rank's global
    token positions (on `device`). A no-op when cp is 1."""
    cp = grid.cp.size
    if cp == 1:
        return model
    positions = local_indices(seq_len, cp, grid.cp_rank, device=device)
    model.positions = positions
    for block in model.layers.values():
        block.attn.core = ContextParallelCore(grid.cp, impl)
        block.attn.positions = positions
    for moe in moe_layers(model).values():
        _route_over_cp(moe, grid.cp)
    return model


class _CountsOverCp:
    """An MoE layer's gather_counts over cp x (its TP ranks): [cp * tp, K, E] routing counts."""

    def __init__(self, group: Group, inner):
        self.group, self.inner = group, inner

    def __call__(self, counts: torch.Tensor) -> torch.Tensor:
        mine = counts[None] if self.inner is None else self.inner(counts)  # [tp, K, E]
        return comm.all_gather_dim0(mine, self.group)


def _route_over_cp(moe: nn.Module, group: Group) -> None:
    """The micro-batch's tokens are split over cp x tp ranks; ours follow those of lower cp ranks.
    (Capacity's queue order follows that rank order, not token position: validate refuses
    model.capacity_factor with cp > 1, so dropless routing is the same as without cp.)"""
    moe.gather_counts = _CountsOverCp(group, moe.gather_counts)
    moe.token_rank += group.rank * moe.token_ranks
    moe.token_ranks *= group.size


def split_microbatches(batches: list[tuple[torch.Tensor, torch.Tensor]], grid: Grid) -> list:
    """This cp rank's columns (zigzag chunks) of every (inputs, targets) [batch, seq] pair."""
    if grid.cp.size == 1:
        return batches
    return [(split_sequence(x, grid), split_sequence(y, grid)) for x, y in batches]


def split_sequence(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """The columns of `x` [batch, seq] this cp rank holds (x itself without cp)."""
    if grid.cp.size == 1:
        return x
    return x[:, local_indices(x.shape[1], grid.cp.size, grid.cp_rank, device=x.device)].contiguous()
