"""How far each predicted time category was from measurement, and how a plan says so.

`threefold plan --calibrate` compares every category it can measure (the spans of runs trained
with `log.spans`) with the fitted prediction, on every run it was given, fitted and held out.
The spread of `predicted / measured - 1` over those runs is the category's error band. A
profile written by `--save-profile` keeps the bands in a `[validation]` table; a plan made with
it prints a category whose band leaves +-25% with the band beside it, and names the categories
no measurement has checked. Without a calibrated profile the split is the cost model's
estimate, and the plan says that instead of printing it as if it were measured.
"""

from __future__ import annotations

from typing import NamedTuple

from threefold.errors import ConfigError

TOLERANCE = 0.25
# Measured quantity of a calibration row -> the name its band is kept under. Compute,
# recompute, host overhead and the bubble are one measured group (calibrate.SPANS).
MEASURED_AS = {
    "step": "step",
    "span_work_s": "work",
    "span_tp_comm_s": "tp_comm",
    "span_cp_comm_s": "cp_comm",
    "span_ep_comm_s": "ep_comm",
    "span_pp_comm_s": "pp_comm",
    "span_dp_comm_s": "dp_comm",
    "span_optimizer_s": "optimizer",
}
# Predicted category (cost.CATEGORIES) -> the band that covers it.
BAND_OF = {
    "compute": "work",
    "recompute": "work",
    "overhead": "work",
    "bubble": "work",
    "tp_comm": "tp_comm",
    "cp_comm": "cp_comm",
    "ep_comm": "ep_comm",
    "pp_comm": "pp_comm",
    "dp_comm": "dp_comm",
    "optimizer": "optimizer",
}
NAMES = tuple(dict.fromkeys(MEASURED_AS.values()))


class Band(NamedTuple):
    """predicted / measured - 1 over the runs that measured a category: lowest, highest, runs."""

    lo: float
    hi: float
    runs: int

    @property
    def within(self) -> bool:
        return max(abs(self.lo), abs(self.hi)) <= TOLERANCE

    def text(self) -> str:
        lo, hi = (f"{x:+.0%}" if round(x * 100) else "+0%" for x in (self.lo, self.hi))
        return lo if lo == hi else f"{lo}..{hi}"


def bands_from_rows(rows) -> dict[str, Band]:
    """Error bands of a calibration's rows (calibrate.Row: category, measured, fitted)."""
    out: dict[str, Band] = {}
    for row in rows:
        name = MEASURED_AS.get(row.category)
        if name is None or row.measured <= 0:
            continue
        err = row.fitted / row.measured - 1
        old = out.get(name, Band(err, err, 0))
        out[name] = Band(min(old.lo, err), max(old.hi, err), old.runs + 1)
    return out


def read_table(table, path: str) -> dict[str, Band]:
    """A profile's [validation] table: name = [lo, hi, runs]."""
    if not isinstance(table, dict):
        raise ConfigError("cluster.profile", f"{path}: [validation] must be a table of name = [lo, hi, runs]")
    out = {}
    for name, value in table.items():
        if name not in NAMES:
            raise ConfigError(f"{path}: validation.{name}", "unknown category", "valid: " + ", ".join(NAMES))
        ok = isinstance(value, list) and len(value) == 3 and all(isinstance(v, (int, float)) for v in value)
        if not ok or value[0] > value[1]:
            raise ConfigError(
                f"{path}: validation.{name}",
                f"{value!r} is not [lowest error, highest error, runs]",
                "e.g. [-0.12, 0.08, 9]",
            )
        out[name] = Band(float(value[0]), float(value[1]), int(value[2]))
    return out


def toml_lines(bands: dict[str, Band]) -> list[str]:
    """The [validation] table of a saved profile (nothing when there are no bands)."""
    if not bands:
        return []
    lines = ["", "# predicted / measured - 1 of each category after calibration: lowest, highest, runs", "[validation]"]
    return lines + [f"{name} = [{b.lo:.4f}, {b.hi:.4f}, {b.runs}]" for name, b in bands.items()]


def annotation(category: str, bands: dict[str, Band]) -> str:
    """What follows a predicted category's share: its error band when that leaves +-25%, a
    mark when no measurement covered it, nothing when it was validated within 25%."""
    if not bands:
        return ""
    band = bands.get(BAND_OF.get(category, ""))
    if band is None:
        return " (not validated)"
    return "" if band.within else f" (calibration error {band.text()})"


def split_note(bands: dict[str, Band], categories) -> str:
    """One line under a plan's table: how far to trust the per-category shares."""
    if not bands:
        return (
            "the per-category shares are the cost model's estimate: no calibration has checked them on this "
            "cluster (threefold plan --calibrate RUN_DIR ... --save-profile FILE, docs/planner.md)"
        )
    used = list(dict.fromkeys(BAND_OF[c] for c in categories if c in BAND_OF))
    good = [n for n in used if n in bands and bands[n].within]
    off = [f"{n} {bands[n].text()}" for n in used if n in bands and not bands[n].within]
    missing = [n for n in used if n not in bands]
    parts = [f"within {TOLERANCE:.0%} of measured in calibration: {', '.join(good) or 'none'}"]
    if off:
        parts.append("outside, with the error band calibration measured (predicted / measured - 1): " + ", ".join(off))
    if missing:
        parts.append("not measured by any calibration run: " + ", ".join(missing))
    return "per-category shares " + "; ".join(parts)
