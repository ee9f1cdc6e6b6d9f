"""Ulysses (DeepSpeed-Ulysses, Jacobs et al. 2023): all-to-all from sequence-sharded to
head-sharded, whole-sequence causal attention on 1/cp of the heads, all-to-all back.

The gathered sequence arrives in rank order, i.e. the load-balanced chunks of every rank in
turn (chunks.gathered_order), so it is permuted to global order for the causal mask and back
afterwards. q, k and v travel in ONE all-to-all (concatenated along heads), the output in a
second; backward runs the conjugates (an all-to-all's adjoint is the reverse all-to-all).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from threefold.distributed import comm
from threefold.distributed.comm import Group
from threefold.distributed.context_parallel.chunks import gathered_order
from threefold.errors import ConfigError


def check_heads(heads: int, kv_heads: int, cp: int) -> None:
    """Refuse head counts (already divided by tp) that cp cannot split."""
    for name, count in (("heads", heads), ("kv_heads", kv_heads)):
        if count % cp:
            raise ConfigError(
                "parallel.cp_impl",
                f"a2a splits attention heads over cp ranks, but {name} {count} (after tp) is not divisible by cp {cp}",
                f"valid: ring, or a cp dividing both heads {heads} and kv_heads {kv_heads} (after tp)",
            )


def _seq_to_heads(xs: list[torch.Tensor], group: Group) -> list[torch.Tensor]:
    """[b, h_x, s/N, d] each (sequence-sharded) -> [b, h_x/N, s, d] each (rank-ordered sequence)."""
    n = group.size
    b, _, s, d = xs[0].shape
    heads = [x.shape[1] // n for x in xs]
    send = torch.cat([x.reshape(b, n, hx, s, d) for x, hx in zip(xs, heads)], dim=2)
    send = send.permute(1, 0, 2, 3, 4).contiguous()  # [n, b, sum h_x/N, s/N, d]: rows for rank r first
    got = comm.all_to_all(torch.empty_like(send), send, group)  # got[r]: rank r's sequence, our heads
    got = got.permute(1, 2, 0, 3, 4).reshape(b, sum(heads), n * s, d)
    return list(got.split(heads, dim=1))


def _heads_to_seq(xs: list[torch.Tensor], group: Group) -> list[torch.Tensor]:
    """_seq_to_heads' inverse: [b, h_x/N, s, d] each -> [b, h_x, s/N, d] each."""
    n = group.size
    b, _, s, d = xs[0].shape
    heads = [x.shape[1] for x in xs]
    send = torch.cat(xs, dim=1).reshape(b, sum(heads), n, s // n, d)
    send = send.permute(2, 0, 1, 3, 4).contiguous()  # [n, b, sum h_x/N, s/N, d]: rank r's sequence
    got = comm.all_to_all(torch.empty_like(send), send, group)  # got[r]: our sequence, rank r's heads
    parts = got.split(heads, dim=2)
    return [p.permute(1, 0, 2, 3, 4).reshape(b, n * hx, s // n, d) for p, hx in zip(parts, heads)]


class SeqToHeads(torch.autograd.Function):
    """Differentiable _seq_to_heads; backward is _heads_to_seq."""

    @staticmethod
    def forward(ctx, group: Group, *xs):
        ctx.group = group
        return tuple(_seq_to_heads(list(xs), group))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *_heads_to_seq([g.contiguous() for g in grads], ctx.group))


class HeadsToSeq(torch.autograd.Function):
    """Differentiable _heads_to_seq; backward is _seq_to_heads."""

    @staticmethod
    def forward(ctx, group: Group, *xs):
        ctx.group = group
        return tuple(_heads_to_seq(list(xs), group))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *_seq_to_heads([g.contiguous() for g in grads], ctx.group))


def ulysses_attention(q, k, v, group: Group) -> torch.Tensor:
    """Causal attention of the local (load-balanced) rows against the whole sequence, by heads."""
    n = group.size
    check_heads(q.shape[1], k.shape[1], n)
    qh, kh, vh = SeqToHeads.apply(group, q, k, v)
    order = gathered_order(qh.shape[2], n, q.device)  # gathered position -> global position
    to_global = torch.argsort(order)
    qh, kh, vh = (x.index_select(2, to_global) for x in (qh, kh, vh))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=qh.shape[1] != kh.shape[1])
    (out,) = HeadsToSeq.apply(group, out.index_select(2, order))
    return out
