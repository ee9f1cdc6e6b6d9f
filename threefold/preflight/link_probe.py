"""The link probe: the layout's own links timed before the first step, a slow one named.

Collective over the grid's world. Every rank does the same few timed exchanges on its own
groups, all groups of one dimension at once:

- pipeline neighbours: a ping-pong with the next stage, a small message (latency) and a large
  one (bandwidth), even stages first, then odd ones, so each rank is in one pair at a time;
- each tp, cp, ep and dp group of two or more ranks: an all-reduce at the same two sizes
  (bus bandwidth, as nccl-tests counts it: 2(n-1)/n of the message crosses each link).

Each rank sends rank 0 one fixed-size record (its times and the first rank of each of its
groups). Rank 0 compares each group with the median of the OTHER groups of its dimension (with
few groups a slow one would drag the median of all towards itself) and names one more than
`margin` slower and more than `floor_s` slower in absolute time (the noise of a shared host).
A dimension with one group has no peer: it is compared with `expected` (bus bandwidth in GB/s
per dimension, from the cluster profile the planner uses: the caller passes it, the planner is
a floor above this one), else its record says "unchecked"; its per-byte figure is not compared
with other dimensions', which ride other links (NVLink vs the network) by design.

A suspect is named only if a second, independent measurement finds it slow again, which also
finds the hop: rank 0 broadcasts the suspect groups (at most MAX_SLOW, a fixed-size tensor);
every group of a dimension with a suspect ping-pongs along its ring (i -> i+1, at most three
rounds of disjoint pairs), and a second fixed-size record per rank goes to rank 0, which names
a suspect whose slowest hop is again more than the margin slower than the other groups'
slowest hops, with that hop. A suspect pp pair is re-measured with every pipeline pair.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from threefold.distributed import comm
from threefold.distributed.grid import GROUP_DIMS, Grid
from threefold.distributed.round_trips import best_time, ping_pong, ring_hop
from threefold.preflight.nodes import node_index

DIMS = ("tp", "cp", "ep", "dp")
PASSES = 2
"""Every measurement is taken twice, the passes apart in time, and the faster kept: a slow link
is slow in both, a burst of load on a shared host rarely lasts across both."""
MAX_SLOW = 8
"""Suspect groups re-measured (and so named) per probe; any more are listed in the record as
"unconfirmed" (so many slow groups at once is itself a finding for whoever reads it)."""
# Record per rank: node, pp (next rank, small s, large s), then (first rank, small s, large s) per dim.
_PP, _DIM0, _WIDTH = 1, 4, 4 + 3 * len(DIMS)
# Message sizes (bytes): a CPU host moves far less; a GPU needs megabytes to reach its bandwidth.
SIZES = {"cpu": (4 << 10, 1 << 20), "cuda": (8 << 10, 64 << 20)}
FLOOR_S = {"cpu": 2e-3, "cuda": 5e-5}
"""Default `floor_s`: below this absolute excess, a slower group is noise (a shared CPU host
jitters by a millisecond or two; a GPU link by microseconds)."""


@dataclass
class LinkReport:
    named: bool
    lines: list[str] = field(default_factory=list)
    record: dict = field(default_factory=dict)


def _buffers(device: torch.device, sizes: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.ones(s // 4, dtype=torch.float32, device=device) for s in sizes)


def _keep_faster(record: torch.Tensor, at: int, times: list[float]) -> None:
    """Store (small s, large s) at record[at:at+2], or keep the faster of an earlier pass's."""
    old = record[at : at + 2].tolist()
    record[at : at + 2] = torch.tensor([min(t, o) if o > 0 else t for t, o in zip(times, old)])


def _probe_pipeline(grid: Grid, bufs, reps: int, record: torch.Tensor) -> None:
    """Even stages with the next, then odd ones: disjoint pairs, every pipeline at once."""
    group, stage, stages = grid.pp, grid.pp_rank, grid.layout.pp
    for parity in (0, 1):
        comm.barrier(grid.world)
        if stages == 1:
            continue
        if stage % 2 == parity and stage + 1 < stages:
            record[_PP] = group.ranks[stage + 1]
            _keep_faster(record, _PP + 1, [ping_pong(group, stage, stage + 1, x, True, reps) for x in bufs])
        elif (stage - 1) % 2 == parity and stage >= 1:
            for x in bufs:
                ping_pong(group, stage, stage - 1, x, False, reps)


