"""Ring attention over the cp group, on the load-balanced layout of chunks.py.

Each rank keeps its queries; the key/value blocks travel around the ring (rank i sends to i+1,
receives from i-1), so after cp steps every query has met every key. Step t holds the block of
rank j = i - t; the transfer of the next block is posted before the current block is computed,
so it hides behind that block's attention. Each block is ONE call of SDPA's fused kernel that
returns the rows' log-sum-exp (block_attention.py), in the run's dtype, and partial outputs
merge by it (the online softmax of FlashAttention / Milakov & Gimelshein 2018).

Which rows meet which columns (q chunks i and 2N-1-i, kv chunks j and 2N-1-j, N = cp) makes
every block a plain fused call on a slice, never a mask:
    j == i: the local block is the plain lower triangle (global positions increase along the
            local sequence), so one causal call of all rows against all columns; q chunk i
            never sees kv chunk 2N-1-i, and the causal kernel skips that quarter;
    j <  i: both q chunks see kv chunk j fully and kv chunk 2N-1-j not at all: all rows
            against the first half of the columns;
    j >  i: only q chunk 2N-1-i sees anything, and it sees both kv chunks fully: the second
            half of the rows against all columns.
So every step after the first is one unmasked half-size product: the same work on every rank.

Backward calls each block's backward kernel with the saved q, k, v and the FINAL output and
log-sum-exp, which makes each block's gradient its exact share. dq stays local; each block's
dk/dv accumulator travels with it (one step behind the block, sent once this rank has added
its part), and after cp sends it is back at its owner. The accumulators (and dq, and the
forward's merged output) are fp32, so a cp-way sum of bf16 blocks is not rounded cp times.

Memory: the fused kernels never hold a block's score matrix; besides the saved q, k, v, output
and lse, a step holds one block's output (forward) or gradients (backward) and the fp32
accumulators.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from threefold.distributed import comm
from threefold.distributed.comm import Group
from threefold.distributed.context_parallel.block_attention import block_kernel, merge_block


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


def block_plan(i: int, j: int, c: int) -> tuple[slice, slice, bool]:
    """What rank i computes against rank j's block, chunk length c (the rule in the module
    docstring): (local q rows, local kv columns, causal). A causal block is square and its
    mask the plain lower triangle; otherwise every row sees every column."""
    if j == i:
        return slice(0, 2 * c), slice(0, 2 * c), True
    if j < i:
        return slice(0, 2 * c), slice(0, c), False
    return slice(c, 2 * c), slice(0, 2 * c), False


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
        c = q.shape[2] // 2
        kernel = block_kernel(q)
        clock = _Clock(timing, q.device)
        clock.start()
        kv = torch.stack([k, v])
        out = lse = state = None
        for t in range(n):
            nxt, works = _exchange(kv, group) if t + 1 < n else (None, [])
            rows, cols, causal = block_plan(i, (i - t) % n, c)
            block_out, block_lse, block_state = kernel.forward(q[:, :, rows], *kv[:, :, :, cols], causal)
            if t == 0:  # the diagonal block covers every row
                out, lse, state = block_out.to(torch.float32), block_lse, block_state
            else:
                merge_block(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            clock.lap("compute_s")
            if nxt is not None:
                _wait(works, group, clock)
                kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *state)  # state: the kernel's rng, unused without dropout
        ctx.group, ctx.timing, ctx.kernel = group, timing, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *state = ctx.saved_tensors
        group, kernel = ctx.group, ctx.kernel
        n, i = group.size, group.rank
        c = q.shape[2] // 2
        # A block's rows are all of them or the second half: their lse in the kernel's layout, once.
        lse_rows = {0: kernel.backward_lse(lse), c: kernel.backward_lse(lse[:, :, c:])}
        clock = _Clock(ctx.timing, q.device)
        clock.start()
        kv = torch.stack([k, v])
        dq, incoming, grad_works, sending = None, None, [], None
        for t in range(n):
            nxt, works = _exchange(kv, group) if t + 1 < n else (None, [])
            rows, cols, causal = block_plan(i, (i - t) % n, c)
            dq_b, dk_b, dv_b = kernel.backward(
                dout[:, :, rows],
                q[:, :, rows],
                kv[0, :, :, cols],
                kv[1, :, :, cols],
                out[:, :, rows],
                lse_rows[rows.start],
                causal,
                state,
            )
            if t == 0:  # the diagonal block covers every row and column
                dq = dq_b.to(torch.float32)
                dkv = torch.stack([dk_b, dv_b]).to(torch.float32)
            else:
                dq[:, :, rows].add_(dq_b)  # add_ on the view: `+=` on an index would copy it back
            clock.lap("compute_s")
            if t > 0:  # the previous ranks' part of this block's gradient, then ours on top
                _wait(grad_works, group, clock)
                dkv = incoming
                dkv[0, :, :, cols].add_(dk_b)
                dkv[1, :, :, cols].add_(dv_b)
            sending = dkv  # kept alive until its send is waited on
            incoming, grad_works = _exchange(sending, group)
            if nxt is not None:
                _wait(works, group, clock)
                kv = nxt
        _wait(grad_works, group, clock)  # our own block, back from its trip around the ring
        del sending
        return dq.to(q.dtype), incoming[0].to(k.dtype), incoming[1].to(v.dtype), None, None


def ring_attention(q, k, v, group: Group, timing: RingTiming | None = None) -> torch.Tensor:
    """Causal attention of the local (load-balanced) rows against the whole sequence."""
    return RingAttention.apply(q, k, v, group, timing)
