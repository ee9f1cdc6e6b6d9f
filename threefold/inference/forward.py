"""A forward-only pass of one micro-batch through this rank's pipeline chunks.

Virtual stage s lives on pipeline rank s % pp (chunk s // pp); the activation walks the stages
in order, each boundary one blocking send/recv. Nothing overlaps: evaluation runs rarely and
holds no activations for backward, so the schedule's bubble-hiding does not pay here.
"""

from __future__ import annotations

import torch
from torch import nn

from threefold.distributed import comm
from threefold.distributed.grid import Grid


@torch.no_grad()
def pipeline_forward(
    chunks: list[nn.Module], grid: Grid, inputs: torch.Tensor, targets: torch.Tensor | None, hidden: int, sp: bool
) -> torch.Tensor | None:
    """The last stage's output (summed loss with `targets`, else logits [seq, batch, vocab/tp])
    on the rank holding the last virtual stage; None elsewhere. `inputs`/`targets`: [batch, seq]."""
    p = grid.layout.pp
    stages = p * len(chunks)
    seq = inputs.shape[1] // (grid.tp.size if sp else 1)
    dtype = next(chunks[0].parameters()).dtype
    device = next(chunks[0].parameters()).device
    x, out = inputs.to(device), None
    for s in range(stages):
        if s % p != grid.pp_rank:
            continue
        chunk = chunks[s // p]
        if s > 0 and p > 1:
            x = torch.empty((seq, inputs.shape[0], hidden), dtype=dtype, device=device)
            comm.recv(x, grid.pp, (s - 1) % p)
        last = s == stages - 1
        y = chunk(x, targets.to(device) if last and targets is not None else None)
        if last:
            out = y
        elif p > 1:
            comm.send(y.contiguous(), grid.pp, (s + 1) % p)
        else:
            x = y
    return out


def gather_vocab(logits: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Whole-vocabulary logits from tensor-parallel shards (tests and sampling; the loss never needs it)."""
    if grid.tp.size == 1:
        return logits
    return comm.all_gather_dim0(logits.unsqueeze(0), grid.tp).movedim(0, -2).flatten(-2)
