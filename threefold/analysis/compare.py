"""Run over run: two runs' breakdowns side by side, the biggest change, and what differs in their
configs. Categories are compared by their share of the step (mean over ranks, steady steps),
in percentage points: a run that is slower across the board (another job on the machine)
does not make every category look changed; the ms per step are printed next to it.
"""

from __future__ import annotations

import math

import numpy as np

from threefold.analysis.intervals import Interval, bootstrap
from threefold.analysis.summary import _bytes, _ms, _pct
from threefold.observe.spans import CATEGORIES, COMM, COMPUTE

WAITING = COMM + ("data_wait",)
"""Communication and waiting: where a layout or schedule change shows first."""

IGNORED_KEYS = {"log.dir", "log.quiet", "log.interval", "data.cache_dir", "checkpoint.dir", "log.trace_steps"}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_diff(a: dict, b: dict) -> list[tuple[str, object, object]]:
    fa, fb = _flat(a), _flat(b)
    return [
        (k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k) and k not in IGNORED_KEYS
    ]


def family(category: str) -> str:
    if category in COMPUTE:
        return "compute"
    if category == "pp_bubble":
        return "pipeline bubble"
    if category in COMM:
        return "communication"
    return "host"


def shares(breakdown: dict) -> dict:
    """Each category's fraction of the step (the categories partition it)."""
    total = sum(breakdown.values())
    return {c: v / total for c, v in breakdown.items()} if total > 0 else dict.fromkeys(breakdown, 0.0)


def biggest_change(ba: dict, bb: dict, among=CATEGORIES) -> tuple[str, float] | None:
    """(category, change of its share of the step) with the largest change, among `among`."""
    sa, sb = shares(ba), shares(bb)
    changes = {c: sb.get(c, 0.0) - sa.get(c, 0.0) for c in among}
    if not changes:
        return None
    c = max(changes, key=lambda k: abs(changes[k]))
    return c, changes[c]


def _change_text(category: str, delta: float, ba: dict, bb: dict) -> str:
    sa, sb = shares(ba), shares(bb)
    return (
        f"{category} {100 * sa[category]:.1f}% -> {100 * sb[category]:.1f}% of the step "
        f"({100 * delta:+.1f} points; {_ms(ba[category])} -> {_ms(bb[category])} per step), "
        f"{family(category)}"
    )


def _steady(run, key: str) -> list[float]:
    return [r[key] for r in run.steady(run.metrics) if isinstance(r.get(key), (int, float)) and r[key] > 0]


def _category_shares(run, category: str) -> list[float]:
    """The category's share of the step on each metrics line that carries a breakdown."""
    out = []
    for r in run.steady(run.metrics):
        row = r.get("time_s", {}).get("mean") if isinstance(r.get("time_s"), dict) else None
        if row and sum(row.values()) > 0:
            out.append(row.get(category, 0.0) / sum(row.values()))
    return out


