"""Fit the cluster's efficiency parameters to measured runs, by least squares.

A run directory (written by `threefold train`) has run.json, with the resolved config under
"config" and the grid under "layout", and metrics.jsonl with one record per step. Each run gives
one equation: its median step time (after the warm-up steps) = the planner's step time, which
is linear in the parameters' units (see `cost`). A run whose records also carry per-category
times, `time_<category>_s` for the categories in `cost.CATEGORIES`, gives one more equation per
category, so the parameters can be told apart with fewer runs. The training loop's `pp_idle_s`
(the most any rank waited for receives in the step) is compared with the predicted idle of the
lightest pipeline rank: bubble + pp_comm + the slowest rank's extra work.

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
from threefold.planner.cost import CATEGORIES, from_unit, merge_terms, step_terms, unit
from threefold.planner.layout import Layout
from threefold.planner.model import model_shape

# Keys of metrics.jsonl records that measure part of a step -> the predicted categories they sum.
MEASURED = {**{f"time_{c}_s": (c,) for c in CATEGORIES}, "pp_idle_s": ("pp_idle",)}
PRIORITY = ("compute_efficiency", "intra_bw_gbps", "layer_overhead_us", "step_overhead_s", "intra_latency_us",
            "inter_bw_gbps", "inter_latency_us", "mem_bw_gbps")


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
    """Median measured seconds per MEASURED key the metrics carry (and is > 0)."""
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
    cats = {}
    for key in MEASURED:
        values = [r[key] for r in used if isinstance(r.get(key), (int, float))]
        if values and statistics.median(values) > 0:  # relative residuals need a positive measurement
            cats[key] = statistics.median(values)
    p, t = cfg.parallel, cfg.train
    layout_info = info.get("layout", {})
    layout = Layout(tp=layout_info.get("tp", p.tp), pp=layout_info.get("pp", p.pp), dp=layout_info.get("dp", p.dp),
                    vpp=p.vpp, mbs=t.micro_batch, schedule=p.schedule if p.pp > 1 else "1f1b", zero=p.zero,
                    sp=p.sp, recompute=t.recompute, ep=p.ep)
    hardware = info.get("hardware", {})
    extra = info.get("extra", {})
    device_type = hardware.get("device_type", "cpu")
    dtype_text = str(extra.get("dtype", t.dtype))
    dtype = "bf16" if "bfloat16" in dtype_text or dtype_text == "bf16" else (
        "fp32" if ("float32" in dtype_text or dtype_text == "fp32" or device_type == "cpu") else "bf16")
    peak = extra.get("peak_flops_per_device")
    return Run(path=str(path), cfg=cfg, layout=layout, dtype=dtype, step_time_s=step, categories=cats,
               steps_used=len(used), peak_flops=float(peak) if isinstance(peak, (int, float)) else None,
               host_cores=hardware.get("logical_cores"), device_type=device_type)


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
        return {name: (getattr(self.prior, name), getattr(self.cluster, name)) for name in PRIORITY
                if name in self.free or getattr(self.prior, name) != getattr(self.cluster, name)}

    def as_dict(self) -> dict:
        return {
            "fitted": {k: {"prior": a, "fitted": b} for k, (a, b) in self.changes().items()},
            "rows": [{"run": r.run.path, "layout": r.run.layout.spec(), "category": r.category,
                      "measured_s": r.measured, "prior_s": r.prior, "predicted_s": r.fitted,
                      "error": r.fitted / r.measured - 1, "held_out": r.held_out, "predicted_split_s": r.split}
                     for r in self.rows],
        }


def _equations(runs: list[Run], base: Cluster, explicit: set[str]):
    """Per equation: (run, category, terms, cluster, measured, step terms)."""
    eqs = []
    for run in runs:
        shape = model_shape(run.cfg.model)
        cl = cluster_for_run(base, run, explicit)
        st = step_terms(shape, cl, run.layout, run.cfg.train.global_batch, run.dtype)
        eqs.append((run, "step", st.total(), cl, run.step_time_s, st))
        for key, measured in run.categories.items():
            terms = merge_terms(*({**st.categories, **st.extra}.get(c, {}) for c in MEASURED[key]))
            eqs.append((run, key, terms, cl, measured, st))
    return eqs


def _predict(terms: dict, cl: Cluster, values: dict[str, float]) -> float:
    return sum(coef * (values[n] if n in values else unit(cl, n)) for n, coef in terms.items())


def fit(runs: list[Run], base: Cluster, free: list[str] | None = None, held_out: list[Run] = (),
        explicit: set[str] = frozenset()) -> Calibration:
    """Least-squares fit of the parameters in `free` (default: chosen in PRIORITY order) to `runs`.
    `explicit`: cluster keys the user set, which win over what run.json recorded (cpu peak, cores)."""
    if not runs:
        raise ConfigError("--calibrate", "no runs to calibrate on")
    for name in free or ():
        if name not in PRIORITY:
            raise ConfigError("--fit", f"{name!r} is not a fittable parameter", "valid: " + ", ".join(PRIORITY))
    eqs = _equations(runs, base, explicit)
    y = np.array([e[4] for e in eqs])
    if (y <= 0).any():
        raise ConfigError("--calibrate", "a run has a non-positive step time")
    names = list(free) if free else _choose(eqs)
    start = copy.copy(base)
    while True:
        # Relative residuals: divide every row by its measurement.
        fixed = np.array([_predict({n: c for n, c in e[2].items() if n not in names}, e[3], {}) for e in eqs])
        x = np.array([[e[2].get(n, 0.0) for n in names] for e in eqs]).reshape(len(eqs), len(names))
        if not names:
            theta = np.zeros(0)
            break
        w = 1.0 / y
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
    check_cluster(fitted)
    rows = []
    for group, flag in ((runs, False), (list(held_out), True)):
        for run, cat, terms, cl, measured, st in _equations(group, base, explicit):
            cl_fit = cluster_for_run(fitted, run, explicit)
            split = st.times(cl_fit) if cat == "step" else {}
            rows.append(Row(run, cat, measured, _predict(terms, cl, {}), _predict(terms, cl_fit, {}), flag, split))
    return Calibration(fitted, base, names, rows)


def _with(cluster: Cluster, **changes) -> Cluster:
    c = copy.copy(cluster)
    for k, v in changes.items():
        setattr(c, k, v)
    return c


def _choose(eqs) -> list[str]:
    """Free parameters in PRIORITY order while each is visible and not (nearly) collinear."""
    y = np.array([e[4] for e in eqs])
    chosen: list[str] = []
    for name in PRIORITY:
        if len(chosen) >= len(eqs):
            break
        col = np.array([e[2].get(name, 0.0) for e in eqs]) / y
        if not np.any(col > 0):
            continue
        trial = chosen + [name]
        m = np.array([[e[2].get(n, 0.0) for n in trial] for e in eqs]) / y[:, None]
        m = m / np.linalg.norm(m, axis=0)
        sv = np.linalg.svd(m, compute_uv=False)
        if sv[-1] > 0.05 * sv[0]:
            chosen = trial
    return chosen
