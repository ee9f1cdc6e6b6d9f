"""Expected-time bands: what a tuned run's step should look like, checked while a later run trains.

A bands file is a TOML `[bands]` table, one entry per span category (observe/spans.py), each the
expected share of the critical rank's step and the half-width of its band:

    [bands]
    dp_exposed = [0.04, 0.03]     # 4% of the step, +-3 points
    pp_bubble = [0.20, 0.05]

`threefold report RUN --write-bands FILE` writes one from a run's measured spans (the tuned run
is the expectation): per category the mean share over its report lines, +- max(BAND_FLOOR,
BAND_SIGMAS standard deviations). `threefold train --log.bands FILE` then checks, on every report
step (every log.interval steps, where rank 0 already holds every rank's spans), the shares of the
critical rank (the most own work, analysis.prescribe) against the bands, and names each category
that has been outside its band for PERSIST report lines in a row (a busy host makes single lines
jump: measured, one line in six of a clean run) with the first report step it left it:
"dp_exposed 18% of the step vs expected 4+-3% since step 300: DP link slower than calibrated?".
The alerts go into the metrics line
(`band_alerts`, [] when all is in band) and onto stderr once per excursion; `threefold report`
shows them. The first report window, which holds the start-up step, is not checked.

The same bands, written as a Prometheus alerting-rules file (`rules_yaml`; --write-bands writes
FILE's .rules.yml beside FILE), check the endpoint of observe/prometheus.py where the cluster's
monitoring already looks: one alert per category, ThreefoldBand_<category>, while
threefold_category_share leaves share +- width for `for` (the report lines the in-run check
waits), and ThreefoldFinding while the in-run diagnosis names a link, rank, node, layer or change.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from threefold.errors import ConfigError
from threefold.observe.spans import CATEGORIES, OWN

BAND_SIGMAS = 4.0
BAND_FLOOR = 0.03  # three points of the step: what a busy shared host moves a share by
PERSIST = 2  # report lines in a row outside the band before it is named: one noisy line is not
HINTS = {
    "forward": "compute slower than calibrated (another job on the device, throttling)?",
    "backward": "compute slower than calibrated (another job on the device, throttling)?",
    "weight_grad": "compute slower than calibrated?",
    "recompute": "recompute setting changed, or compute slower?",
    "tp_comm": "TP link slower than calibrated?",
    "cp_comm": "CP link slower, or ring blocks too small to hide their transfer?",
    "pp_p2p": "PP link slower than calibrated?",
    "pp_bubble": "a slower pipeline stage, or fewer micro-batches?",
    "dp_exposed": "DP link slower than calibrated, or a slower dp peer?",
    "ep_a2a": "expert load imbalanced, or EP link slower?",
    "sync": "a slower rank the step's reductions wait for?",
    "data_wait": "data source slower than the step?",
    "optimizer": "a slower rank the optimizer's reduction waits for?",
    "checkpoint": "storage slower, or checkpoints more often?",
    "eval": "evaluation more often or longer?",
    "other": "host work outside the spans (an injected slowdown, Python, logging)?",
}


@dataclass(frozen=True)
class Band:
    """One category's expectation."""

    share: float
    """Expected fraction of the step."""
    width: float
    """Half-width: a share outside share +- width leaves the band."""


def read_bands(path: str, key: str = "log.bands") -> dict[str, Band]:
    """The [bands] table of `path`; one ConfigError line naming `key` for anything wrong."""
    from threefold.config import read_toml_file

    table = read_toml_file(path, key).get("bands")
    if not isinstance(table, dict) or not table:
        raise ConfigError(key, f"{path} has no [bands] table", "e.g. [bands] dp_exposed = [0.04, 0.03]")
    out = {}
    for name, value in table.items():
        if name not in CATEGORIES:
            raise ConfigError(f"{key}: {path}: {name}", "unknown category", "valid: " + ", ".join(CATEGORIES))
        ok = isinstance(value, list) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value)
        if not ok or not (0 <= value[0] <= 1 and 0 < value[1] <= 1):
            raise ConfigError(
                f"{key}: {path}: {name}", f"{value!r} is not [share, width]", "two fractions, e.g. [0.04, 0.03]"
            )
        out[name] = Band(float(value[0]), float(value[1]))
    return out


def bands_toml(bands: dict[str, Band], comment: str = "") -> str:
    lines = [f"# {line}" for line in comment.splitlines()] + ["[bands]"]
    lines += [f"{name} = [{b.share:.4f}, {b.width:.4f}]" for name, b in bands.items()]
    return "\n".join(lines) + "\n"


def critical_shares(ranks: list[dict]) -> dict[str, float]:
    """Each category's share of the step on the rank with the most own work (`ranks`: dicts
    with "time_s" per category and "wall_s", as spans.jsonl has them)."""
    r = max(ranks, key=lambda e: sum(e["time_s"].get(c, 0.0) for c in OWN))
    wall = r.get("wall_s") or sum(r["time_s"].values())
    return {c: r["time_s"].get(c, 0.0) / wall for c in CATEGORIES} if wall > 0 else {}


