"""What a run did, from its directory: throughput, MFU/HFU, where the time went, and who was slow.

Figures are over the steady steps (all but the first, which pays start-up costs) unless the run
has only one. Time categories are seconds per step, mean over ranks (metrics.jsonl `time_s`),
and per rank from spans.jsonl.
"""

from __future__ import annotations

import statistics
from types import SimpleNamespace

from threefold.analysis.rundir import Run
from threefold.model.flops import hardware_flops_per_token, train_flops_per_token
from threefold.observe.spans import CATEGORIES, OWN

STRAGGLER_MARGIN = 0.10  # a rank whose busy time is this much above the median is named


def _mean(values):
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.fmean(values) if values else None


def _median(values):
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


def hfu_ratio(config: dict) -> float | None:
    """Hardware over model FLOPs for the run's recompute setting (1.0 without recompute)."""
    m, t, p = config.get("model", {}), config.get("train", {}), config.get("parallel", {})
    try:
        model = SimpleNamespace(**m)
        mode = t.get("recompute", "none")
        ratio = hardware_flops_per_token(model, recompute=mode) / train_flops_per_token(model)
    except (TypeError, ValueError, ZeroDivisionError, AttributeError):
        return None
    layers, covered = m.get("layers", 0), t.get("recompute_layers", 0)
    if mode == "full" and covered and layers:  # only the first N blocks of each stage rerun
        per_stage = layers / max(1, p.get("pp", 1) * p.get("vpp", 1))
        ratio = 1 + (ratio - 1) * min(1.0, covered / per_stage)
    return ratio


def breakdown(records: list[dict]) -> dict[str, float]:
    """Mean seconds per step of every category (mean over ranks), from metrics lines."""
    rows = [r["time_s"]["mean"] for r in records if isinstance(r.get("time_s"), dict) and "mean" in r["time_s"]]
    return {c: _mean([row.get(c) for row in rows]) or 0.0 for c in CATEGORIES} if rows else {}


def per_rank(run: Run) -> dict[int, dict]:
    """rank -> {"wall_s", "time_s": {category: mean seconds}, "comm_bytes", "comm_calls", coords}
    over steady steps."""
    out: dict[int, dict] = {}
    for line in run.steady(run.spans):
        for r in line["ranks"]:
            entry = out.setdefault(
                r["rank"],
                {"walls": [], "rows": [], "comm_bytes": [], "comm_calls": [], "coords": _coords(r)},
            )
            entry["walls"].append(r.get("wall_s", 0.0))
            entry["rows"].append(r.get("time_s", {}))
            for key in ("comm_bytes", "comm_calls"):
                entry[key].append(r.get(key, {}))
    for entry in out.values():
        rows = entry.pop("rows")
        entry["wall_s"] = _mean(entry.pop("walls")) or 0.0
        entry["time_s"] = {c: _mean([row.get(c) for row in rows]) or 0.0 for c in CATEGORIES}
        for key in ("comm_bytes", "comm_calls"):
            per_step = entry[key]
            entry[key] = {g: _mean([b.get(g) for b in per_step]) or 0.0 for g in (per_step[0] if per_step else {})}
    return dict(sorted(out.items()))


def _coords(r: dict) -> dict:
    return {k: r[k] for k in ("tp", "pp", "dp", "ep") if k in r}


def stragglers(ranks: dict[int, dict]) -> list[tuple[int, float, str]]:
    """Ranks busy (their own work: OWN) more than STRAGGLER_MARGIN above the median: (rank, excess
    fraction, the category that grew most against the median rank)."""
    if len(ranks) < 2:
        return []
    busy = {r: sum(e["time_s"][c] for c in OWN) for r, e in ranks.items()}
    med = statistics.median(busy.values())
    if med <= 0:
        return []
    out = []
    for r, b in busy.items():
        if b > med * (1 + STRAGGLER_MARGIN):
            med_cat = {c: statistics.median(e["time_s"][c] for e in ranks.values()) for c in OWN}
            worst = max(OWN, key=lambda c: ranks[r]["time_s"][c] - med_cat[c])
            out.append((r, b / med - 1, worst))
    return sorted(out, key=lambda x: -x[1])


def _keys_like(records: list[dict], words: tuple[str, ...]) -> dict[str, float]:
    found: dict[str, list] = {}
    for r in records:
        for k, v in r.items():
            if any(w in k for w in words) and isinstance(v, (int, float)) and not isinstance(v, bool):
                found.setdefault(k, []).append(v)
    return {k: statistics.fmean(v) for k, v in found.items()}


