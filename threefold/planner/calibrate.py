"""Fit the cluster's efficiency parameters to measured runs, by least squares.

A run directory (written by `threefold train`) has run.json, with the resolved config under
"config" and the grid under "layout", and metrics.jsonl with one record per step. Each run gives
one equation: its median step time (after the warm-up steps) = the planner's step time, which
is linear in the parameters' units (see `cost`). A run trained with `log.spans` also has
spans.jsonl, every rank's step split by category: the rank with the most compute is the slowest
pipeline rank the planner predicts, and its split gives one more equation per group of `SPANS`
it spent time in, so the parameters can be told apart with fewer runs. Host work the planner
counts as overhead (Python around the layers) runs inside the forward and backward spans, so
compute, recompute and overhead form one group. The training loop's `pp_idle_s` (the most any
rank waited for receives in the step) is compared with the predicted idle of the lightest
pipeline rank: bubble + pp_comm + the slowest rank's extra work.

Residuals are relative ((predicted - measured) / measured), so a fast run counts as much as a
slow one. Parameters are freed in `PRIORITY` order while each adds information the runs can
see (its column is not ~ a combination of those already free) and there are more equations
than free parameters; the rest keep their prior. A parameter fitted to a non-physical value
(<= 0) is put back to its prior and the fit repeated.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from threefold.config import Config
from threefold.errors import ConfigError
from threefold.planner.cluster import Cluster, check_cluster
from threefold.planner.cost import from_unit, merge_terms, step_terms, unit
from threefold.planner.layout import Layout
from threefold.planner.model import model_shape
from threefold.planner.validation import bands_from_rows

# Measured part of a step -> (span categories of spans.jsonl it sums, predicted categories it is).
SPANS = {
    "span_work_s": (
        ("forward", "backward", "weight_grad", "recompute", "pp_bubble", "sync", "data_wait", "other"),
        ("compute", "recompute", "overhead", "bubble"),
    ),
    "span_tp_comm_s": (("tp_comm",), ("tp_comm",)),
    "span_ep_comm_s": (("ep_a2a",), ("ep_comm",)),
    "span_pp_comm_s": (("pp_p2p",), ("pp_comm",)),
    "span_dp_comm_s": (("dp_exposed",), ("dp_comm",)),
    "span_optimizer_s": (("optimizer",), ("optimizer",)),
}
EXPONENT = "core_share_exponent"  # fitted on a grid, not by least squares (see fit)
SPAN_WORK = ("forward", "backward", "weight_grad", "recompute")
# Every measured key -> the predicted categories (or `StepTerms.extra` entries) it sums.
MEASURED = {"pp_idle_s": ("pp_idle",), **{key: cats for key, (_, cats) in SPANS.items()}}
PRIORITY = (
    "compute_efficiency",
    "intra_bw_gbps",
    "layer_overhead_us",
    "collective_overhead_us",
    "step_overhead_s",
    "intra_latency_us",
    "inter_bw_gbps",
    "inter_latency_us",
    "mem_bw_gbps",
)


@dataclass
class Run:
    """One measured run, reduced to what the planner predicts."""

    path: str
    cfg: Config
    layout: Layout
    dtype: str
    step_time_s: float
    """Median step time after the warm-up steps."""
    categories: dict[str, float]
    """Median measured seconds per MEASURED key the run recorded (and is > 0)."""
    steps_used: int
    peak_flops: float | None
    """Per-device peak the run measured (CPU) or looked up, from run.json."""
    host_cores: int | None
    device_type: str

    @property
    def name(self) -> str:
        return Path(self.path).name or self.path


def _config_from(data: dict) -> Config:
    cfg = Config()
    for section, values in data.items():
        part = getattr(cfg, section, None)
        if part is None or not isinstance(values, dict):
            continue
        names = {f.name for f in dataclasses.fields(part)}
        for key, value in values.items():
            if key in names:
                setattr(part, key, value)
    return cfg


def load_run(path: str, warmup: int | None = None) -> Run:
    """Read a run directory; `warmup` first steps are dropped (default: a fifth, at least 1)."""
    root = Path(path)
    run_json, metrics = root / "run.json", root / "metrics.jsonl"
    if not run_json.is_file() or not metrics.is_file():
        raise ConfigError("--calibrate", f"{path} is not a run directory (needs run.json and metrics.jsonl)")
    try:
        info = json.loads(run_json.read_text(encoding="utf-8"))
        records = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
    except ValueError as err:
        raise ConfigError("--calibrate", f"{path}: unreadable run files ({err})") from None
    cfg = _config_from(info.get("config", {}))
    records = [r for r in records if isinstance(r.get("step_time_s"), (int, float))]
    if len(records) < 2:
        raise ConfigError("--calibrate", f"{path} has {len(records)} timed steps; calibration needs at least 2")
    skip = max(1, len(records) // 5) if warmup is None else warmup
    used = records[skip:] or records[-1:]
    step = statistics.median(r["step_time_s"] for r in used)
    per_step = {key: [r[key]] for r in used for key in ("pp_idle_s",) if isinstance(r.get(key), (int, float))}
    for key, values in _slowest_rank_spans(root / "spans.jsonl", {r.get("step") for r in used}).items():
        per_step.setdefault(key, []).extend(values)
    cats = {}
    for key, values in per_step.items():
        if statistics.median(values) > 0:  # relative residuals need a positive measurement
            cats[key] = statistics.median(values)
    p, t = cfg.parallel, cfg.train
    layout_info = info.get("layout", {})
    layout = Layout(
        tp=layout_info.get("tp", p.tp),
        pp=layout_info.get("pp", p.pp),
        dp=layout_info.get("dp", p.dp),
        vpp=p.vpp,
        mbs=t.micro_batch,
        schedule=p.schedule if p.pp > 1 else "1f1b",
        zero=p.zero,
        sp=p.sp,
        recompute=t.recompute,
        ep=p.ep,
    )
    hardware = info.get("hardware", {})
    extra = info.get("extra", {})
    device_type = hardware.get("device_type", "cpu")
    dtype_text = str(extra.get("dtype", t.dtype))
    dtype = (
        "bf16"
        if "bfloat16" in dtype_text or dtype_text == "bf16"
        else ("fp32" if ("float32" in dtype_text or dtype_text == "fp32" or device_type == "cpu") else "bf16")
    )
    peak = extra.get("peak_flops_per_device")
    return Run(
        path=str(path),
        cfg=cfg,
        layout=layout,
        dtype=dtype,
        step_time_s=step,
        categories=cats,
        steps_used=len(used),
        peak_flops=float(peak) if isinstance(peak, (int, float)) else None,
        host_cores=hardware.get("logical_cores"),
        device_type=device_type,
    )


def _slowest_rank_spans(path: Path, steps: set) -> dict[str, list[float]]:
    """Per SPANS key, the seconds the slowest rank (most compute) spent there, one value per step
    line of spans.jsonl whose steps are all in `steps` ({} without the file)."""
    out: dict[str, list[float]] = {}
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        ranks = rec.get("ranks") or []
        # A line averages the `steps` steps up to its own (one per log.interval): it counts
        # only when every one of them is a step in use (none of the warm-up).
        last, window = rec.get("step"), rec.get("steps", 1)
        if not ranks or not isinstance(last, int) or not all(s in steps for s in range(last - window + 1, last + 1)):
            continue
        slowest = max(ranks, key=lambda r: sum(r["time_s"].get(c, 0.0) for c in SPAN_WORK))["time_s"]
        for key, (spans, _) in SPANS.items():
            out.setdefault(key, []).append(sum(slowest.get(c, 0.0) for c in spans))
    return out


def cluster_for_run(base: Cluster, run: Run, explicit: set[str] = frozenset()) -> Cluster:
    """`base` shaped to the run: its world on one node (cpu) or on base's node size (gpu); the
    peak and host cores the run recorded, unless `explicit` names keys the user set."""
    c = copy.copy(base)
    world = run.layout.world
    if base.device == "cpu":
        c.devices_per_node, c.nodes = world, 1
        if run.host_cores and "host_cores" not in explicit:
            c.host_cores = int(run.host_cores)
        if run.peak_flops and "peak_tflops" not in explicit:
            c.peak_tflops = run.peak_flops / 1e12
        c.memory_gib = max(c.memory_gib, c.reserved_gib + 1.0)
    else:
        c.nodes = max(1, -(-world // base.devices_per_node))
    return c


@dataclass
class Row:
    run: Run
    category: str  # "step" or a category name
    measured: float
    prior: float
    fitted: float
    held_out: bool
    split: dict[str, float] = dataclasses.field(default_factory=dict)
    """Step rows: the fitted prediction per category, seconds."""


@dataclass
class Calibration:
    cluster: Cluster
    """`base` with the fitted parameters."""
    prior: Cluster
    free: list[str]
    rows: list[Row]

    def changes(self) -> dict[str, tuple[float, float]]:
        return {
            name: (getattr(self.prior, name), getattr(self.cluster, name))
            for name in PRIORITY + (EXPONENT,)
            if name in self.free or getattr(self.prior, name) != getattr(self.cluster, name)
        }

    def bands(self) -> dict:
        """Per category, predicted / measured - 1 over every run, fitted or held out (validation.Band)."""
        return bands_from_rows(self.rows)

    def as_dict(self) -> dict:
        return {
            "fitted": {k: {"prior": a, "fitted": b} for k, (a, b) in self.changes().items()},
            "error_bands": {k: b._asdict() for k, b in self.bands().items()},
            "rows": [
                {
                    "run": r.run.path,
                    "layout": r.run.layout.spec(),
                    "category": r.category,
                    "measured_s": r.measured,
                    "prior_s": r.prior,
                    "predicted_s": r.fitted,
                    "error": r.fitted / r.measured - 1,
                    "held_out": r.held_out,
                    "predicted_split_s": r.split,
                }
                for r in self.rows
            ],
        }


def _equations(runs: list[Run], base: Cluster, explicit: set[str]):
    """Per equation: (run, category, terms, cluster, measured, step terms)."""
    eqs = []
    for run in runs:
        shape = model_shape(run.cfg.model)
        cl = cluster_for_run(base, run, explicit)
        st = step_terms(shape, cl, run.layout, run.cfg.train.global_batch, run.dtype)
        eqs.append((run, "step", st.total(), cl, run.step_time_s, st))
        spans = any(key in SPANS for key in run.categories)
        for key, measured in run.categories.items():
            terms = merge_terms(*({**st.categories, **st.extra}.get(c, {}) for c in MEASURED[key]))
            # A category the layout does not have (tp_comm at tp 1) is no equation; nor is the
            # idlest rank's wait where the slowest rank's spans say more.
            if terms and not (spans and key == "pp_idle_s"):
                eqs.append((run, key, terms, cl, measured, st))
    return eqs


def _predict(terms: dict, cl: Cluster, values: dict[str, float]) -> float:
    return sum(coef * (values[n] if n in values else unit(cl, n)) for n, coef in terms.items())


def fit(
    runs: list[Run],
    base: Cluster,
    free: list[str] | None = None,
    held_out: list[Run] = (),
    explicit: set[str] = frozenset(),
) -> Calibration:
    """Least-squares fit of the parameters in `free` (default: chosen in PRIORITY order) to `runs`.
    `explicit`: cluster keys the user set, which win over what run.json recorded (cpu peak, cores).

    `core_share_exponent` (cpu) is not linear: when `free` names it, the least-squares fit of the
    others (the rest of `free`, or chosen as above when it names no other) is repeated on a grid
    of exponents from 1 to 2 and the best kept. It needs runs whose processes share cores to
    different degrees (1 process and 8 on 2 cores), and more equations than two runs give to
    be more than a fit of their noise: the cpu profile's value is measured (docs/planner.md)."""
    if not runs:
        raise ConfigError("--calibrate", "no runs to calibrate on")
    for name in free or ():
        if name not in PRIORITY + (EXPONENT,):
            raise ConfigError(
                "--fit", f"{name!r} is not a fittable parameter", "valid: " + ", ".join(PRIORITY + (EXPONENT,))
            )
    if any(run.step_time_s <= 0 for run in runs):
        raise ConfigError("--calibrate", "a run has a non-positive step time")
    exponents = [base.core_share_exponent]
    if free and EXPONENT in free:
        if not _shares_differ(runs, base, explicit):
            raise ConfigError(
                "--fit",
                "core_share_exponent needs runs whose processes share cores to different degrees",
                "add a run with more processes than cores, and one with fewer",
            )
        exponents = [1.0 + 0.02 * i for i in range(51)]
        free = [n for n in free if n != EXPONENT] or None
    best = None
    for exponent in exponents:
        trial = _with(base, core_share_exponent=exponent)
        fitted, names, cost = _linear_fit(_equations(runs, trial, explicit), trial, free)
        if best is None or cost < best[2] - 1e-12:
            best = (fitted, names, cost)
    fitted, names, _ = best
    if len(exponents) > 1:
        names = names + [EXPONENT]
    check_cluster(fitted)
    rows = []
    for group, flag in ((runs, False), (list(held_out), True)):
        for run, cat, terms, cl, measured, _ in _equations(group, base, explicit):
            cl_fit = cluster_for_run(fitted, run, explicit)
            st_fit = step_terms(model_shape(run.cfg.model), cl_fit, run.layout, run.cfg.train.global_batch, run.dtype)
            terms_fit = (
                st_fit.total()
                if cat == "step"
                else merge_terms(*({**st_fit.categories, **st_fit.extra}.get(c, {}) for c in MEASURED[cat]))
            )
            split = st_fit.times(cl_fit) if cat == "step" else {}
            rows.append(Row(run, cat, measured, _predict(terms, cl, {}), _predict(terms_fit, cl_fit, {}), flag, split))
    return Calibration(fitted, base, names, rows)


