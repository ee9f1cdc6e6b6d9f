"""Per-category calibration: each measured category's own parameters, its residual spread, and
how well the fitted model ranks layouts.

The global fit (calibrate.fit) weighs every equation by its run's step time, so a category
that is 1% of the step barely moves it: DP exposure, pipeline transfers and the optimizer kept
errors of +100% and more. Here each measured communication or optimizer category is fitted on
its own equations alone (the slowest rank's spans), by least squares on relative residuals,
over the parameters its terms use (bandwidth, latency steps, call overhead, memory bandwidth),
and keeps them as `Cluster.categories[name]`: dp_comm gets its own bandwidth and call cost
instead of sharing tp_comm's.

Intervals: per category, sigma is the root mean square of log(predicted / measured) over the
fitted rows with the degrees of freedom the fit used up taken off (a category fitted exactly
by as many parameters as equations has no spread to measure and gets SIGMA_PRIOR, a factor of
2). A prediction's interval is predicted x exp(+-K sigma). Leave-one-out (calibrate.
leave_one_out) measures the same spread on runs the fit has not seen.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Collection

import numpy as np

from threefold.planner.units import from_unit, unit

K = 2.0  # interval half-width in sigmas: ~95% for log-normal residuals
SIGMA_PRIOR = math.log(2.0)
"""A category with no residual spread to measure: a factor of 2 per sigma."""
FITTED_ALONE = (
    "span_tp_comm_s",
    "span_cp_comm_s",
    "span_ep_comm_s",
    "span_pp_comm_s",
    "span_dp_comm_s",
    "span_optimizer_s",
)


def fit_categories(eqs, cluster, band_of: dict[str, str]) -> dict[str, dict[str, float]]:
    """{band: {parameter: fitted value}} for each FITTED_ALONE key among the equations
    (calibrate._equations rows: run, key, terms, cluster, measured, step terms), fitted on
    that key's rows alone. Parameters are freed in the order of the time they account for
    under the current values, while the rows tell them apart (no more than rows) and each
    fits to a positive value."""
    out: dict[str, dict[str, float]] = {}
    for key in FITTED_ALONE:
        rows = [e for e in eqs if e[1] == key and e[4] > 0]
        if not rows:
            continue
        cat = band_of[key]
        weight = np.array([1.0 / e[4] for e in rows])
        share: dict[str, float] = {}
        for e in rows:
            for name, coef in e[2].items():
                share[name] = share.get(name, 0.0) + coef * unit(e[3], name, cat) / e[4]
        order = sorted((n for n in share if share[n] > 0), key=lambda n: -share[n])
        names = independent(rows, order, weight)
        y = np.array([e[4] for e in rows])
        while names:
            x = np.array([[e[2].get(n, 0.0) for n in names] for e in rows])
            fixed = np.array([sum(c * unit(e[3], n, cat) for n, c in e[2].items() if n not in names) for e in rows])
            scale = np.abs(x).max(axis=0)
            theta, *_ = np.linalg.lstsq((x / scale) * weight[:, None], (y - fixed) * weight, rcond=None)
            theta = theta / scale
            if all(v > 0 for v in theta):
                out[cat] = {n: from_unit(n, float(u)) for n, u in zip(names, theta)}
                break
            names = names[:-1]  # the least important one goes back to its shared value
        if cat not in out and order:
            # No subset fits positive (the parameters left shared already predict too much): one
            # factor k on the category's whole time, i.e. every one of its parameters' units times k.
            pred = np.array([sum(c * unit(e[3], n, cat) for n, c in e[2].items()) for e in rows])
            k = float((pred * weight) @ (y * weight) / ((pred * weight) @ (pred * weight)))
            out[cat] = {n: from_unit(n, k * unit(rows[0][3], n, cat)) for n in order if _shared(rows, n, cat)}
    return out


def _shared(rows, name: str, cat: str) -> bool:
    """Whether `name`'s unit is the same for every row (a per-run parameter cannot be scaled once)."""
    return len({unit(e[3], name, cat) for e in rows}) == 1


