"""Ring attention over the cp group, on the load-balanced layout of chunks.py.

Each rank keeps its queries; the key/value blocks travel around the ring (rank i sends to i+1,
receives from i-1), so after cp steps every query has met every key. Step t holds the block of
rank j = i - t; the transfer of the next block is posted before the current block is computed,
so it hides behind that block's attention. Partial outputs merge by their log-sum-exp (the
online softmax of FlashAttention / Milakov & Gimelshein 2018): out = sum_b exp(lse_b - lse) out_b.

Which rows meet which columns (q chunks i and 2N-1-i, kv chunks j and 2N-1-j, N = cp):
    j == i: the local block under the causal mask, as q chunk i against kv chunk i (causal)
            and q chunk 2N-1-i against both kv chunks (causal from column c on): q chunk i
            never sees kv chunk 2N-1-i, so that quarter is not computed;
    j <  i: both q chunks see kv chunk j fully and kv chunk 2N-1-j not at all;
    j >  i: only q chunk 2N-1-i sees anything, and it sees both kv chunks fully.
So every step after the first is one unmasked half-size product: the same work on every rank.

Backward recomputes each block's probabilities from the saved q, k, v, output and lse. dq stays
local; each block's dk/dv accumulator travels with it (one step behind the block, sent once
this rank has added its part), and after cp sends it is back at its owner. The accumulators
travel in fp32 so a cp-way sum of bf16 gradients is not rounded cp times.

Memory: a product's score matrix is [batch, heads, rows, cols] in fp32, (S/cp)^2 / 2 elements per
head, 256 MB per block at S = 16k, cp 4, 4 heads, batch 2. So each product is computed in row
chunks of at most BLOCK_ELEMENTS scores (row_chunks): the same sums, the chunks' rows disjoint,
and a causal product's chunk keeps only the columns its last row can see.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from threefold.distributed import comm
from threefold.distributed.comm import Group


@dataclass
class RingTiming:
    """Host seconds one or more ring calls spent computing blocks vs blocked on transfers
    (pass one to context_parallel_attention to fill it; synchronizes a CUDA device per step)."""

    compute_s: float = 0.0
    """Block attention (forward and backward) between posting a transfer and waiting for it."""
    wait_s: float = 0.0
    """Waiting for transfers after the block was computed: the part not hidden."""
    transfers: int = 0
    """Point-to-point exchanges waited on."""


class _Clock:
    """Splits host time into compute and wait for a RingTiming; free when there is none."""

    def __init__(self, timing: RingTiming | None, device: torch.device):
        self.timing, self.cuda = timing, device.type == "cuda"
        self.t = 0.0

    def start(self) -> None:
        if self.timing is not None:
            self._sync()
            self.t = time.perf_counter()

    def lap(self, field: str) -> None:
        if self.timing is not None:
            self._sync()
            now = time.perf_counter()
            setattr(self.timing, field, getattr(self.timing, field) + now - self.t)
            self.t = now

    def _sync(self) -> None:
        if self.cuda:  # host clocks only see the device's work once it is done
            torch.cuda.synchronize()


def block_plan(i: int, j: int, c: int) -> list[tuple[slice, slice, int | None]]:
    """The products rank i computes against rank j's block, chunk length c (the rule in the
    module docstring): (local q rows, local kv columns, diagonal) where row r of the product
    sees column k up to k <= r + diagonal, None: every column. The products' rows are disjoint
    in the first step (each covers its rows once)."""
    if j == i:
        return [(slice(0, c), slice(0, c), 0), (slice(c, 2 * c), slice(0, 2 * c), c)]
    if j < i:
        return [(slice(0, 2 * c), slice(0, c), None)]
    return [(slice(c, 2 * c), slice(0, 2 * c), None)]


BLOCK_ELEMENTS = 1 << 20
"""Scores (fp32: 4 MiB) a row chunk of a product aims at; the backward keeps three such
matrices (p, dp, ds) at once, so the transient stays below the local activations at 4k tokens."""
MIN_ROWS = 64
"""Rows a chunk keeps however wide the product: fewer would make each matmul too small for a
GPU and multiply the launches (32 heads x 8k columns would otherwise mean 4-row chunks)."""


def row_chunks(rows: slice, cols: int, diagonal: int | None, width: int) -> list[tuple[slice, int, int | None]]:
    """One product of block_plan (local q `rows` against `cols` kv columns) as row chunks of at
    most BLOCK_ELEMENTS scores (but MIN_ROWS rows), `width` scores per (row, column) (batch *
    heads): (rows, visible columns from the first, diagonal), where a causal chunk drops the
    columns its last row cannot see and its diagonal moves with its first row; None: every
    column of the chunk is seen."""
    n = rows.stop - rows.start
    step = max(MIN_ROWS, 1, BLOCK_ELEMENTS // max(1, width * cols))
    out = []
    for first in range(0, n, step):
        size = min(step, n - first)
        sub = slice(rows.start + first, rows.start + first + size)
        if diagonal is None:
            out.append((sub, cols, None))
            continue
        shifted = diagonal + first  # row r of the chunk is row first + r of the product
        seen = min(cols, size + shifted)  # the chunk's last row sees columns 0 .. size - 1 + shifted
        out.append((sub, seen, None if shifted >= seen - 1 else shifted))
    return out


def _scores(q, k, diagonal: int | None, scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if diagonal is not None:
        hidden = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(diagonal + 1)
        s = s.masked_fill(hidden, float("-inf"))
    return s


def _attend(q, k, v, diagonal: int | None, scale: float):
    """One product: q [b, kvh, g, sq, d], k/v [b, kvh, 1, sk, d] (fp32) -> out, lse [b, kvh, g, sq]."""
    s = _scores(q, k, diagonal, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def _attend_backward(q, k, v, do, lse, delta, diagonal: int | None, scale: float):
    """One block's gradients from the FINAL lse and delta = rowsum(dout * out): dq, dk, dv
    (dk/dv summed over the query heads that share each kv head)."""
    p = torch.exp(_scores(q, k, diagonal, scale) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(2) * scale
    return dq, dk, dv


def _exchange(x: torch.Tensor, group: Group) -> tuple[torch.Tensor, list]:
    """Post: send `x` to the next rank, receive the previous rank's into a new buffer."""
    n, i = group.size, group.rank
    into = torch.empty_like(x)
    works = comm.batch_send_recv([("send", x, (i + 1) % n), ("recv", into, (i - 1) % n)], group)
    return into, works


