"""Fit the cluster's efficiency parameters to measured runs, by least squares.

A run directory (written by `threefold train`, read by planner/runs.py) has run.json, with the config under
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
(<= 0) is put back to its prior and the fit repeated. `gemm_half_dim` (planner/kernels.py) is
not linear either: where the runs' GEMM shapes differ (tp or micro-batch), the fit is repeated
over GEMM_GRID and the best kept.

Then each measured communication and optimizer category is fitted again on its own rows
(planner/categories.py), so its parameters are its own, and every row gets the interval its
category's residual spread gives. `leave_one_out` predicts each run from a fit on the others.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from threefold.errors import ConfigError
from threefold.planner.categories import (
    SIGMA_PRIOR,
    fit_categories,
    independent,
    interval,
    kendall_tau,
    sigmas,
    with_categories,
)
from threefold.planner.cluster import Cluster, check_cluster
from threefold.planner.cost import merge_terms, seconds, step_terms
from threefold.planner.model import model_shape
from threefold.planner.runs import SPANS, Run, _config_from, load_run  # noqa: F401 (load_run, _config_from: API)
from threefold.planner.units import from_unit, unit
from threefold.planner.validation import MEASURED_AS, bands_from_rows

EXPONENT = "core_share_exponent"  # fitted on a grid, not by least squares (see fit)
GEMM = "gemm_half_dim"  # likewise
GEMM_GRID = (0.0, 16.0, 32.0, 64.0, 128.0, 256.0)
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
    "elementwise_bw_gbps",
)


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
    lo: float = 0.0
    hi: float = 0.0
    """The fitted prediction's interval (categories.interval), seconds."""

    @property
    def covered(self) -> bool:
        return self.lo <= self.measured <= self.hi


