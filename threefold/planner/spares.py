"""How many of an allocation's nodes to keep as hot spares (`threefold plan --spares auto|N`).

Each candidate count k of spares leaves nodes - k for the job: the search plans the best layout
on them, and the failure model (planner/faults.py) prices a failure at the restart alone while a
spare is free and at the restart plus a reschedule (`faults.reschedule_s`) when every spare is
already standing in for a node under repair (`no_spare_probability`). The expected rate is the
layout's tokens/s x its goodput at Young's checkpoint interval; the count with the highest wins.
More spares cost throughput (fewer nodes train) and buy recovery (fewer failures wait for the
scheduler).
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

    @property
    def rate(self) -> float:
        """Expected tokens per second of wall time: throughput x goodput."""
        return self.prediction.tokens_per_s * self.advice.goodput if self.prediction else 0.0

    def text(self) -> str:
        if not self.prediction:
            return f"{self.spares} spares: no layout on {self.nodes} nodes ({self.why})"
        p, a = self.prediction, self.advice
        return (
            f"use {self.nodes:,} nodes, {self.spares} spares: expected {p.mfu:.1%} MFU x {a.goodput:.3f} goodput "
            f"= {self.rate:,.0f} tokens/s (a failure costs {a.restart_s:.0f} s; {p.layout.spec()})"
        )


def candidates(nodes: int, asked: str) -> list[int]:
    """Spare counts to weigh: `asked` = N, or auto = 0 up to 2% of the nodes (at least 2)."""
    if asked != "auto":
        return [int(asked)]
    return list(range(0, min(nodes - 1, max(2, math.ceil(0.02 * nodes))) + 1))


def spare_options(
    shape, cluster, global_batch: int, dtype: str, faults: Faults, counts, pins=None
) -> list[SpareOption]:
    """One option per spare count in `counts`, on cluster.nodes - count nodes."""
    out = []
    for k in counts:
        nodes = cluster.nodes - k
        plan = search(shape, dataclasses.replace(cluster, nodes=nodes), global_batch, dtype, pins=pins, keep=1)
        if not plan.ranked:
            out.append(SpareOption(k, nodes, None, None, "no layout of the model and batch fits or divides them"))
            continue
        best = plan.best
        restart = recovery_s(faults, k, nodes, cluster.devices_per_node)
        used = max(1, -(-best.devices_used // cluster.devices_per_node))
        advice = advise(faults, best.devices_used, used, shape.total_params, best.step_time_s, dtype, restart)
        out.append(SpareOption(k, nodes, best, advice))
    return out


def best_option(options: list[SpareOption]) -> SpareOption | None:
    runnable = [o for o in options if o.prediction]
    return max(runnable, key=lambda o: o.rate) if runnable else None