def _shares_differ(runs: list[Run], base: Cluster, explicit: set[str]) -> bool:
    """Whether the runs' processes got different shares of a core, one of them less than all."""
    ratios = set()
    for run in runs:
        cl = cluster_for_run(base, run, explicit)
        if cl.host_cores > 0:
            ratios.add(min(1.0, cl.host_cores / cl.devices_per_node))
    return len(ratios) > 1 and min(ratios) < 1.0


def _linear_fit(eqs, base: Cluster, free: list[str] | None) -> tuple[Cluster, list[str], float]:
    """(base with the fitted parameters, the parameters fitted, sum of squared residuals).
    Each residual is in units of its run's measured step time, so every run counts alike and
    a category counts by its share of the step."""
    y = np.array([e[4] for e in eqs])
    w = np.array([1.0 / e[0].step_time_s for e in eqs])
    names = list(free) if free else _choose(eqs)
    start = copy.copy(base)
    while True:
        fixed = np.array([_predict({n: c for n, c in e[2].items() if n not in names}, e[3], {}) for e in eqs])
        x = np.array([[e[2].get(n, 0.0) for n in names] for e in eqs]).reshape(len(eqs), len(names))
        if not names:
            theta = np.zeros(0)
            break
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        theta, *_ = np.linalg.lstsq((x / scale) * w[:, None], (y - fixed) * w, rcond=None)
        theta = theta / scale
        bad = [i for i, v in enumerate(theta) if not v > 0]
        if bad:
            names.pop(min(bad, key=lambda i: theta[i] * scale[i]))
            continue
        if "compute_efficiency" in names and theta[names.index("compute_efficiency")] < 1.0:
            # Faster than the peak: the peak reads low. Pin efficiency at 1 and fit the rest.
            i = names.index("compute_efficiency")
            names.pop(i)
            start.compute_efficiency = 1.0
            eqs = [(r, c, t, _with(cl, compute_efficiency=1.0), m, st) for r, c, t, cl, m, st in eqs]
            continue
        break
    fitted = copy.copy(start)
    for name, u in zip(names, theta):
        setattr(fitted, name, from_unit(name, float(u)))
    residual = (x @ theta + fixed - y) * w
    return fitted, names, float(residual @ residual)


def _with(cluster: Cluster, **changes) -> Cluster:
    c = copy.copy(cluster)
    for k, v in changes.items():
        setattr(c, k, v)
    return c


def _choose(eqs) -> list[str]:
    """Free parameters in PRIORITY order while each is visible and not (nearly) collinear with
    those already free, judged on the rows as the fit weighs them (per run's step time)."""
    w = np.array([1.0 / e[0].step_time_s for e in eqs])
    chosen: list[str] = []
    for name in PRIORITY:
        if len(chosen) >= len(eqs):
            break
        col = np.array([e[2].get(name, 0.0) for e in eqs])
        if not np.any(col > 0):
            continue
        trial = chosen + [name]
        m = np.array([[e[2].get(n, 0.0) for n in trial] for e in eqs]) * w[:, None]
        m = m / np.linalg.norm(m, axis=0)
        sv = np.linalg.svd(m, compute_uv=False)
        if sv[-1] > 0.05 * sv[0]:
            chosen = trial
    return chosen
