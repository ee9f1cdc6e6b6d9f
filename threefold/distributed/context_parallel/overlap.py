"""How much of the ring's KV traffic hides behind attention, measured: the ring's forward and
backward with a RingTiming (compute vs waiting), against the same transfers replayed alone
(replay_p2p of the exchanges the ring posted, each waited on at once).
hidden = 1 - waited / alone: 1 when every transfer finished under its block's attention, 0 when
the ring waited as long as the transfers take by themselves. Training's traced steps measure the
same way (observe/observer.py: cp_comm_serial_s, cp_hidden), and on one host also without the
waits for a slower peer (exposed_after_peers: cp_hidden_own).

For benchmarks and traced steps, not the training path: it runs the ring `repeats` times and
leaves group.stats as it found them (the measurement is not the run's traffic).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from threefold.distributed import comm
from threefold.distributed.comm import Group
from threefold.distributed.context_parallel.ring import RingTiming, ring_attention


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def replay_p2p(batches: list, group: Group) -> float:
    """Seconds the logged batches (comm.P2PBatch from Group.p2p_log) take posted again one by
    one on scratch buffers, each waited on at once: the same traffic with nothing to hide
    behind, the cost an overlapped exchange has to hide. Collective over the group, and every
    member must replay the log its peers recorded (true of the ring, whose ranks post the same
    sequence). A measurement, not traffic: group.stats are left as they were."""
    if group.size == 1 or not batches:
        return 0.0
    device = group.device or torch.device("cpu")
    scratch = {}  # one buffer per (kind, shape, dtype): a batch's sends and receives never alias
    for batch in batches:
        for kind, shape, dtype, _ in batch.ops:
            if (kind, shape, dtype) not in scratch:
                scratch[kind, shape, dtype] = torch.zeros(shape, dtype=dtype, device=device)
    with comm.unrecorded(group):
        comm.barrier(group)
        _sync(device)
        start = time.perf_counter()
        for batch in batches:
            ops = [(kind, scratch[kind, shape, dtype], peer) for kind, shape, dtype, peer in batch.ops]
            comm.wait_all(comm.batch_send_recv(ops, group), group)
        _sync(device)
        return time.perf_counter() - start


def exposed_after_peers(batches: list, group: Group) -> float:
    """Seconds this rank waited on the logged batches once both ends had posted: each wait
    counted from the later of its start and the moment the last of the batch's peers posted
    the matching batch, so time spent on a slower peer is left out. Collective over the group
    (one all-gather of the post times, left out of group.stats); host clocks, so meaningful
    where every member shares one (CPU ranks on one host; on CUDA the host posts ahead of the
    device)."""
    if group.size == 1 or not batches:
        return 0.0
    device = group.device or torch.device("cpu")
    mine = torch.tensor([b.posted for b in batches], dtype=torch.float64, device=device)
    posted = torch.empty(group.size * len(batches), dtype=torch.float64, device=device)
    with comm.unrecorded(group):  # a measurement, not the run's traffic
        comm.all_gather_into(posted, mine, group)
    posted = posted.view(group.size, len(batches)).tolist()
    exposed = 0.0
    for k, batch in enumerate(batches):
        if batch.waited is None:
            continue
        ready = max([batch.posted] + [posted[peer][k] for *_, peer in batch.ops])
        exposed += max(0.0, batch.done - max(batch.waited, ready))
    return exposed


def measure_overlap(q, k, v, group: Group, repeats: int = 3) -> Overlap:
    """Ring forward+backward on (q, k, v) `repeats` times (after one warm-up of each kind):
    its compute and exposed wait against the same transfers alone. Collective over the group."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    timing, alone = RingTiming(), 0.0
    with comm.unrecorded(group):
        for rep in range(repeats + 1):
            t = RingTiming() if rep == 0 else timing
            comm.barrier(group)  # every rank starts each measurement together
            group.p2p_log = []
            ring_attention(q, k, v, group, t).sum().backward()
            log, group.p2p_log = group.p2p_log, None
            took = replay_p2p(log, group)  # the same exchanges alone (it starts with a barrier)
            alone += took if rep else 0.0
    return Overlap(timing.compute_s / repeats, timing.wait_s / repeats, alone / repeats)