@dataclass
class Calibration:
    cluster: Cluster
    """`base` with the fitted parameters."""
    prior: Cluster
    free: list[str]
    rows: list[Row]

    def tau(self, held_out_only: bool = False) -> float | None:
        """Kendall's tau between predicted and measured step times over the runs."""
        steps = [r for r in self.rows if r.category == "step" and (r.held_out or not held_out_only)]
        return kendall_tau([r.fitted for r in steps], [r.measured for r in steps])

    def changes(self) -> dict[str, tuple[float, float]]:
        return {
            name: (getattr(self.prior, name), getattr(self.cluster, name))
            for name in PRIORITY + (EXPONENT, GEMM)
            if name in self.free or getattr(self.prior, name) != getattr(self.cluster, name)
        }

    def bands(self) -> dict:
        """Per category, predicted / measured - 1 over every run, fitted or held out (validation.Band)."""
        return bands_from_rows(self.rows)

    def as_dict(self) -> dict:
        return {
            "fitted": {k: {"prior": a, "fitted": b} for k, (a, b) in self.changes().items()},
            "error_bands": {k: b._asdict() for k, b in self.bands().items()},
            "categories": self.cluster.categories,
            "kendall_tau": self.tau(),
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
                    "interval_s": [r.lo, r.hi],
                    "covered": r.covered,
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


def _measured_seconds(st, cl: Cluster, key: str) -> float:
    """The prediction of a measured key: its categories' seconds, each with its own parameters."""
    if key == "step":
        return sum(st.times(cl).values())
    parts = {**st.categories, **st.extra}
    return sum(seconds(parts.get(c, {}), cl, c) for c in MEASURED[key])


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
        if name not in PRIORITY + (EXPONENT, GEMM):
            raise ConfigError(
                "--fit", f"{name!r} is not a fittable parameter", "valid: " + ", ".join(PRIORITY + (EXPONENT, GEMM))
            )
    base = _with(base, categories={})  # a profile's own category values are what is refitted
    halves = [base.gemm_half_dim]
    if (free is None or GEMM in free) and _gemm_shapes_differ(runs):
        halves = list(GEMM_GRID)
    if free and GEMM in free:
        free = [n for n in free if n != GEMM] or None
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
        for half in halves:
            trial = _with(base, core_share_exponent=exponent, gemm_half_dim=half)
            fitted, names, cost = _linear_fit(_equations(runs, trial, explicit), trial, free)
            if best is None or cost < best[2] - 1e-12:
                best = (fitted, names, cost)
    fitted, names, _ = best
    names = names + [EXPONENT] * (len(exponents) > 1) + [GEMM] * (len(halves) > 1)
    check_cluster(fitted)
    own = fit_categories(_equations(runs, fitted, explicit), fitted, MEASURED_AS)
    fitted = with_categories(fitted, own, {})
    rows = []
    for group, flag in ((runs, False), (list(held_out), True)):
        for run, cat, terms, cl, measured, _ in _equations(group, base, explicit):
            cl_fit = cluster_for_run(fitted, run, explicit)
            st_fit = step_terms(model_shape(run.cfg.model), cl_fit, run.layout, run.cfg.train.global_batch, run.dtype)
            split = st_fit.times(cl_fit) if cat == "step" else {}
            pred = _measured_seconds(st_fit, cl_fit, cat)
            rows.append(Row(run, cat, measured, _predict(terms, cl, {}), pred, flag, split))
    # Degrees of freedom used: a category's own parameters; the shared fit's spread over step and work rows.
    used = {band: len(values) for band, values in own.items()}
    used.update(step=1, work=1)
    fitted_rows = [r for r in rows if not r.held_out]
    spread = sigmas(fitted_rows, used, MEASURED_AS)
    spread = {b: max(v, noise_floor(fitted_rows, b)) for b, v in spread.items()}
    fitted = with_categories(fitted, own, spread)
    for r in rows:
        r.lo, r.hi = interval(r.fitted, spread.get(MEASURED_AS.get(r.category, ""), SIGMA_PRIOR))
    return Calibration(fitted, base, names, rows)


def compare_run(run: Run, base: Cluster) -> dict[str, tuple[float, float]]:
    """{"step" or measured key: (measured s, predicted s)}: one run against `base` as it is, no
    parameter fitted (bench/gpu.py's single-GPU comparison)."""
    return {
        key: (measured, _measured_seconds(st, cl, key))
        for _, key, _, cl, measured, st in _equations([run], base, set())
    }


def leave_one_out(runs: list[Run], base: Cluster, free: list[str] | None = None, explicit=frozenset()) -> Calibration:
    """Each run predicted (with its interval) by a fit on all the others: the rows a calibration
    on this matrix would get on a run it has not seen. The cluster is the fit on all runs, with
    each category's log_sigma measured on these held-out rows instead."""
    if len(runs) < 3:
        raise ConfigError("--calibrate", f"leave-one-out needs at least 3 runs, got {len(runs)}")
    rows: list[Row] = []
    for i, run in enumerate(runs):
        part = fit(runs[:i] + runs[i + 1 :], base, free, [run], explicit)
        rows += [r for r in part.rows if r.held_out]
    whole = fit(runs, base, free, (), explicit)
    spread = sigmas(rows, {}, MEASURED_AS)
    spread = {b: max(v, noise_floor(rows, b)) for b, v in spread.items()}
    own = {b: {k: v for k, v in p.items() if k != "log_sigma"} for b, p in whole.cluster.categories.items()}
    return Calibration(with_categories(whole.cluster, own, spread), whole.prior, whole.free, rows)


def noise_floor(rows: list[Row], band: str) -> float:
    """The root mean square over `band`'s rows of their run's step-to-step spread in log space:
    the least sigma an interval may have, since run-to-run noise is at least the within-run one.
    Rows only: a run whose category the model predicts hidden (no row) adds no noise to it."""
    values = [
        r.run.noise[r.category] for r in rows if MEASURED_AS.get(r.category) == band and r.category in r.run.noise
    ]
    return math.sqrt(sum(v * v for v in values) / len(values)) if values else 0.0


def _gemm_shapes_differ(runs: list[Run]) -> bool:
    """Whether the runs' GEMMs differ in shape (tp, micro-batch or model), so a small-GEMM curve shows."""
    return len({(r.layout.tp, r.layout.mbs, r.cfg.model.hidden, r.cfg.model.seq_len) for r in runs}) > 1


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
    return independent(eqs, PRIORITY, np.array([1.0 / e[0].step_time_s for e in eqs]))