def _ratio_of_medians(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.median(b, axis=-1) / np.median(a, axis=-1)


def _difference_of_means(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return b.mean(axis=-1) - a.mean(axis=-1)


def noise_verdict(interval: Interval, none: float) -> str:
    """Whether the 95% interval of a change excludes `none` (what no change would read)."""
    if not math.isfinite(interval.lo):
        return "too few steps to tell from noise"
    return "beyond the per-step noise" if not interval.lo <= none <= interval.hi else "within the per-step noise"


def noise_lines(run_a, run_b, category: str | None) -> tuple[list[str], dict]:
    """Intervals from the per-step variation of each run: tokens/s B/A (ratio of medians) and,
    for `category`, the change of its share of the step (difference of means over the lines
    that carry a breakdown). Steps of one run are not independent draws (drift, a neighbour's
    load), so an interval that excludes no change says the change is larger than the run's own
    step-to-step variation, not that a rerun will reproduce it."""
    lines, found = [], {}
    ta, tb = _steady(run_a, "tokens_per_s"), _steady(run_b, "tokens_per_s")
    if ta and tb:
        i = bootstrap([ta, tb], _ratio_of_medians, f"ratio of medians, {len(ta)} and {len(tb)} steps")
        found["tokens_per_s_ratio"] = i
        lines.append(
            f"tokens/s B/A {i.value:.3f} [{i.lo:.3f}, {i.hi:.3f}] (95%, {len(ta)} and {len(tb)} steady steps): "
            + noise_verdict(i, 1.0)
        )
    if category:
        sa, sb = _category_shares(run_a, category), _category_shares(run_b, category)
        if sa and sb:
            i = bootstrap([sa, sb], _difference_of_means, f"difference of means, {len(sa)} and {len(sb)} lines")
            found["biggest_share_change"] = i
            lines.append(
                f"{category} share {100 * i.value:+.1f} points [{100 * i.lo:+.1f}, {100 * i.hi:+.1f}] "
                f"(95%, {len(sa)} and {len(sb)} report lines): " + noise_verdict(i, 0.0)
            )
    return lines, found


def compare(a: dict, b: dict, config_a: dict, config_b: dict, run_a=None, run_b=None) -> tuple[str, dict]:
    """Text comparing two summaries (analysis.summary.summarize), and the figures it names; with
    the runs (analysis.rundir.Run), intervals that tell a real change from run-to-run noise."""
    lines = [f"A: {a['name']}  {a['layout']}", f"B: {b['name']}  {b['layout']}", ""]
    lines.append(f"{'':<22}{'A':>14}{'B':>14}{'change':>12}")

    def row(label, va, vb, fmt):
        change = ""
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va:
            rel = (vb - va) / va
            change = f"{rel:+.1%}" if rel < 10 else f"x{vb / va:,.0f}"
        lines.append(f"{label:<22}{fmt(va):>14}{fmt(vb):>14}{change:>12}")

    row("step time", a["step_time_s"], b["step_time_s"], _ms)
    row("tokens/s", a["tokens_per_s"], b["tokens_per_s"], lambda x: "n/a" if x is None else f"{x:,.0f}")
    row("MFU", a["mfu"], b["mfu"], _pct)
    ba, bb = a["breakdown"], b["breakdown"]
    found = {}
    if ba and bb:
        lines.append("time per step by category (mean over ranks), and share of the step:")
        sa, sb = shares(ba), shares(bb)
        for c in CATEGORIES:
            if ba[c] or bb[c]:
                row(f"  {c}", ba[c], bb[c], _ms)
                lines[-1] += f"   {100 * sa[c]:5.1f}% -> {100 * sb[c]:5.1f}%"
        big = biggest_change(ba, bb)
        waiting = biggest_change(ba, bb, WAITING)
        found = {"biggest": big, "biggest_waiting": waiting}
        lines.append("")
        lines.append("biggest change: " + _change_text(big[0], big[1], ba, bb))
        lines.append("biggest communication/idle change: " + _change_text(waiting[0], waiting[1], ba, bb))
    else:
        missing = [s["name"] for s in (a, b) if not s["breakdown"]]
        lines.append(f"no time breakdown for {', '.join(missing)} (run with --log.spans true)")
    if a["bubble_theory"] is not None or b["bubble_theory"] is not None:
        lines.append(
            f"pipeline bubble: A {_pct(a['bubble_measured'])} (theory {_pct(a['bubble_theory'])}) -> "
            f"B {_pct(b['bubble_measured'])} (theory {_pct(b['bubble_theory'])})"
        )
    groups = [
        g
        for g in dict.fromkeys([*a["comm_bytes"], *b["comm_bytes"]])
        if a["comm_bytes"].get(g) or b["comm_bytes"].get(g)
    ]
    if groups:
        lines.append(
            "bytes per step per rank: "
            + ", ".join(
                f"{g} {_bytes(a['comm_bytes'].get(g) or 0)} -> {_bytes(b['comm_bytes'].get(g) or 0)}" for g in groups
            )
        )
        g = max(groups, key=lambda k: abs((b["comm_bytes"].get(k) or 0) - (a["comm_bytes"].get(k) or 0)))
        delta = (b["comm_bytes"].get(g) or 0) - (a["comm_bytes"].get(g) or 0)
        if delta:
            found["biggest_bytes"] = (g, delta)
            lines.append(
                f"biggest byte change: {g} group {'+' if delta > 0 else '-'}{_bytes(abs(delta))} per step per rank"
            )
    if run_a is not None and run_b is not None:
        big = found.get("biggest")
        more, intervals = noise_lines(run_a, run_b, big[0] if big else None)
        found.update(intervals)
        lines += [""] + more if more else []
    diff = config_diff(config_a, config_b)
    lines.append("")
    if diff:
        lines.append("config differences (A -> B):")
        lines += [f"  {k}: {va!r} -> {vb!r}" for k, va, vb in diff]
    else:
        lines.append("config: identical")
    return "\n".join(lines), found
