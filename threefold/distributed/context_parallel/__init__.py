"""Context parallelism: every sequence split over the cp group, attention across the split.

Layout (chunks.py): with cp = N the sequence is cut into 2N chunks and cp rank i holds chunks i
and 2N-1-i, so causal attention costs every rank the same. Two ways to attend across ranks:

- ``ring`` (ring.py): key/value blocks rotate around the ring by point-to-point, each transfer
  hidden behind the previous block's attention; any head count, bytes grow with kv heads only.
- ``a2a`` (ulysses.py): two all-to-alls turn sequence shards into head shards and back; needs
  heads and kv heads divisible by cp, bytes grow with all heads, the attention is one call.

apply.py applies it to a model (every attention core swapped for the cp one, global token
positions for RoPE) and cuts each micro-batch to this rank's chunks. docs/context_parallel.md
says when to choose ring or a2a.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from threefold.distributed.comm import Group
from threefold.distributed.context_parallel.chunks import (
    check_divisible,
    gathered_order,
    local_indices,
    shard_sequence,
    unshard_sequence,
)
from threefold.distributed.context_parallel.overlap import Overlap, measure_overlap
from threefold.distributed.context_parallel.ring import RingTiming, ring_attention
from threefold.distributed.context_parallel.ulysses import check_heads, ulysses_attention
from threefold.errors import ConfigError

IMPLS = ("ring", "a2a")

__all__ = [
    "IMPLS",
    "CpBytes",
    "Overlap",
    "RingTiming",
    "analytic_bytes",
    "check_divisible",
    "check_heads",
    "context_parallel_attention",
    "gathered_order",
    "local_indices",
    "measure_overlap",
    "shard_sequence",
    "unshard_sequence",
]


def context_parallel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, impl: str, timing: RingTiming | None = None
) -> torch.Tensor:
    """Causal attention of this rank's rows over the whole cp-sharded sequence.

    q [batch, heads, s_local, hd], k/v [batch, kv_heads, s_local, hd] (kv_heads divides heads;
    TP-local heads), s_local in the load-balanced local order of chunks.local_indices. Returns
    [batch, heads, s_local, hd]: the rows of full causal attention this rank holds. `timing`
    (ring only) accumulates compute vs transfer-wait seconds for measuring the overlap."""
    if impl not in IMPLS:
        raise ConfigError("parallel.cp_impl", f"unknown attention {impl!r}", "valid: " + ", ".join(IMPLS))
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"context parallel attention: kv heads {k.shape[1]} do not divide heads {q.shape[1]}")
    if group.size == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    check_divisible(q.shape[2] * group.size, group.size)
    if impl == "ring":
        return ring_attention(q, k, v, group, timing)
    return ulysses_attention(q, k, v, group)


class CpBytes(NamedTuple):
    """Bytes one rank hands to the cp group's collectives in one attention call (grid.CommStats'
    convention: a send's payload, an all-to-all's whole input)."""

    forward: int
    backward: int

    @property
    def total(self) -> int:
        return self.forward + self.backward


def analytic_bytes(
    impl: str, batch: int, heads: int, kv_heads: int, seq: int, hd: int, cp: int, dtype_bytes: int
) -> CpBytes:
    """What context_parallel_attention records in group.stats for one forward and one backward;
    seq is the GLOBAL length, heads/kv_heads the TP-local counts.

    ring: forward cp-1 sends of the local k and v; backward the same cp-1 again plus cp sends of
    their fp32 gradient accumulator (the last one returns it to its owner).
    a2a: forward one all-to-all of q, k, v and one of the output; backward their conjugates."""
    if cp == 1:
        return CpBytes(0, 0)
    kv = 2 * batch * kv_heads * (seq // cp) * hd  # local k and v elements
    if impl == "ring":
        return CpBytes((cp - 1) * kv * dtype_bytes, (cp - 1) * kv * dtype_bytes + cp * kv * 4)
    if impl == "a2a":
        qkv = batch * (heads + 2 * kv_heads) * (seq // cp) * hd * dtype_bytes
        out = batch * heads * (seq // cp) * hd * dtype_bytes
        return CpBytes(qkv + out, qkv + out)
    raise ConfigError("parallel.cp_impl", f"unknown attention {impl!r}", "valid: " + ", ".join(IMPLS))
