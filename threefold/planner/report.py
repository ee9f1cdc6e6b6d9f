"""What `threefold plan` prints: the ranked table, the rejections, the calibration table, and JSON."""

from __future__ import annotations

import math

from threefold.config import ModelConfig
from threefold.model.flops import active_params
from threefold.planner.cluster import Cluster, GiB
from threefold.planner.faults import FaultAdvice
from threefold.planner.model import SHAPE_KEYS, ModelShape
from threefold.planner.overlap import overlap_lines
from threefold.planner.predict import Prediction
from threefold.planner.search import KIND_TITLES, Plan
from threefold.planner.validation import TOLERANCE, annotation, split_note

_SHORT = {
    "compute": "compute",
    "recompute": "recompute",
    "tp_comm": "TP comm",
    "cp_comm": "CP comm",
    "ep_comm": "EP all-to-all",
    "pp_comm": "PP comm",
    "dp_comm": "DP comm",
    "bubble": "bubble",
    "optimizer": "optimizer",
    "overhead": "overhead",
}


def _num(x: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.3g}"


def _plural(n: float, word: str) -> str:
    return f"{n:g} {word}" + ("" if n == 1 else ("es" if word.endswith("ch") else "s"))


def _columns(cols, rows, left) -> str:
    """Aligned text columns; left(i) says which are left-aligned."""
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]

    def fmt(row) -> str:
        return "  ".join(v.ljust(w) if left(i) else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths)))

    return "\n".join([fmt(cols)] + [fmt(r) for r in rows])


def _model_name(cfg: ModelConfig) -> str:
    from threefold.config import PRESETS

    preset = getattr(cfg, "preset", "")
    shape = PRESETS.get(preset, {})
    if shape and all(getattr(cfg, k, v) == v for k, v in shape.items()):
        return preset
    return f"{preset} with changed shape" if preset else "custom"


def header(shape: ModelShape, cluster: Cluster, global_batch: int, dtype: str) -> str:
    cfg = shape.cfg
    name = _model_name(cfg)
    experts = ""
    if shape.is_moe:
        every = getattr(cfg, "moe_every", 1)
        experts = (
            f" ({_num(active_params(cfg))} active: {shape.num_experts} experts, top-{shape.top_k}, "
            + ("every block" if every == 1 else f"every {every} blocks")
            + ")"
        )
    return (
        f"model {name}: {_num(shape.total_params)} parameters{experts}, {cfg.layers} layers, hidden {cfg.hidden}, "
        f"{cfg.heads} heads, seq {shape.seq_len}; cluster {cluster.label()} "
        f"({cluster.peak_tflops:.4g} TFLOP/s {dtype}, {cluster.usable_bytes / GiB:.1f} GiB usable per device); "
        f"global batch {global_batch} ({_num(global_batch * shape.seq_len)} tokens)"
    )


def split_text(pred: Prediction, bands: dict | None = None) -> str:
    """Shares of the step per category; with a calibrated profile's `bands`, each share whose
    category calibration found off by more than 25% carries that error band."""
    parts = sorted(((v, k) for k, v in pred.times.items() if v > 0), reverse=True)
    return ", ".join(
        f"{_SHORT[k]} {v / pred.step_time_s:.0%}{annotation(k, bands or {})}"
        for v, k in parts
        if v / pred.step_time_s >= 0.005
    )


def table(preds: list[Prediction], moe: bool = False, cp: bool = False) -> str:
    """One row per layout; `moe` adds the ep degree and the all-to-all's share, `cp` the
    context-parallel degree with its attention and the cp traffic's share."""
    cols = [
        "#",
        "tp",
        "pp",
        "dp",
        "vpp",
        "mbs",
        "sched",
        "zero",
        "sp",
        "recomp",
        "mem GiB",
        "step s",
        "tokens/s",
        "TFLOP/s",
        "MFU",
        "comp%",
        "tp%",
        "pp%",
        "dp%",
        "bub%",
        "other%",
    ]
    if moe:
        cols[4:4], cols[18:18] = ["ep"], ["ep%"]
    rows = []
    for i, p in enumerate(preds, 1):
        lay, f = p.layout, {k: v / p.step_time_s * 100 for k, v in p.times.items()}
        row = [
            str(i),
            str(lay.tp),
            str(lay.pp),
            str(lay.dp),
            str(lay.vpp),
            str(lay.mbs),
            lay.schedule,
            str(lay.zero),
            "y" if lay.sp else "n",
            lay.recompute,
            f"{p.memory.total / GiB:.1f}",
            f"{p.step_time_s:.4g}",
            _num(p.tokens_per_s),
            f"{p.model_tflops_per_device:.4g}",
            f"{p.mfu:.1%}",
            f"{f['compute'] + f['recompute']:.0f}",
            f"{f['tp_comm']:.0f}",
            f"{f['pp_comm']:.0f}",
            f"{f['dp_comm']:.0f}",
            f"{f['bubble']:.0f}",
            f"{f['optimizer'] + f['overhead']:.0f}",
        ]
        if moe:
            row[4:4], row[18:18] = [str(lay.ep)], [f"{f['ep_comm']:.0f}"]
        if cp:
            row.insert(cols.index("tp%") + 1, f"{f['cp_comm']:.0f}")
            row.insert(cols.index("dp") + 1, f"{lay.cp} {lay.cp_impl}" if lay.cp > 1 else "1")
        rows.append(tuple(row))
    if cp:
        cols.insert(cols.index("tp%") + 1, "cp%")
        cols.insert(cols.index("dp") + 1, "cp")
    left = {"sched", "recomp"}
    return _columns(cols, rows, lambda i: cols[i] in left)


