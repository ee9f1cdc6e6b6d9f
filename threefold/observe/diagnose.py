"""In-run diagnosis on rank 0: detectors that name the slow link, rank, node, layer or stage and
the step where the run changed, from what the ranks' own timings show (never from knowing that a
drill runs).

    diagnosis = Diagnosis(cfg, grid, is_logger, log)
    fields = diagnosis.after_step(step, record, view)   # every step; view: on report steps only

Every step feeds the detectors the step's record (its step time: the change-point detector's
per-step series); report steps (every log.interval steps, the last, traced ones) also hand them a
ReportView: every rank's means since the last report (spans.jsonl's rows, with per-group and
per-peer communication time), the layout, and on traced steps every layer's time. A detector
returns the findings it names on that report; the hub prints each new one once, keeps the active
ones (a finding no detector returns for CLEAR_AFTER reports in a row is cleared), and puts them
into the metrics line (`findings`, on report steps). Only rank 0 does any of this; the other ranks
return {} at no cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from threefold.observe.findings import Finding

CLEAR_AFTER = 2
"""Report lines in a row without a finding before it is cleared (one quiet line is noise)."""


@dataclass
class ReportView:
    """What rank 0 holds on a report step."""

    step: int
    """The report step, counted from 1."""
    steps: int
    """How many steps the rows average."""
    ranks: list[dict]
    """Per rank (spans.jsonl's rows): rank, tp/pp/dp/ep coordinates, wall_s, time_s per category,
    comm_bytes, comm_calls, and `links` (observe/links.links_of: {"collective_s": {group: s},
    "pp_prev_s": s, "pp_next_s": s, "pp_prev": rank | None, "pp_next": rank | None}), all per step."""
    layout: object
    """The RankLayout (coords(r), group lists, world size)."""
    record: dict
    """The step's metrics record so far (moe_expert_load and the like)."""
    layers: dict | None = None
    """On traced steps: observe/layers.py's per-layer times (None otherwise)."""
    extra: dict = field(default_factory=dict)
    """What else a detector may need: `stage_layers` (global layer ids per pipeline stage),
    `local_world_size` (ranks per node)."""


def _detectors(cfg, grid) -> list:
    """Every detector of this run, each with on_step(step, record) -> list[Finding] and
    on_report(view) -> list[Finding]."""
    from threefold.observe import changepoint, layers, links, stages

    found = (
        links.detector(cfg, grid),
        layers.detector(cfg, grid),
        stages.detector(cfg, grid),
        changepoint.detector(cfg, grid),
    )
    return [d for d in found if d is not None]


class Diagnosis:
    def __init__(self, cfg, grid, is_logger: bool, log=print):
        self.enabled = is_logger
        self.log = log
        self.detectors = _detectors(cfg, grid) if is_logger else []
        self.active: dict[tuple[str, str], Finding] = {}
        self._quiet: dict[tuple[str, str], int] = {}
        self.named: list[Finding] = []
        """Every finding named so far in this attempt, in order (what acts on findings reads it)."""

    def after_step(self, step: int, record: dict, view: ReportView | None = None) -> dict:
        """`step` counts from 0. Returns the fields for the step's metrics line ({} off rank 0)."""
        if not self.enabled:
            return {}
        found: list[Finding] = []
        for detector in self.detectors:
            found += detector.on_step(step + 1, record)
            if view is not None:
                found += detector.on_report(view)
        for finding in found:
            self._name(finding)
        if view is None:
            return {}
        seen = {f.identity for f in found}
        for identity in list(self.active):
            if identity in seen:
                self._quiet.pop(identity, None)
                continue
            self._quiet[identity] = self._quiet.get(identity, 0) + 1
            if self._quiet[identity] >= CLEAR_AFTER:
                gone = self.active.pop(identity)
                self._quiet.pop(identity)
                if gone.kind != "change":  # a change point is a date, not a state
                    self.log(f"threefold: step {view.step}: cleared: {gone.text}")
        return {"findings": [f.to_json() for f in self.active.values()]}

    def _name(self, finding: Finding) -> None:
        if finding.identity in self.active:
            self.active[finding.identity] = finding  # the newest figures
            return
        self.active[finding.identity] = finding
        self.named.append(finding)
        self.log(f"threefold: {finding.text}")
