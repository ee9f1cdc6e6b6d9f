"""Confidence intervals for the benchmark suite.

A timed comparison runs its contestants in rounds (one A block and one B block back to back),
so machine drift hits both halves of a round alike; the ratio reported is the median of the
per-round ratios, with a 95% percentile-bootstrap interval of that median. Quantities that do
not vary between runs (memory, byte counts, loss differences) are `exact`. Resampling uses a
fixed seed, so the same numbers always give the same interval.
"""

from __future__ import annotations

from collections.abc import Sequence

# The bootstrap itself lives in threefold (threefold report uses it too).
from threefold.analysis.intervals import LEVEL, Interval, _median, bootstrap, bootstrap_median  # noqa: F401


def paired_ratio(
    a: Sequence[float], b: Sequence[float], seed: int = 0, resamples: int = 4000, unit: str = "round"
) -> Interval:
    """Median of the per-round ratios a[i] / b[i], with the bootstrap interval of that median."""
    if len(a) != len(b):
        raise ValueError(f"paired_ratio needs one b per a (got {len(a)} and {len(b)})")
    ratios = [x / y for x, y in zip(a, b)]
    return bootstrap([ratios], _median, f"per-{unit} ratio, {len(ratios)} {unit}s", seed, resamples)


def exact(value: float) -> Interval:
    """A deterministic quantity: its interval is the value itself."""
    return Interval(float(value), float(value), float(value), 1, "exact")


def as_interval(value: Interval | float) -> Interval:
    """An Interval as is; a bare number as exact."""
    return value if isinstance(value, Interval) else exact(value)


def fmt(x: float) -> str:
    """Three decimals, or scientific notation for tiny values."""
    return f"{x:.3f}" if x == 0 or abs(x) >= 1e-3 else f"{x:.1e}"


def show(value: Interval | float) -> str:
    """ "0.912 [0.880, 0.951]" for a measured interval, "0.912" for an exact value."""
    i = as_interval(value)
    return fmt(i.value) if i.how == "exact" else f"{fmt(i.value)} [{fmt(i.lo)}, {fmt(i.hi)}]"