def _wait(works: list, group: Group, clock: _Clock) -> None:
    comm.wait_all(works, group)
    if clock.timing is not None:
        clock.timing.transfers += 1
    clock.lap("wait_s")


class RingAttention(torch.autograd.Function):
    """Causal attention of the local rows over the whole cp-sharded sequence (see module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, group: Group, timing: RingTiming | None):
        n, i = group.size, group.rank
        b, h, s, d = q.shape
        kvh = k.shape[1]
        c, scale = s // 2, d**-0.5
        q5 = q.float().reshape(b, kvh, h // kvh, s, d)  # q head kvh_j*g + r uses kv head kvh_j (SDPA's GQA)
        clock = _Clock(timing, q.device)
        clock.start()
        kv = torch.stack([k, v])
        out = torch.empty(q5.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q5.shape[:-1], dtype=torch.float32, device=q.device)
        for t in range(n):
            nxt, works = _exchange(kv, group) if t + 1 < n else (None, [])
            for block_rows, cols, block_diagonal in block_plan(i, (i - t) % n, c):
                kb, vb = (kv[x, :, :, cols].float().unsqueeze(2) for x in (0, 1))
                for rows, seen, diagonal in row_chunks(block_rows, kb.shape[-2], block_diagonal, b * h):
                    o_blk, l_blk = _attend(q5[..., rows, :], kb[..., :seen, :], vb[..., :seen, :], diagonal, scale)
                    if t == 0:  # the first step's products cover every row once
                        out[..., rows, :], lse[..., rows] = o_blk, l_blk
                    else:
                        merged = torch.logaddexp(lse[..., rows], l_blk)
                        old = out[..., rows, :] * torch.exp(lse[..., rows] - merged).unsqueeze(-1)
                        out[..., rows, :] = old + o_blk * torch.exp(l_blk - merged).unsqueeze(-1)
                        lse[..., rows] = merged
            clock.lap("compute_s")
            if nxt is not None:
                _wait(works, group, clock)
                kv = nxt
        out = out.reshape(b, h, s, d).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.timing = group, timing
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        n, i = group.size, group.rank
        b, h, s, d = q.shape
        kvh = k.shape[1]
        c, scale, shape = s // 2, d**-0.5, (b, kvh, h // kvh, s, d)
        q5, do5 = q.float().reshape(shape), dout.float().reshape(shape)
        delta = (do5 * out.float().reshape(shape)).sum(-1)
        clock = _Clock(ctx.timing, q.device)
        clock.start()
        dq = torch.zeros(shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        incoming, grad_works, sending = None, [], None
        for t in range(n):
            nxt, works = _exchange(kv, group) if t + 1 < n else (None, [])
            dkv = torch.zeros((2, b, kvh, s, d), dtype=torch.float32, device=q.device)
            for block_rows, cols, block_diagonal in block_plan(i, (i - t) % n, c):
                kb, vb = (kv[x, :, :, cols].float().unsqueeze(2) for x in (0, 1))
                for rows, seen, diagonal in row_chunks(block_rows, kb.shape[-2], block_diagonal, b * h):
                    dq_r, dk_b, dv_b = _attend_backward(
                        q5[..., rows, :],
                        kb[..., :seen, :],
                        vb[..., :seen, :],
                        do5[..., rows, :],
                        lse[..., rows],
                        delta[..., rows],
                        diagonal,
                        scale,
                    )
                    dq[..., rows, :] += dq_r
                    start = cols.start
                    dkv[0, :, :, start : start + seen] += dk_b
                    dkv[1, :, :, start : start + seen] += dv_b
            clock.lap("compute_s")
            if incoming is not None:  # the previous ranks' part of this block's gradient
                _wait(grad_works, group, clock)
                dkv += incoming
            sending = dkv  # kept alive until its send is waited on
            incoming, grad_works = _exchange(sending, group)
            if nxt is not None:
                _wait(works, group, clock)
                kv = nxt
        _wait(grad_works, group, clock)  # our own block, back from its trip around the ring
        del sending
        dq = dq.reshape(b, h, s, d).to(q.dtype)
        return dq, incoming[0].to(k.dtype), incoming[1].to(v.dtype), None, None


def ring_attention(q, k, v, group: Group, timing: RingTiming | None = None) -> torch.Tensor:
    """Causal attention of the local (load-balanced) rows against the whole sequence."""
    return RingAttention.apply(q, k, v, group, timing)