def bands_from_run(run) -> dict[str, Band]:
    """Bands from a run directory's spans (analysis.rundir.Run), its steady report lines."""
    rows = [critical_shares(line["ranks"]) for line in run.steady(run.spans) if line.get("ranks")]
    rows = [r for r in rows if r]
    if not rows:
        return {}
    out = {}
    for c in CATEGORIES:
        values = [r[c] for r in rows]
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        out[c] = Band(statistics.fmean(values), max(BAND_FLOOR, BAND_SIGMAS * spread))
    return out


def alert_text(alert: dict) -> str:
    return (
        f"{alert['category']} {alert['share']:.0%} of the step vs expected {alert['expected']:.0%}"
        f"+-{alert['width']:.0%} since step {alert['since']}: {HINTS.get(alert['category'], '')}"
    )


class BandCheck:
    """The logging rank's check of each report line against the bands."""

    def __init__(self, bands: dict[str, Band], persist: int = PERSIST):
        self.bands, self.persist = bands, persist
        self.since: dict[str, int] = {}  # category -> the report step it left its band
        self.lines: dict[str, int] = {}  # category -> report lines in a row outside its band

    def check(self, step: int, window: int, shares: dict[str, float]) -> list[dict] | None:
        """Alerts for the report line of `step` averaging `window` steps; None when the line
        holds the first step (start-up) and is not checked."""
        if step - window < 1:
            return None
        alerts = []
        for name, band in self.bands.items():
            share = shares.get(name, 0.0)
            if abs(share - band.share) <= band.width:
                self.since.pop(name, None)
                self.lines.pop(name, None)
                continue
            since = self.since.setdefault(name, step)
            self.lines[name] = self.lines.get(name, 0) + 1
            if self.lines[name] < self.persist:
                continue
            alerts.append(
                {
                    "category": name,
                    "share": share,
                    "expected": band.share,
                    "width": band.width,
                    "since": since,
                    "lines": self.lines[name],
                }
            )
        return alerts


def write_bands(path: str | Path, bands: dict[str, Band], comment: str = "") -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(bands_toml(bands, comment), encoding="utf-8")
    tmp.replace(p)
    return p


def _quoted(text: str) -> str:
    """A single-quoted YAML scalar: no escapes but the doubled quote, so PromQL's double quotes
    and the templates' braces pass as they are."""
    return "'" + text.replace("'", "''") + "'"


def _duration(seconds: float) -> str:
    return f"{max(0, math.ceil(seconds))}s"


def band_expr(name: str, band: Band) -> str | None:
    """PromQL true while the category's share is outside its band; None for a band that no
    share (0..1) can leave."""
    series = f'threefold_category_share{{category="{name}"}}'
    lo, hi = band.share - band.width, band.share + band.width
    parts = ([f"{series} > {hi:.6g}"] if hi < 1 else []) + ([f"{series} < {lo:.6g}"] if lo > 0 else [])
    return " or ".join(parts) or None


def rules_yaml(bands: dict[str, Band], for_s: float = 0.0, comment: str = "") -> str:
    """A Prometheus alerting-rules file (promtool check rules accepts it) for `bands`: alert
    ThreefoldBand_<category> once the share has been outside its band for `for_s` seconds, and
    ThreefoldFinding while threefold_finding names something."""
    lines = [f"# {line}" for line in comment.splitlines()]
    lines += ["groups:", "  - name: threefold_bands", "    rules:"]
    for name, band in bands.items():
        expr = band_expr(name, band)
        if expr is None:
            continue
        expected = f"{100 * band.share:.3g}%+-{100 * band.width:.3g}%"
        lines += [
            f"      - alert: ThreefoldBand_{name}",
            f"        expr: {_quoted(expr)}",
            f"        for: {_duration(for_s)}",
            "        labels:",
            "          severity: 'warning'",
            f"          category: {_quoted(name)}",
            "        annotations:",
            f"          summary: {_quoted(f'threefold: {name} left its band ({expected} of the step)')}",
            "          description: "
            + _quoted(
                f"{name} is {{{{ $value | humanizePercentage }}}} of the step on {{{{ $labels.instance }}}} "
                f"vs expected {expected}: {HINTS.get(name, '')}"
            ),
        ]
    lines += [
        "  - name: threefold_findings",
        "    rules:",
        "      - alert: ThreefoldFinding",
        f"        expr: {_quoted('threefold_finding > 0')}",
        "        labels:",
        "          severity: 'warning'",
        "        annotations:",
        f"          summary: {_quoted('threefold names {{ $labels.kind }}: {{ $labels.key }}')}",
        "          description: "
        + _quoted("the in-run diagnosis on {{ $labels.instance }} names {{ $labels.kind }} {{ $labels.key }}"),
    ]
    return "\n".join(lines) + "\n"


def rules_path(bands_path: str | Path) -> Path:
    """Where --write-bands FILE puts the rules: FILE with .rules.yml for its suffix."""
    p = Path(bands_path)
    return p.with_name(p.stem + ".rules.yml" if p.suffix else p.name + ".rules.yml")


def write_rules(path: str | Path, bands: dict[str, Band], for_s: float = 0.0, comment: str = "") -> Path:
    """rules_yaml into `path`, whole or not at all."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(rules_yaml(bands, for_s, comment), encoding="utf-8")
    tmp.replace(p)
    return p
