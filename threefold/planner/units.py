"""Seconds per unit of each efficiency parameter of a cluster, and back.

The cost model (planner/cost.py) writes a step as coefficients of the cluster's efficiency
parameters; unit() turns a parameter's value into the seconds one unit of its coefficient
costs, and from_unit() is its inverse, which the fits (calibrate.py, categories.py) use to turn
fitted seconds-per-unit back into parameter values:

    compute_efficiency   1 / efficiency          coefficient: seconds at 100% of peak
    *_bw_gbps            1 / (bandwidth * 1e9)   coefficient: bytes over that link
    *_latency_us, *_overhead_us   value * 1e-6   coefficient: ring steps, calls, layer passes
    step_overhead_s      value                   coefficient: 1

A floor below the cost model, the cluster and the fits: it reads a cluster only through
getattr, so every one of them may import it.
"""

from __future__ import annotations

from threefold.planner.validation import BAND_OF


def unit(cluster, name: str, category: str = "") -> float:
    """Seconds per unit of coefficient for parameter `name` of `cluster` (a planner Cluster),
    with `category`'s own fitted value where the cluster has one (Cluster.categories, keyed by
    the band that covers the category)."""
    own = cluster.categories.get(BAND_OF.get(category, category), {}) if category else {}
    value = own.get(name, getattr(cluster, name))
    if name == "compute_efficiency":
        return 1.0 / value
    if name.endswith("_gbps"):
        return 1.0 / (value * 1e9)
    if name.endswith("_us"):
        return value * 1e-6
    return value


def seconds(terms: dict, cluster, category: str = "") -> float:
    """A category's terms {parameter: coefficient} in seconds at the cluster's values."""
    return sum(coef * unit(cluster, name, category) for name, coef in terms.items())


def from_unit(name: str, u: float) -> float:
    """The parameter value whose unit() is `u` (the inverse of unit)."""
    if name == "compute_efficiency":
        return 1.0 / u
    if name.endswith("_gbps"):
        return 1.0 / (u * 1e9)
    if name.endswith("_us"):
        return u * 1e6
    return u
