"""Summed cross-entropy that upcasts one chunk of tokens' logits to fp32 at a time.

The logits of a micro-batch are the largest tensor of a step ([tokens, vocab]: 8192 x 50304 is
0.8 GiB in bf16). `F.cross_entropy(logits.float())` holds an fp32 copy of all of them and saves
an fp32 log-softmax of the same size for backward. Here forward and backward walk the rows in
chunks of about CHUNK_ELEMENTS: only one chunk is ever in fp32, and what stays saved for backward
is the logits themselves (in their own dtype, half the bytes under bf16) plus two fp32 numbers per
token (the row max and the exp-sum). Backward recomputes each chunk's softmax from those.

The arithmetic is Megatron's vocab-parallel algorithm, so the same function serves a vocabulary
split over a tensor-parallel group: `reduce_max` / `reduce_sum` (in-place all-reduces over the
group, or None without one) combine the per-rank row maxima and the (target logit, exp-sum)
pairs; `vocab_start` is the first vocabulary id of this rank's slice. Two collectives per call,
whatever the number of chunks: the maxima of every chunk are reduced together, then the sums.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CHUNK_ELEMENTS = 2**25
"""fp32 logits per chunk (128 MiB): large enough that the per-chunk kernels stay efficient."""

Reduce = Callable[[torch.Tensor], torch.Tensor] | None


def chunk_rows(vocab: int, elements: int = CHUNK_ELEMENTS) -> int:
    return max(1, elements // max(1, vocab))


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, rows, vocab_start, reduce_max, reduce_sum):
        n, width = logits.shape
        local = targets - vocab_start
        foreign = (local < 0) | (local >= width)  # a target id another rank's slice holds
        local = local.masked_fill(foreign, 0)
        row_max = torch.empty(n, dtype=torch.float32, device=logits.device)
        for lo in range(0, n, rows):
            row_max[lo : lo + rows] = logits[lo : lo + rows].float().amax(dim=-1)
        if reduce_max is not None:
            row_max = reduce_max(row_max)
        sums = torch.empty(2, n, dtype=torch.float32, device=logits.device)  # (target logit, exp-sum)
        for lo in range(0, n, rows):
            x = logits[lo : lo + rows].float() - row_max[lo : lo + rows, None]
            sums[0, lo : lo + rows] = x.gather(-1, local[lo : lo + rows, None]).squeeze(-1)
            sums[1, lo : lo + rows] = x.exp_().sum(dim=-1)
        sums[0].masked_fill_(foreign, 0.0)
        if reduce_sum is not None:
            sums = reduce_sum(sums)  # target logits and exp-sums travel together: one collective
        ctx.save_for_backward(logits, local, foreign, row_max, sums[1])
        ctx.rows = rows
        return (sums[1].log() - sums[0]).sum()

    @staticmethod
    def backward(ctx, grad):
        logits, local, foreign, row_max, exp_sum = ctx.saved_tensors
        out = torch.empty_like(logits)
        owned = (~foreign).to(torch.float32).neg()[:, None]
        rows = ctx.rows
        for lo in range(0, logits.shape[0], rows):
            # d(sum of losses)/d logits = softmax - onehot(target), the onehot only where owned.
            x = logits[lo : lo + rows].float() - row_max[lo : lo + rows, None]
            soft = x.exp_().div_(exp_sum[lo : lo + rows, None])
            soft.scatter_add_(-1, local[lo : lo + rows, None], owned[lo : lo + rows])
            out[lo : lo + rows] = soft.mul_(grad)
        return out, None, None, None, None, None


def chunked_cross_entropy_sum(
    logits: torch.Tensor,
    targets: torch.Tensor,
    rows: int | None = None,
    vocab_start: int = 0,
    reduce_max: Reduce = None,
    reduce_sum: Reduce = None,
) -> torch.Tensor:
    """Sum over tokens (fp32) of -log softmax(logits)[target]; logits [..., vocab slice],
    targets [...]. `rows`: tokens per fp32 chunk (default: CHUNK_ELEMENTS / vocab slice)."""
    flat = logits.reshape(-1, logits.shape[-1])
    rows = rows or chunk_rows(flat.shape[-1])
    return _ChunkedCrossEntropy.apply(flat, targets.reshape(-1), rows, vocab_start, reduce_max, reduce_sum)
