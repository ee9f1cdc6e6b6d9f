"""How much of the ring's KV traffic hides behind attention, measured: the ring's forward and
backward with a RingTiming (compute vs waiting), against the same transfers issued alone and
waited on at once. hidden = 1 - waited / alone: 1 when every transfer finished under its block's
attention, 0 when the ring waited as long as the transfers take by themselves.

For benchmarks and traced steps, not the training path: it runs the ring `repeats` times and
leaves group.stats as it found them (the measurement is not the run's traffic).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from threefold.distributed import comm
from threefold.distributed.comm import Group
from threefold.distributed.context_parallel.ring import RingTiming, _exchange, ring_attention


@dataclass
class Overlap:
    """Per ring forward+backward, seconds (means over the repeats)."""

    compute_s: float
    """Block attention, forward and backward."""
    wait_s: float
    """Blocked on a transfer after the block was done: the exposed part."""
    alone_s: float
    """The same transfers with nothing to hide behind."""

    @property
    def hidden(self) -> float:
        """Fraction of the transfer time hidden behind attention (0..1)."""
        return 0.0 if self.alone_s <= 0 else min(1.0, max(0.0, 1.0 - self.wait_s / self.alone_s))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _transfers_alone(k: torch.Tensor, v: torch.Tensor, group: Group) -> float:
    """Seconds for the ring's exchanges of one forward+backward, each waited on at once."""
    kv = torch.stack([k, v])
    grads = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    n = group.size
    _sync(kv.device)
    start = time.perf_counter()
    for x in [kv] * (2 * (n - 1)) + [grads] * n:  # kv blocks forward and backward, gradient trips
        _, works = _exchange(x, group)
        for work in works:
            comm.wait(work, group)
    _sync(kv.device)
    return time.perf_counter() - start


def measure_overlap(q, k, v, group: Group, repeats: int = 3) -> Overlap:
    """Ring forward+backward on (q, k, v) `repeats` times (after one warm-up of each kind):
    its compute and exposed wait against the same transfers alone. Collective over the group."""
    calls, sent = dict(group.stats.calls), dict(group.stats.bytes)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    timing, alone = RingTiming(), 0.0
    for rep in range(repeats + 1):
        t = RingTiming() if rep == 0 else timing
        comm.barrier(group)  # every rank starts each measurement together
        ring_attention(q, k, v, group, t).sum().backward()
        comm.barrier(group)
        took = _transfers_alone(k, v, group)
        alone += took if rep else 0.0
    group.stats.calls, group.stats.bytes = calls, sent
    return Overlap(timing.compute_s / repeats, timing.wait_s / repeats, alone / repeats)