def independent(rows, order: list[str], weight) -> list[str]:
    """Free parameters in `order` while each is visible in `rows` (column values e[2]) and not
    (nearly) collinear with those already chosen, judged on the rows as `weight` weighs them."""
    chosen: list[str] = []
    for name in order:
        if len(chosen) >= len(rows):
            break
        if not any(e[2].get(name, 0.0) > 0 for e in rows):
            continue
        trial = chosen + [name]
        m = np.array([[e[2].get(n, 0.0) for n in trial] for e in rows]) * weight[:, None]
        m = m / np.linalg.norm(m, axis=0)
        sv = np.linalg.svd(m, compute_uv=False)
        if sv[-1] > 0.05 * sv[0]:
            chosen = trial
    return chosen


def sigmas(rows, used: dict[str, int], band_of: dict[str, str]) -> dict[str, float]:
    """Per band: the log residuals' root mean square over `rows` (calibrate.Row), with `used[band]`
    degrees of freedom taken off; SIGMA_PRIOR where none are left."""
    logs: dict[str, list[float]] = {}
    for r in rows:
        band = band_of.get(r.category)
        if band and r.measured > 0 and r.fitted > 0:
            logs.setdefault(band, []).append(math.log(r.fitted / r.measured))
    out = {}
    for band, values in logs.items():
        dof = len(values) - used.get(band, 0)
        out[band] = math.sqrt(sum(v * v for v in values) / dof) if dof >= 1 else SIGMA_PRIOR
    return out


def interval(predicted: float, sigma: float) -> tuple[float, float]:
    """predicted x exp(-+K sigma)."""
    return predicted * math.exp(-K * sigma), predicted * math.exp(K * sigma)


def kendall_tau(a: list[float], b: list[float]) -> float | None:
    """Kendall's tau-b between two orderings of the same items (None with fewer than 2 or no order)."""
    n = len(a)
    concordant = discordant = ties_a = ties_b = 0
    for i in range(n):
        for j in range(i + 1, n):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                concordant += 1
            else:
                discordant += 1
    pairs_a = concordant + discordant + ties_a
    pairs_b = concordant + discordant + ties_b
    if not pairs_a or not pairs_b:
        return None
    return (concordant - discordant) / math.sqrt(pairs_a * pairs_b)


def with_categories(cluster, fitted: dict[str, dict[str, float]], spread: dict[str, float]):
    """`cluster` carrying each band's own parameters and log_sigma (a fresh dict: copies share none)."""
    c = copy.copy(cluster)
    bands = {b: dict(v) for b, v in fitted.items()}
    for band, sigma in spread.items():
        bands.setdefault(band, {})["log_sigma"] = sigma
    c.categories = bands
    return c


def read_categories(path: str, cluster_keys: Collection[str]) -> dict[str, dict[str, float]]:
    """A calibrated profile's [categories.NAME] tables: a measured category's own fitted
    parameters (of `cluster_keys`, the keys of [cluster]: the caller's, which keeps this module
    below cluster.py) and log_sigma, its residuals' spread ({} when none)."""
    from threefold.config import read_toml_file
    from threefold.errors import ConfigError
    from threefold.planner.validation import NAMES

    table = read_toml_file(path, "cluster.profile").get("categories", {})
    out: dict[str, dict[str, float]] = {}
    for name, values in table.items() if isinstance(table, dict) else [("", table)]:
        if name not in NAMES or not isinstance(values, dict):
            raise ConfigError(
                f"{path}: categories.{name}", "not a table of a measured category", "valid: " + ", ".join(NAMES)
            )
        for key, value in values.items():
            if (
                (key != "log_sigma" and key not in cluster_keys)
                or isinstance(value, bool)
                or not isinstance(value, (int, float))
            ):
                raise ConfigError(
                    f"{path}: categories.{name}.{key}", f"{value!r} is not a number of a cluster key or log_sigma"
                )
            if value < 0:
                raise ConfigError(f"{path}: categories.{name}.{key}", f"must be >= 0, got {value}")
        out[name] = {k: float(v) for k, v in values.items()}
    return out
