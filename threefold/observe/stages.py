"""The slow-stage detector: a pipeline stage whose compute per step stands above the other
stages', and an uneven layer partition that would even them out.

    detector = stages.detector(cfg, grid)       # rank 0; None without pipeline stages
    findings = detector.on_report(view)         # observe/diagnose.py's ReportView

A pipeline runs at the pace of its slowest stage: the others wait for it (their wait is pipeline
bubble, not compute). So each stage's own work (STAGE_WORK: the forward, backward,
weight-gradient and recompute categories of observe/spans.py, and `other`, the host time between
spans, where a slower host or device's extra lands outside the kernels; the median of the
stage's ranks: one slow rank is the link detector's slow rank, not a stage's) is compared with the
other stages' median. A stage is
named when it computes SLOW_RATIO times the others or more and a partition cut from the measured
speeds (distributed/pipeline/partition.py, partition_for_speeds) would shorten the slowest
stage by MIN_GAIN or more: a stage heavy only because the embedding or the head sits on it, which
no cut can move, is not named. The finding carries the speeds and the proposed partition
(train.on_slow rebalance applies it at a restart, training/actions.py).
"""

from __future__ import annotations

import statistics

from threefold.distributed.pipeline.partition import partition_for_speeds, stage_counts
from threefold.observe.findings import Finding
from threefold.observe.spans import COMPUTE

STAGE_WORK = (*COMPUTE, "other")
"""The categories of a rank's own work that its layers set (not data, checkpoints, evaluation)."""

SLOW_RATIO = 1.25
"""A stage's compute over the other stages' median at which it is a candidate."""
MIN_GAIN = 0.10
"""The least relative cut in the slowest stage's compute a new partition must promise."""


class StageDetector:
    def __init__(self, cfg, pp: int):
        self.model, self.pp = cfg.model, pp
        self.counts = stage_counts(cfg.model, pp, cfg.parallel.vpp, cfg.parallel.stage_layers)
        self.layers = sum(self.counts)
        self._since: dict[str, int] = {}

    def held(self, stage: int) -> int:
        """Layers pipeline rank `stage` holds (over all its virtual stages)."""
        return sum(n for v, n in enumerate(self.counts) if v % self.pp == stage)

    def on_step(self, step: int, record: dict) -> list[Finding]:
        return []

    def on_report(self, view) -> list[Finding]:
        """The slow stage of this report, or none. O(world) on rank 0, report steps only."""
        per_stage: list[list[float]] = [[] for _ in range(self.pp)]
        for row in view.ranks:
            seconds = row.get("time_s", {})
            per_stage[row.get("pp", 0)].append(sum(seconds.get(c, 0.0) for c in STAGE_WORK))
        if any(not rows for rows in per_stage):
            return []
        compute = [statistics.median(rows) for rows in per_stage]
        slow = max(range(self.pp), key=compute.__getitem__)
        others = statistics.median(c for s, c in enumerate(compute) if s != slow)
        if others <= 0 or compute[slow] < SLOW_RATIO * others:
            self._since.pop(f"stage {slow}", None)
            return []
        new, speeds, predicted = partition_for_speeds(self.model, self.pp, self.counts, compute)
        if new == self.counts or max(predicted) > (1 - MIN_GAIN) * max(compute):
            return []
        key = f"stage {slow}"
        since = self._since.setdefault(key, view.step)
        text = (
            f"slow stage: stage {slow} computes {compute[slow] * 1e3:.0f} ms per step vs {others * 1e3:.0f} ms "
            f"for the others (holds {self.held(slow)} of {self.layers} layers); layers per stage "
            f"{_counts(new)} instead of {_counts(self.counts)} would take {max(predicted) * 1e3:.0f} ms"
        )
        ranks = tuple(row["rank"] for row in view.ranks if row.get("pp", 0) == slow)
        extra = {
            "speeds": [round(s, 4) for s in speeds],
            "compute_s": compute,
            "stage_layers": _counts(self.counts),
            "partition": _counts(new),
            "predicted_s": predicted,
        }
        return [
            Finding(
                kind="slow_stage",
                key=key,
                text=text,
                step=view.step,
                since=since,
                ranks=ranks,
                stage=slow,
                category="forward",
                value=compute[slow],
                baseline=others,
                extra=extra,
            )
        ]


def _counts(counts: list[int]) -> str:
    return ",".join(map(str, counts))


def detector(cfg, grid):
    """The slow-stage detector of this run; None without pipeline stages."""
    pp = cfg.parallel.pp
    return StageDetector(cfg, pp) if pp > 1 else None
