"""The hop inside a ring collective group: a round trip per ring neighbour, on report steps.

A group's collective time says that a group is slow, not which of its links is: every member of
a ring waits on the slowest hop. So on each report step every rank times a small round trip to
its successor in each ring group of more than two members (observe/links.COMPARED's groups;
with two members the group is its one hop), and its row carries that one float per group name
(`hop_s`). Rank 0 compares each hop with the other hops of its dimension, in every group of it.

    probe = HopProbe(groups, names, device)       # every rank, with log.spans on
    row += probe.measure()                        # report steps: collective over each ring group
    slow_hops(layout, rows, slow, ratio, floor)   # rank 0: the hops beyond their peers

The ring is the group's ranks in order (NCCL builds its rings in rank order inside a node and
across nodes in node order, and a slow node's NIC slows both of its hops). Hops are timed as the
preflight link probe times them (distributed/round_trips.py): in two phases (three for an odd
ring), each rank in at most one hop per phase, after a barrier, so a slow hop does not hold up
the hops timed beside it; the first of REPEATS round trips is a warm-up, which also absorbs a
rank still finishing the phase before. Per rank: O(groups it is in)
messages of one element, whatever the world size.

Nothing here knows whether a drill runs: the round trips go through comm.send and comm.recv as
any exchange does, so a slow cable, a congested switch port or the slowlink drill look alike.
"""

from __future__ import annotations

import torch

from threefold.distributed import comm
from threefold.distributed.grid import GROUP_DIMS
from threefold.distributed.round_trips import ring_hop
from threefold.observe.medians import medians_of_others

HOP_NAMES = ("tp", "cp", "dp", "ep", "edp", "expert_dp")
"""The ring collective groups probed, the ones observe/links.py compares across their dimension."""
HOP_DIMS = {"tp": "tp", "cp": "cp", "dp": "dp_cp", "ep": "ep", "edp": "edp", "expert_dp": "expert_dp"}
"""Reported group name -> its dimensions in GROUP_DIMS (dp reports the dp x cp group)."""
REPEATS = 3
"""Round trips per hop (the first a warm-up); the least of the others is the hop's time."""


class HopProbe:
    """This rank's round trip to its successor in each ring group it belongs to."""

    def __init__(self, groups: list, names: tuple[str, ...], device: torch.device):
        self.device = torch.device(device)
        rings: dict[tuple, tuple] = {}
        for name, group in zip(names, groups):
            if name in HOP_NAMES and group is not None and group.size > 2:
                # edp and expert_dp are the dp ranks again without experts: one probe per ring
                rings.setdefault(tuple(group.ranks), (group, []))[1].append(HOP_NAMES.index(name))
        self._rings = list(rings.values())
        self._buf = torch.zeros(1, device=self.device)

    def measure(self) -> list[float]:
        """Seconds of this rank's hop in each of HOP_NAMES (0.0 where it is in no ring of the
        name, or its ring carried no collective yet: expert_dp without experts). Collective over
        every ring group that has carried one: every rank calls it on the same steps, and a
        group's members have issued the same collectives."""
        out = [0.0] * len(HOP_NAMES)
        for group, columns in self._rings:
            if not group.stats.total_calls:
                continue
            seconds = self._ring(group)
            for c in columns:
                out[c] = seconds
        return out

    def _ring(self, group) -> float:
        with comm.unrecorded(group):  # a measurement: not the step's traffic
            return ring_hop(group, REPEATS - 1, self._buf)  # one warm-up, then the timed ones


def slow_hops(layout, rows: dict, slow: set, ratio: float, floor_s: float) -> list[tuple]:
    """(name, a, b, seconds, the median of the dimension's other hops, how many) for each hop
    a -> b whose round trip exceeds `ratio` x that median and the median by `floor_s`. Hops of a
    slow rank (`slow`) are left out: a rank that is slow is not a link. O(world), rank 0 only."""
    found, named = [], set()
    for name in HOP_NAMES:
        if not any(name in (row["links"].get("hop_s") or ()) for row in rows.values()):
            continue  # no ring of this name was probed (none has more than two members)
        hops = []
        for ranks in layout.groups(GROUP_DIMS[HOP_DIMS[name]]):
            if len(ranks) <= 2 or not all(r in rows for r in ranks):
                continue
            for i, a in enumerate(ranks):
                seconds = (rows[a]["links"].get("hop_s") or {}).get(name, 0.0)
                hops.append((a, ranks[(i + 1) % len(ranks)], seconds))
        if len(hops) < 3:
            continue
        medians = medians_of_others([h[2] for h in hops])
        for (a, b, seconds), median in zip(hops, medians):
            if a in slow or b in slow or not (seconds > ratio * median and seconds - median > floor_s):
                continue
            if (a, b) in named:
                continue  # the same ring under another name (edp is dp without experts)
            named.add((a, b))
            found.append((name, a, b, seconds, median, len(hops) - 1))
    return found