def _probe_groups(grid: Grid, bufs, reps: int, record: torch.Tensor) -> None:
    """Each dimension's all-reduces, all its groups at once; dimensions one after the other."""
    for i, dim in enumerate(DIMS):
        comm.barrier(grid.world)
        group = getattr(grid, dim)
        if group.size == 1:
            continue
        record[_DIM0 + 3 * i] = group.ranks[0]
        times = [best_time(lambda x=x, g=group: comm.all_reduce(x, g), x.device, reps) for x in bufs]
        _keep_faster(record, _DIM0 + 3 * i + 1, times)


def _median_of_others(ordered: list[float], k: int) -> float:
    """The median of `ordered` (sorted) without its element at index k, in O(1)."""
    m = len(ordered) - 1

    def at(j):
        return ordered[j if j < k else j + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def _outliers(figures: dict[int, tuple[float, float]], margin: float, floor_s: float) -> dict[int, tuple]:
    """{key: (small s, large s)} -> {key: (which, its s, median of the others)} for the slow ones."""
    out = {}
    for which, col in (("large", 1), ("small", 0)):
        items = sorted((v[col], key) for key, v in figures.items())
        ordered = [t for t, _ in items]
        for k, (t, key) in enumerate(items):
            med = _median_of_others(ordered, k)
            if key not in out and t > med * (1 + margin) and t - med > floor_s:
                out[key] = (which, t, med)
    return out


def _members(ranks: list[int]) -> str:
    shown = ranks if len(ranks) <= 8 else [*ranks[:4], "...", *ranks[-2:]]
    return "[" + ", ".join(map(str, shown)) + "]" + ("" if len(ranks) <= 8 else f" ({len(ranks)} ranks)")


def _figure(which: str, seconds: float, size: int, factor: float) -> str:
    if which == "large":
        return f"{factor * size / seconds / 1e9:.3g} GB/s"
    return f"{seconds * 1e3:.3g} ms for {size >> 10} KiB"


def _analyse(grid, rows: list, sizes, margin, floor_s, expected) -> tuple[list, dict]:
    """Rank 0: the suspect groups and pairs from every rank's record (a list per rank)."""
    lay = grid.layout
    nodes = {r: int(row[0]) for r, row in enumerate(rows)}
    findings, summary = [], {}
    for i, dim in enumerate(DIMS):
        n = getattr(lay, dim)  # every group of a dimension has its size (dp: the full dp group)
        groups: dict[int, tuple[float, float]] = {}
        for row in rows:
            first, small, large = row[_DIM0 + 3 * i : _DIM0 + 3 * i + 3]
            if large > 0:
                old = groups.get(int(first), (0.0, 0.0))
                groups[int(first)] = (max(old[0], small), max(old[1], large))  # done when its last member is
        if not groups:
            continue
        bus = 2 * (n - 1) / n
        median_large = statistics.median(v[1] for v in groups.values())
        entry = {"groups": len(groups), "size": n, "median_busbw_gbs": bus * sizes[1] / median_large / 1e9}
        entry["median_small_s"] = statistics.median(v[0] for v in groups.values())
        slow = _outliers(groups, margin, floor_s) if len(groups) > 1 else {}
        checks = [f"the median of the other {len(groups) - 1} {dim} groups"] if len(groups) > 1 else []
        want = (expected or {}).get(dim)
        if want:  # the cluster profile's bus bandwidth: also catches a dimension slow everywhere
            checks.append(f"expected {want:.3g} GB/s")
            slowest_ok = bus * sizes[1] / (want / (1 + margin)) / 1e9  # seconds
            for first, (_, large) in groups.items():
                if first not in slow and large > slowest_ok:
                    slow[first] = ("large", large, bus * sizes[1] / want / 1e9, "expected")
        entry["checked"] = "vs " + " and ".join(checks) if checks else "unchecked: one group, no expected bandwidth"
        summary[dim] = entry
        for first, (which, t, med, *by) in sorted(slow.items()):
            size = sizes[0 if which == "small" else 1]
            ranks = lay.group_of(first, GROUP_DIMS[dim])
            against = f"median {_figure(which, med, size, bus)} of {len(groups) - 1} {dim} groups"
            if by:
                against = f"expected {_figure(which, med, size, bus)} (cluster profile)"
            figure = _figure(which, t, size, bus)
            line = f"threefold: link: {dim} group {_members(ranks)} all-reduce {figure} vs {against}"
            by = by[0] if by else "median"
            findings.append(
                {"dim": dim, "ranks": ranks, "which": which, "seconds": t, "median_s": med, "by": by, "line": line}
            )
    pairs = {r: tuple(row[_PP + 1 : _PP + 3]) for r, row in enumerate(rows) if row[_PP + 2] > 0}
    if pairs:
        summary["pp"] = {
            "pairs": len(pairs),
            "median_latency_s": statistics.median(v[0] / 2 for v in pairs.values()),
            "median_gbs": statistics.median(2 * sizes[1] / v[1] / 1e9 for v in pairs.values()),
            "checked": f"vs the median of the other {len(pairs) - 1} pp pairs" if len(pairs) > 1 else "unchecked",
        }
    # A round trip crosses the link twice: twice the noise floor.
    for r, (which, t, med) in sorted((_outliers(pairs, margin, 2 * floor_s) if len(pairs) > 1 else {}).items()):
        nxt, size = int(rows[r][_PP]), sizes[0 if which == "small" else 1]
        kind = "" if which == "large" else "round trip "
        line = (
            f"threefold: link: pp pair rank {r} -> {nxt} (node {nodes[r]} -> node {nodes[nxt]}) {kind}"
            f"{_figure(which, t, size, 2)} vs median {_figure(which, med, size, 2)} of {len(pairs) - 1} pp pairs"
        )
        pair = {"dim": "pp", "ranks": [r, nxt], "which": which, "seconds": t, "median_s": med, "by": "median"}
        findings.append(pair | {"line": line})
    return findings, summary


def probe_links(
    grid: Grid,
    device: torch.device,
    margin: float = 0.5,
    floor_s: float | None = None,
    expected: dict[str, float] | None = None,
    sizes: tuple[int, int] | None = None,
    reps: int = 5,
) -> LinkReport:
    """Time the pipeline neighbours and every tp/cp/ep/dp group; name a group or pair more than
    `margin` (0.5: 50%) and `floor_s` slower than its dimension's median (module docstring).
    `expected`: all-reduce bus bandwidth in GB/s per dimension ("tp", "dp", ...), the cluster
    profile's: a group under expected / (1 + margin) is named too, the only check of a dimension
    with one group. `sizes`: (small, large) message bytes. Collective over the world; every rank
    returns the same `named`."""
    device = torch.device(device)
    start = time.perf_counter()
    sizes = sizes or SIZES.get(device.type, SIZES["cuda"])
    floor_s = FLOOR_S.get(device.type, FLOOR_S["cuda"]) if floor_s is None else floor_s
    bufs = _buffers(device, sizes)
    record = torch.zeros(_WIDTH, dtype=torch.float64)
    record[0] = node_index(grid.global_rank)
    groups = [grid.world, grid.pp, *(getattr(grid, d) for d in DIMS)]
    with _unrecorded(groups):
        for _ in range(PASSES):
            _probe_pipeline(grid, bufs, reps, record)
            _probe_groups(grid, bufs, reps, record)
        records = comm.gather_dim0(record.to(device).reshape(1, -1), grid.world)
        suspects, summary, rows, unconfirmed = [], {}, [], []
        plan = torch.full((MAX_SLOW + 1, 2), -1, dtype=torch.int64)
        if records is not None:
            rows = records.cpu().tolist()
            suspects, summary = _analyse(grid, rows, sizes, margin, floor_s, expected)
            rings = [f for f in suspects if f["dim"] != "pp"]
            unconfirmed = [f["line"] for f in rings[MAX_SLOW:]]
            rings = rings[:MAX_SLOW]
            suspects = [f for f in suspects if f["dim"] == "pp"] + rings
            plan[0] = torch.tensor([len(suspects), any(f["dim"] == "pp" for f in suspects)])
            for k, f in enumerate(rings, start=1):
                plan[k] = torch.tensor([DIMS.index(f["dim"]), f["ranks"][0]])
        plan = comm.broadcast(plan.to(device), grid.world).cpu()
        findings = []
        if plan[0, 0] > 0:  # a second, independent measurement of the suspects' dimensions
            second = comm.gather_dim0(_remeasure(grid, plan, bufs, reps).to(device).reshape(1, -1), grid.world)
            verdict = torch.zeros(1, dtype=torch.int64)
            if second is not None:
                findings = _confirmed(suspects, rows, second.cpu().tolist(), margin, floor_s)
                verdict[0] = len(findings)
            plan[0, 0] = int(comm.broadcast(verdict.to(device), grid.world).cpu()[0])
    record_out = {
        "sizes_bytes": list(sizes),
        "margin": margin,
        "floor_s": floor_s,
        "dims": summary,
        "suspects": len(suspects),
        "unconfirmed": unconfirmed,
        "named": findings,
        "wall_s": time.perf_counter() - start,
    }
    return LinkReport(int(plan[0, 0]) > 0, [f["line"] for f in findings], record_out)


class _unrecorded:
    """comm.unrecorded over several groups (some the same object): a probe is not training traffic."""

    def __init__(self, groups):
        self.contexts = [comm.unrecorded(g) for g in {id(g): g for g in groups}.values()]

    def __enter__(self):
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)


