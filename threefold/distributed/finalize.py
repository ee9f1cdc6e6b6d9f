"""Every gradient reduction after backward, in one place and one order.

    norm = finalize_grads(engine, grid, partial, tied, tied_copy, span)

1. Data parallel / ZeRO: wait for the bucket reductions backward launched and reduce what is
   left (`engine.finish`: all-reduce for ZeRO 0/1, reduce-scatter for ZeRO 2/3), over grid.dp_cp:
   context-parallel ranks hold the same weights and the gradients of different tokens.
2. Tensor parallel: parameters every TP rank holds whole but computes only part of the
   gradient of — norms under sequence parallelism, kv heads shared when kv_heads < tp, an MoE
   router — are summed over the TP group (`partial`). Summing over dp first and then over tp
   is the same sum, and TP ranks lay out identical shapes identically, so the sum runs on
   what the engine keeps (a ZeRO shard included).
3. Tied embedding: the first stage's embedding and the last stage's copy in the head are
   summed over grid.embed, so both hold the gradient of the one logical weight.
4. The global gradient norm over every group (tp shards counted once, dp slices under
   ZeRO 1-3 or shares of the replicated gradient under ZeRO 0, pipeline stages), the tied
   copy counted once. The step's loss rides its dp and pipeline sums (`carry`).

`span(category)` times each part as its span category (dp_exposed, tp_comm, sync,
optimizer); the step's observer passes its phase, or nothing when spans are off.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def _untimed(category: str):
    return contextlib.nullcontext()


def finalize_grads(
    engine,
    grid,
    partial: list[nn.Parameter],
    tied: list[nn.Parameter],
    tied_copy: list[nn.Parameter],
    span=_untimed,
    carry: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce every gradient of this step (see the module docstring); returns the global norm
    (divided by the loss scale: the norm of the true gradient; non-finite on overflow).
    `carry` (float64, 1-D) is summed in place over dp_cp and the stages by the norm's own
    collectives: values every rank of one tp coordinate adds once, like the step's loss."""
    with span("dp_exposed"):
        engine.finish()
    with span("tp_comm"):
        engine.all_reduce_grads_of(partial, grid.tp)
    with span("sync"):
        if tied:
            engine.all_reduce_grads_of(tied, grid.embed)
    with span("optimizer"):
        return engine.grad_norm([grid.pp], exclude=tied_copy, carry=carry)