def describe_prediction(p: Prediction, cluster: Cluster) -> str:
    m = p.memory
    lines = [
        f"layout {p.layout.spec()}",
        f"  {_plural(p.microbatches, 'micro-batch')} per step per data-parallel rank; links: TP {p.links['tp']}, "
        f"PP {p.links['pp']}, DP {p.links['dp']}"
        + (f", EP {p.links['ep']}" if p.layout.ep > 1 else "")
        + (f", CP {p.links['cp']}" if p.layout.cp > 1 else "")
        + "-node",
        f"  memory per device {m.total / GiB:.2f} GiB of {p.usable_bytes / GiB:.1f} usable on the {m.rank} "
        f"pipeline rank: params {m.params / GiB:.2f} + grads {m.grads / GiB:.2f} + optimizer "
        f"{m.optimizer / GiB:.2f} + activations {m.activations / GiB:.2f} ({_plural(m.inflight, 'micro-batch')} "
        f"in flight) + buffers {m.buffers / GiB:.2f}"
        + (f"; the experts' share of the model state {m.expert_state / GiB:.2f}" if m.expert_state else ""),
        f"  step {p.step_time_s:.4g} s [{p.intervals['step'][0]:.4g}-{p.intervals['step'][1]:.4g}"
        f"{'' if p.calibrated else ', uncalibrated'}], {_num(p.tokens_per_s)} tokens/s "
        f"[{_num(p.tokens_per_s_interval[0])}-{_num(p.tokens_per_s_interval[1])}], "
        f"{p.model_tflops_per_device:.4g} model TFLOP/s per device, MFU {p.mfu:.1%} (HFU {p.hfu:.1%}), "
        f"bubble {p.bubble_fraction:.1%} of the step",
        f"  time: {split_text(p, cluster.validation)}",
    ]
    if p.devices_used < cluster.world:
        lines.append(f"  uses {p.devices_used} of the cluster's {cluster.world} devices")
    return "\n".join(lines)


def rejections(plan: Plan, examples: int = 2) -> str:
    if not plan.rejected:
        return "nothing was rejected"
    lines = [f"rejected ({plan.rejected_count()} candidates):"]
    for kind, rej in sorted(plan.rejected.items(), key=lambda kv: -kv[1].count):
        lines.append(f"  {KIND_TITLES.get(kind, kind)}: {rej.count}")
        for spec, sentence in rej.best()[:examples]:
            lines.append(f"    {spec}: {sentence}")
    return "\n".join(lines)


def plan_text(plan: Plan, top: int, advice: FaultAdvice | None) -> str:
    shown = plan.ranked[:top]
    used = {k for p in shown for k, v in p.times.items() if v > 0}
    out = [
        header(plan.shape, plan.cluster, plan.global_batch, plan.dtype),
        f"searched {plan.considered} layouts in {plan.search_s:.2f} s; the {len(shown)} fastest that fit:",
        "",
        table(shown, plan.shape.is_moe, any(p.layout.cp > 1 for p in shown)),
        split_note(plan.cluster.validation, used),
        "",
        "best " + describe_prediction(plan.best, plan.cluster),
        *overlap_lines(plan.cluster),
    ]
    if advice:
        out.append("  faults: " + advice.sentence())
    out += ["", rejections(plan)]
    return "\n".join(out)


def plan_json(plan: Plan, top: int, advice: FaultAdvice | None, emitted: str | None = None) -> dict:
    return {
        "model": _model_dict(plan.shape),
        "cluster": cluster_dict(plan.cluster),
        "global_batch": plan.global_batch,
        "dtype": plan.dtype,
        "considered": plan.considered,
        "search_s": plan.search_s,
        "layouts": [p.as_dict() for p in plan.ranked[:top]],
        "rejected": [r.as_dict() for r in sorted(plan.rejected.values(), key=lambda r: -r.count)],
        "faults": advice.as_dict() if advice else None,
        "overlap": overlap_lines(plan.cluster),
        "emitted_config": emitted,
    }


def _model_dict(shape: ModelShape) -> dict:
    cfg = shape.cfg
    out = {k: getattr(cfg, k) for k in SHAPE_KEYS if hasattr(cfg, k)}
    out.update(params=shape.total_params, model_flops_per_token=shape.model_flops_per_token)
    if shape.is_moe:
        out.update(
            {k: getattr(cfg, k) for k in ("num_experts", "top_k", "moe_every", "shared_expert")},
            active_params=active_params(cfg),
        )
    return out