def summarize(run: Run) -> dict:
    steady = run.steady(run.metrics)
    cfg = run.config
    p = cfg.get("parallel", {})
    out = {
        "name": run.name,
        "steps": run.metrics[-1].get("step"),
        "layout": _layout(cfg),
        "step_time_s": _median([r.get("step_time_s") for r in steady]),
        "tokens_per_s": _median([r.get("tokens_per_s") for r in steady]),
        "mfu": _median([r.get("mfu") for r in steady]),
        "loss_first": run.metrics[0].get("loss"),
        "loss_last": run.metrics[-1].get("loss"),
        "breakdown": breakdown(steady),
        "wall_s": _mean([r.get("span_step_s", {}).get("mean") for r in steady]),
        "bubble_theory": run.metrics[-1].get("pp_bubble_theory") if p.get("pp", 1) > 1 else None,
        "comm_bytes": {},
        "dp_comm_serial_s": _mean([r.get("dp_comm_serial_s") for r in run.metrics]),
        "cp_comm_serial_s": _mean([r.get("cp_comm_serial_s") for r in run.metrics]),
        "dp_gather_serial_s": _mean([r.get("dp_gather_serial_s") for r in run.metrics]),
        "dp_gather_hidden": _mean([r.get("dp_gather_hidden", {}).get("mean") for r in run.metrics]),
        "gather_wait_s": _mean([r.get("zero3_gather_wait_s", r.get("param_gather_wait_s")) for r in steady]),
        "cp_hidden": _mean([r.get("cp_hidden", {}).get("mean") for r in run.metrics]),
        "cp_hidden_own": _mean([r.get("cp_hidden_own", {}).get("mean") for r in run.metrics]),
        "per_rank": per_rank(run),
        "notes": list(run.notes),
        "zero": p.get("zero", 0) if p.get("dp", 1) > 1 else 0,
    }
    ratio = hfu_ratio(cfg)
    out["hfu"] = out["mfu"] * ratio if out["mfu"] is not None and ratio is not None else None
    for key in ("comm_bytes", "comm_calls"):
        rows = [r[key] for r in steady if isinstance(r.get(key), dict)]
        out[key] = {g: _mean([b.get(g) for b in rows]) for g in rows[0]} if rows else {}
    b, wall = out["breakdown"], out["wall_s"]
    out["bubble_measured"] = b["pp_bubble"] / wall if b and wall else None
    out["stragglers"] = stragglers(out["per_rank"])
    out["band_alerts"] = band_alerts(run.metrics)
    out["experts"] = _keys_like(steady, ("expert", "imbalance"))
    out["goodput"] = _keys_like(run.metrics[-1:], ("goodput",)) or {
        k: v for k, v in run.info.get("extra", {}).items() if "goodput" in k and isinstance(v, (int, float))
    }
    out["ledger"] = ledger_shares(run.ledger)
    return out


LEDGER = ("productive", "lost", "detect", "restart", "preflight", "load", "rewarm", "checkpoint", "skipped", "other")
"""The goodput ledger's categories (observe/goodput.py), in the order the report stacks them."""


def ledger_shares(ledger: list[dict]) -> dict | None:
    """The run's wall time by ledger category at its last progress line (seconds), with the
    number of attempts; None without a ledger. Pre-flight counts every attempt's; recovery is
    split into its parts; the rest (the first start-up, logging) is other."""
    progress = [line for line in ledger if line.get("event") == "progress"]
    if not progress:
        return None
    last = progress[-1]
    seconds = ledger_seconds(last)
    return {"seconds": seconds, "wall_s": last["wall_s"], "attempts": sum(e.get("event") == "attempt" for e in ledger)}


def ledger_seconds(line: dict) -> dict[str, float]:
    """One progress line's seconds per LEDGER category (they add up to its wall_s)."""
    out = {k: line.get(f"{k}_s", 0.0) for k in LEDGER}
    out["preflight"] = line.get("preflight_total_s", 0.0)
    out["other"] = line.get("other_s", 0.0) - (out["preflight"] - line.get("preflight_s", 0.0))
    return out


def band_alerts(records: list[dict]) -> dict | None:
    """log.bands: the lines checked, and per category its latest excursion's alert (the last
    line that named it); None when the run checked no bands."""
    checked = [r for r in records if isinstance(r.get("band_alerts"), list)]
    if not checked:
        return None
    latest: dict[str, dict] = {}
    for r in checked:
        for a in r["band_alerts"]:
            latest[a["category"]] = {**a, "last": r["step"]}
    return {"lines": len(checked), "alerts": latest}


def _layout(cfg: dict) -> str:
    p = cfg.get("parallel", {})
    text = f"tp{p.get('tp', 1)} pp{p.get('pp', 1)} dp{p.get('dp', 1)}"
    if p.get("ep", 1) > 1:
        text += f" ep{p['ep']}"
    if p.get("pp", 1) > 1:
        text += f" {p.get('schedule')}" + (f" vpp{p['vpp']}" if p.get("vpp", 1) > 1 else "")
        text += f" m{p.get('microbatches')}"
    if p.get("zero"):
        text += f" zero{p['zero']}"
    return text


def _pct(x):
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _ms(x):
    return "n/a" if x is None else f"{1e3 * x:.2f} ms"


