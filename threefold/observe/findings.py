"""What the in-run diagnosis names: one Finding per slow link, rank, node, layer or stage, change
in the run, or hang. Detectors (observe/links.py, layers.py, changepoint.py) make them on rank 0;
observe/diagnose.py prints each once, puts the active ones in the metrics line, and hands them to
what acts on them (training/actions.py) and to the monitoring export (observe/prometheus.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

KINDS = ("slow_link", "slow_rank", "slow_node", "slow_layer", "slow_stage", "change", "hang")


@dataclass
class Finding:
    kind: str
    """One of KINDS."""
    key: str
    """What it is about, stable while it lasts ("pp 1->2", "rank 5", "layer 3"): a finding with
    the same kind and key is the same finding, printed once."""
    text: str
    """The console line, without the leading 'threefold: '."""
    step: int
    """The report step it was named on (counted from 1, as metrics.jsonl counts)."""
    since: int
    """The first step it was seen in."""
    ranks: tuple[int, ...] = ()
    """Global ranks involved: a link's two ends, the slow rank, a node's ranks."""
    node: int | None = None
    stage: int | None = None
    layer: int | None = None
    group: str = ""
    """The dimension ("pp", "dp", "tp", ...) of a link or a group."""
    category: str = ""
    """The span category that moved (a change point) or holds the time."""
    value: float = 0.0
    """The measured figure (seconds per step, per micro-batch, or a relative change)."""
    baseline: float = 0.0
    """What it is compared with (its peers' median, the run before the change)."""
    extra: dict = field(default_factory=dict)
    """Kind-specific detail (a hot expert, a layer partition, a hop)."""

    @property
    def identity(self) -> tuple[str, str]:
        return self.kind, self.key

    def to_json(self) -> dict:
        out = asdict(self)
        out["ranks"] = list(self.ranks)
        return {k: v for k, v in out.items() if v not in (None, "", (), [], {})}