def cluster_dict(cluster: Cluster) -> dict:
    out = dict(cluster.__dict__)
    out["validation"] = {k: b._asdict() for k, b in cluster.validation.items()}
    out.update(world=cluster.world, peak_flops_per_device=cluster.peak_flops, usable_bytes=cluster.usable_bytes)
    return out


def _split_of(times: dict[str, float]) -> str:
    total = sum(times.values())
    if not total:
        return ""
    parts = sorted(((v, k) for k, v in times.items() if v / total >= 0.01), reverse=True)
    return ", ".join(f"{_SHORT[k]} {v / total:.0%}" for v, k in parts)


def calibration_text(cal) -> str:
    lines = []
    changes = cal.changes()
    if changes:
        lines.append("fitted: " + ", ".join(f"{k} {a:.4g} -> {b:.4g}" for k, (a, b) in changes.items()))
    else:
        lines.append("fitted nothing: no parameter could be told apart from the runs given")
    cols = ("run", "layout", "what", "measured s", "prior s", "fitted s", "interval s", "error", "fitted split")
    rows = []
    for r in cal.rows:
        name = r.run.name + (" (held out)" if r.held_out else "")
        lay = r.run.layout
        spec = f"tp={lay.tp},pp={lay.pp},dp={lay.dp},mbs={lay.mbs}" + (f",{lay.schedule}" if lay.pp > 1 else "")
        rows.append(
            (
                name,
                spec,
                r.category,
                f"{r.measured:.4g}",
                f"{r.prior:.4g}",
                f"{r.fitted:.4g}",
                f"{r.lo:.4g}-{r.hi:.4g}" + ("" if r.covered else " (misses)"),
                f"{r.fitted / r.measured - 1:+.1%}",
                _split_of(r.split),
            )
        )
    lines.append(_columns(cols, rows, lambda i: i < 3 or i == 8))
    steps = [r for r in cal.rows if r.category == "step"]
    if steps:
        worst = max(abs(r.fitted / r.measured - 1) for r in steps)
        lines.append(f"worst step-time error {worst:.1%} over {len(steps)} runs")
    own = {b: v for b, v in cal.cluster.categories.items() if set(v) - {"log_sigma"}}
    if own:
        lines.append(
            "fitted per category: "
            + "; ".join(
                f"{b} " + ", ".join(f"{k} {v:.4g}" for k, v in p.items() if k != "log_sigma") for b, p in own.items()
            )
        )
    lines += ["", band_text(cal.bands()), "", accuracy_text(cal)]
    return "\n".join(lines)


def accuracy_text(cal) -> str:
    """Per category: rows within 25% of measured, rows whose interval covers the measurement,
    the interval's log sigma; and Kendall's tau of predicted vs measured step times."""
    from threefold.planner.validation import MEASURED_AS

    per: dict[str, list] = {}
    for r in cal.rows:
        if r.category in MEASURED_AS and r.measured > 0:
            per.setdefault(MEASURED_AS[r.category], []).append(r)
    rows = []
    for band, rs in per.items():
        within = [abs(r.fitted / r.measured - 1) <= TOLERANCE for r in rs]
        covered = [r.covered for r in rs]
        sigma = cal.cluster.categories.get(band, {}).get("log_sigma")
        rows.append(
            (
                band,
                str(len(rs)),
                f"{sum(within)}/{len(rs)}",
                f"{sum(covered)}/{len(rs)}",
                f"{sum(a or b for a, b in zip(within, covered))}/{len(rs)}",
                "-" if sigma is None else f"x/ {math.exp(2 * sigma):.3g}",
            )
        )
    cols = ("category", "rows", f"within {TOLERANCE:.0%}", "interval covers", "either", "interval (2 sigma)")
    tau, tau_held = cal.tau(), cal.tau(held_out_only=True)
    steps = sum(r.category == "step" for r in cal.rows)
    line = f"Kendall's tau, predicted vs measured step time over {steps} runs: " + _tau(tau)
    if any(r.held_out for r in cal.rows) and not all(r.held_out for r in cal.rows):
        line += f" (held-out runs only: {_tau(tau_held)})"
    return _columns(cols, rows, lambda i: i == 0) + "\n" + line


def _tau(tau) -> str:
    return "-" if tau is None else f"{tau:+.2f}"


def band_text(bands: dict) -> str:
    """Per category, the error band over the runs and whether plans may print it bare."""
    if not bands:
        return "no category was measured: the runs had no spans (train with --log.spans true)"
    rows = [
        (name, str(b.runs), b.text(), "within" if b.within else "outside: plans print this band with it")
        for name, b in bands.items()
    ]
    cols = ("category", "runs", "predicted / measured - 1", f"vs +-{TOLERANCE:.0%}")
    return _columns(cols, rows, lambda i: i in (0, 3))
