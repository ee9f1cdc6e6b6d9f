"""The engine's training state as rectangular pieces of each parameter, for checkpoints.

A rank's slices cut parameters anywhere, even inside a row. A checkpoint stores rectangular
slices of logical tensors (global shape + offsets, as Megatron's ShardedTensor), so each owned
run of elements is split into at most three rectangles: the rest of a first row, whole rows,
the start of a last row. The pieces are views of the fp32 master weights and Adam moments: a
loader writes into them and then calls `refresh_params` to rebuild the working parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Piece:
    """Elements [offsets, offsets + shape) of `param` (in its local, e.g. TP-sharded, shape)."""

    param: nn.Parameter
    offsets: tuple[int, ...]
    tensors: dict[str, torch.Tensor]  # "master", "exp_avg", "exp_avg_sq": views shaped as the piece


def _rectangles(lo: int, hi: int, shape: tuple[int, ...]) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """Flat range [lo, hi) of a row-major tensor as (flat lo, flat hi, offsets, piece shape)."""
    if len(shape) == 1:
        return [(lo, hi, (lo,), (hi - lo,))]
    if len(shape) != 2:
        raise ValueError(f"checkpoint pieces support 1-D and 2-D parameters, not shape {shape}")
    cols = shape[1]
    out = []
    while lo < hi:
        row, col = divmod(lo, cols)
        if col or hi - lo < cols:  # a partial row
            end = min(hi, (row + 1) * cols)
            out.append((lo, end, (row, col), (1, end - lo)))
        else:  # whole rows
            end = lo + (hi - lo) // cols * cols
            out.append((lo, end, (row, 0), ((end - lo) // cols, cols)))
        lo = end
    return out


def owned_pieces(engine) -> list[Piece]:
    """Every piece of every parameter whose optimizer state this rank holds. With zero >= 1 each
    element belongs to exactly one dp rank; with zero 0 every dp rank holds everything (let dp
    rank 0 write)."""
    opt, layout = engine.optimizer, engine.layout
    kinds = {"master": opt.master, "exp_avg": opt.exp_avg, "exp_avg_sq": opt.exp_avg_sq}
    out = []
    for b in layout.buckets:
        lo_b, hi_b = b.shard_range(opt.rank)
        for i in b.slots:
            s = layout.slots[i]
            a, z = max(lo_b, s.start), min(hi_b, s.start + s.numel)
            for flo, fhi, offsets, shape in _rectangles(a - s.start, z - s.start, s.shape) if a < z else []:
                at = s.start + flo - lo_b  # position inside this bucket's owned slice
                views = {k: v[b.index][at : at + fhi - flo].view(shape) for k, v in kinds.items()}
                out.append(Piece(engine.params[i], offsets, views))
    return out


@torch.no_grad()
def refresh_params(engine, step: int) -> None:
    """After loading into the pieces: the optimizer's step count, then the working parameters
    from the fp32 masters (copy down, and re-gather the replicated buffer under ZeRO 1/2)."""
    for part in engine.parts:  # dense + expert engines of an MoE model
        opt = part.optimizer
        opt.step_count = step
        part.wait_params()
        if opt.master_flat is not None:
            torch._foreach_copy_(opt.param_owned, opt.master)
        if part.zero in (1, 2):
            part.param_gather.gather_all()
        elif part.zero == 3:
            part.store.free_all()  # a unit still gathered would hold stale values