def _bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def format_summary(s: dict) -> str:
    lines = [
        f"run {s['name']}: {s['layout']}, {s['steps']} steps",
        f"  step time {_ms(s['step_time_s'])} (median)   tokens/s {s['tokens_per_s'] or 0:,.0f}   "
        f"MFU {_pct(s['mfu'])}   HFU {_pct(s['hfu'])}",
        f"  loss {s['loss_first']:.4f} -> {s['loss_last']:.4f}" if s["loss_first"] is not None else "  loss n/a",
    ]
    b, wall = s["breakdown"], s["wall_s"]
    if not b:
        lines.append("  no time breakdown: the run had log.spans off (rerun with --log.spans true)")
    else:
        lines.append(f"  where the time went (per step, mean over ranks; {_ms(wall)} observed):")
        for c in CATEGORIES:
            if b[c] > 5e-4 * wall:  # leave out what rounds to nothing
                lines.append(f"    {c:<12} {_ms(b[c]):>12} {_pct(b[c] / wall if wall else None):>7}")
        if s["bubble_theory"] is not None:
            lines.append(
                f"  pipeline bubble: measured {_pct(s['bubble_measured'])} of the step, "
                f"theory {_pct(s['bubble_theory'])}"
            )
        exposed = sum(b[c] for c in ("tp_comm", "cp_comm", "pp_p2p", "dp_exposed", "ep_a2a"))
        lines.append(
            f"  exposed communication: {_ms(exposed)} ({_pct(exposed / wall if wall else None)}): "
            f"tp {_ms(b['tp_comm'])}, cp {_ms(b['cp_comm'])}, pp {_ms(b['pp_p2p'])}, dp {_ms(b['dp_exposed'])}, "
            f"ep {_ms(b['ep_a2a'])}"
        )
        if s["dp_comm_serial_s"] and s["zero"] == 3:
            lines.append(
                f"  dp gradient reduction: {_ms(s['dp_comm_serial_s'])} if run blocking "
                f"(dp_exposed also holds ZeRO-3's parameter-gather waits)"
            )
        elif s["dp_comm_serial_s"]:
            hidden = 1 - b["dp_exposed"] / s["dp_comm_serial_s"]
            lines.append(
                f"  dp gradient communication: {_ms(s['dp_comm_serial_s'])} if run blocking, "
                f"{_ms(b['dp_exposed'])} exposed ({_pct(max(0.0, hidden))} hidden; exposed includes "
                "waiting for a slower dp peer)"
            )
        if s.get("dp_gather_hidden") is not None:
            lines.append(
                f"  ZeRO parameter gathers: {_ms(s['dp_gather_serial_s'])} if run blocking, "
                f"{_pct(s['dp_gather_hidden'])} of it hidden (traced steps, mean over ranks)"
            )
        if s.get("cp_hidden") is not None:
            own = s.get("cp_hidden_own")
            lines.append(
                f"  cp ring exchanges: {_ms(s['cp_comm_serial_s'])} if run alone, "
                f"{_pct(s['cp_hidden'])} of it hidden behind attention (traced steps, mean over ranks"
                + (f"; {_pct(own)} once waits for a slower cp peer are set aside)" if own is not None else ")")
            )
    if s["comm_bytes"]:
        sent = ", ".join(f"{g} {_bytes(v)}" for g, v in s["comm_bytes"].items() if v)
        if not sent:  # every group is recorded, but a lone process has no peer to send to
            sent = "none (one process)" if len(s["per_rank"]) == 1 else "none"
        lines.append(f"  bytes per step per rank: {sent}")
    if s["per_rank"]:
        slow = s["stragglers"]
        if slow:
            for r, excess, cat in slow:
                lines.append(f"  straggler: rank {r} works {_pct(excess)} longer than the median rank (mostly {cat})")
        else:
            lines.append(
                f"  stragglers: none (every rank within {_pct(STRAGGLER_MARGIN)} of the median rank's own work)"
            )
    bands = s.get("band_alerts")
    if bands:
        from threefold.observe.bands import alert_text

        for a in bands["alerts"].values():
            lines.append(f"  out of band: {alert_text(a)} (last named at step {a['last']})")
        if not bands["alerts"]:
            lines.append(f"  bands: every category within its band ({bands['lines']} report lines checked)")
    for k, v in s["experts"].items():
        lines.append(f"  {k}: {v:.3f} (mean)")
    for k, v in s["goodput"].items():
        lines.append(f"  {k}: {v:.3f}")
    ledger = s.get("ledger")
    if ledger:
        shown = ", ".join(f"{k} {v:.1f}" for k, v in ledger["seconds"].items() if v > 0.05 or k == "productive")
        lines.append(f"  goodput ledger, {ledger['attempts']} attempt(s), {ledger['wall_s']:.1f} s: {shown} (s)")
    for note in s["notes"]:
        lines.append(f"  note: {note}")
    return "\n".join(lines)