def _remeasure(grid: Grid, plan: torch.Tensor, bufs, reps: int) -> torch.Tensor:
    """The second measurement, on every rank: the pipeline pairs again when a pair is suspect;
    every group's ring hops (i -> i+1) in each dimension with a suspect group. This rank's
    figures, fixed size: (pp small s, pp large s, outgoing hop s per dimension)."""
    out = torch.zeros(2 + len(DIMS), dtype=torch.float64)
    if plan[0, 1] > 0:
        again = torch.zeros(_WIDTH, dtype=torch.float64)
        _probe_pipeline(grid, bufs, reps, again)
        out[0:2] = again[_PP + 1 : _PP + 3]
    dims = {int(d) for d in plan[1:, 0].tolist() if d >= 0}
    for i, dim in enumerate(DIMS):
        if i in dims:
            comm.barrier(grid.world)
            group = getattr(grid, dim)
            if group.size > 1:
                out[2 + i] = ring_hop(group, reps, bufs[1])
    return out


def _confirmed(suspects: list[dict], rows: list, second: list, margin: float, floor_s: float) -> list[dict]:
    """Rank 0: the suspects the second measurement finds slow again (a slow link is slow every
    time; a burst of load on the host rarely twice in the same place), each group with its
    slowest hop. A group named against the expected bandwidth alone has no peers to be compared
    with again: it stands, with its hop."""
    pp_pairs = {r: (row[0], row[1]) for r, row in enumerate(second) if row[1] > 0}
    pp_slow = _outliers(pp_pairs, margin, 2 * floor_s) if len(pp_pairs) > 1 else {}
    out = []
    for f in suspects:
        if f["dim"] == "pp":
            if f["ranks"][0] in pp_slow:
                out.append(f)
            continue
        i = DIMS.index(f["dim"])
        slowest: dict[int, tuple[float, int]] = {}  # group's first rank -> (its slowest hop s, from rank)
        for r, row in enumerate(second):
            if row[2 + i] > 0:
                first = int(rows[r][_DIM0 + 3 * i])
                slowest[first] = max(slowest.get(first, (0.0, -1)), (row[2 + i], r))
        hops = {first: (0.0, t) for first, (t, _) in slowest.items()}
        again = _outliers(hops, margin, 2 * floor_s) if len(hops) > 1 else {}
        first = f["ranks"][0]
        if first not in again and f["by"] != "expected":
            continue
        if first in slowest:
            ranks, a = f["ranks"], slowest[first][1]
            b = ranks[(ranks.index(a) + 1) % len(ranks)]
            f["hop"] = [a, b]
            f["line"] += f"; slowest hop rank {a} -> {b} (node {int(rows[a][0])} -> node {int(rows[b][0])})"
        out.append(f)
    return out
