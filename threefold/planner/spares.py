"""How many of an allocation's nodes to keep as hot spares (`threefold plan --spares auto|N`).

Each candidate count k of spares leaves nodes - k for the job: the search plans the best layout
on them, and the failure model (planner/faults.py) prices a failure at the restart alone while a
spare is free and at the restart plus a reschedule (`faults.reschedule_s`) when every spare is
already standing in for a node under repair (`no_spare_probability`). The expected rate is the
layout's tokens/s x its goodput at Young's checkpoint interval; the count with the highest wins.
More spares cost throughput (fewer nodes train) and buy recovery (fewer failures wait for the
scheduler).

The global batch is chosen with the nodes: the asked one where a layout of the nodes splits it,
else the nearest batch one does (a multiple of a data-parallel degree the nodes allow), within
`--batch-within` percent of the asked one (`nearest_plan`). A node count that no batch near the
asked one suits is weighed as having no layout.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from threefold.planner.faults import FaultAdvice, Faults, advise, recovery_s
from threefold.planner.predict import Prediction
from threefold.planner.search import search


@dataclass
class SpareOption:
    spares: int
    nodes: int
    prediction: Prediction | None
    advice: FaultAdvice | None
    why: str = ""
    """Why no layout runs on these nodes ('' when one does)."""
    batch: int = 0
    """The global batch the layout trains (the asked one unless the nodes do not split it)."""
    asked: int = 0

    @property
    def rate(self) -> float:
        """Expected tokens per second of wall time: throughput x goodput."""
        return self.prediction.tokens_per_s * self.advice.goodput if self.prediction else 0.0

    def text(self) -> str:
        if not self.prediction:
            return f"{self.spares} spares: no layout on {self.nodes} nodes ({self.why})"
        p, a = self.prediction, self.advice
        batch = f", global batch {self.batch:,} (asked {self.asked:,})" if self.batch != self.asked else ""
        return (
            f"use {self.nodes:,} nodes, {self.spares} spares{batch}: expected {p.mfu:.1%} MFU x "
            f"{a.goodput:.3f} goodput = {self.rate:,.0f} tokens/s "
            f"(a failure costs {a.restart_s:.0f} s; {p.layout.spec()})"
        )


def candidates(nodes: int, asked: str) -> list[int]:
    """Spare counts to weigh: `asked` = N, or auto = 0 up to 2% of the nodes (at least 2)."""
    if asked != "auto":
        return [int(asked)]
    return list(range(0, min(nodes - 1, max(2, math.ceil(0.02 * nodes))) + 1))


def batch_tiers(global_batch: int, world: int, within: float) -> list[list[int]]:
    """Global batches to try on `world` devices, nearest the asked one first, each tier the
    batches at one distance from it: the asked batch, then the multiples of each data-parallel
    degree the devices allow (a divisor of `world`) nearest it, no further than `within` x it."""
    lo, hi = global_batch * (1 - within), global_batch * (1 + within)
    near = {global_batch}
    for d in (d for d in range(1, min(world, int(hi)) + 1) if world % d == 0):
        below = global_batch // d * d
        if below != global_batch:  # d splits the asked batch: nothing nearer to add
            near.update(c for c in (below, below + d) if c > 0 and lo <= c <= hi)
    tiers: dict[int, list[int]] = {}
    for c in sorted(near):
        tiers.setdefault(abs(c - global_batch), []).append(c)
    return [tiers[k] for k in sorted(tiers)]


def nearest_plan(
    shape, cluster, global_batch: int, dtype: str, pins=None, within: float = 0.0, keep: int = 1, admit=None
):
    """(plan, batch): the search at the asked batch when a layout of the cluster runs it, else at
    the nearest batch within `within` that one does (of two equally near, the faster); the asked
    batch's empty plan when none does. `admit`: search()'s (e.g. only the layouts a topology
    places)."""
    first = None
    for tier in batch_tiers(global_batch, cluster.world, within):
        found = []
        for batch in tier:
            plan = search(shape, cluster, batch, dtype, pins=pins, keep=keep, admit=admit)
            first = first or plan
            if plan.ranked:
                found.append((plan.best.tokens_per_s, batch, plan))
        if found:
            _, batch, plan = max(found, key=lambda f: f[:2])
            return plan, batch
    return first, global_batch


def spare_options(
    shape,
    cluster,
    global_batch: int,
    dtype: str,
    faults: Faults,
    counts,
    pins=None,
    within: float = 0.0,
    keep: int = 1,
    admit=None,
) -> list[SpareOption]:
    """One option per spare count in `counts`, on cluster.nodes - count nodes, each at the batch
    nearest `global_batch` (within that fraction of it) a layout of its nodes splits (`keep`,
    `admit`: as nearest_plan's)."""
    out = []
    for k in counts:
        nodes = cluster.nodes - k
        on = dataclasses.replace(cluster, nodes=nodes)
        plan, batch = nearest_plan(shape, on, global_batch, dtype, pins, within, keep, admit)
        if not plan.ranked:
            why = "no layout of the model and batch fits or divides them"
            out.append(SpareOption(k, nodes, None, None, why, global_batch, global_batch))
            continue
        best = plan.best
        restart = recovery_s(faults, k, nodes, cluster.devices_per_node)
        used = max(1, -(-best.devices_used // cluster.devices_per_node))
        advice = advise(faults, best.devices_used, used, shape.total_params, best.step_time_s, dtype, restart)
        out.append(SpareOption(k, nodes, best, advice, "", batch, global_batch))
    return out


def best_option(options: list[SpareOption]) -> SpareOption | None:
    runnable = [o for o in options if o.prediction]
    return max(runnable, key=lambda o: o.rate) if runnable else None
