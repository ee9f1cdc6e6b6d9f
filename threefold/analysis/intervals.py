"""Confidence intervals from repeated measurements: a percentile bootstrap with a fixed seed,
so the same numbers always give the same interval. Used by `threefold report A B` (is a change
beyond the per-step variation?) and by the benchmark suite (bench/stats.py builds on it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95  # two-sided: the 2.5th and 97.5th percentiles of the bootstrap distribution


@dataclass
class Interval:
    """A measured value with its 95% interval."""

    value: float
    """The estimate: median of per-round ratios, median of samples, or the exact value."""
    lo: float
    """Lower end of the 95% interval."""
    hi: float
    """Upper end of the 95% interval."""
    n: int
    """Rounds (or samples) behind the estimate; 1 for an exact value."""
    how: str
    """How it was computed, e.g. "per-round ratio, 6 rounds" or "exact"."""


def bootstrap(
    samples: Sequence[Sequence[float]],
    statistic: Callable[..., np.ndarray],
    how: str,
    seed: int = 0,
    resamples: int = 4000,
) -> Interval:
    """statistic(*arrays) on the samples as measured (the value) and on `resamples` resamplings,
    each sample list drawn with replacement independently of the others. The statistic gets one
    [draws, n_i] array per sample list and returns one number per draw (reduce over axis -1)."""
    arrays = [np.asarray(s, dtype=np.float64) for s in samples]
    if not arrays or any(a.size == 0 for a in arrays):
        raise ValueError("bootstrap needs at least one value in every sample list")
    value = float(statistic(*(a[None, :] for a in arrays))[0])
    n = min(a.size for a in arrays)
    if n < 2:  # one sample says nothing about the spread: no interval, never a verdict
        return Interval(value, -math.inf, math.inf, n, how)
    rng = np.random.default_rng(seed)
    draws = statistic(*(a[rng.integers(0, a.size, (resamples, a.size))] for a in arrays))
    tail = 100 * (1 - LEVEL) / 2
    lo, hi = np.percentile(draws, [tail, 100 - tail])
    # A percentile interval of a skewed statistic can miss the estimate itself: widen it to hold it.
    return Interval(value, min(float(lo), value), max(float(hi), value), n, how)


def _median(x: np.ndarray) -> np.ndarray:
    return np.median(x, axis=-1)


def bootstrap_median(values: Sequence[float], seed: int = 0, resamples: int = 4000, unit: str = "sample") -> Interval:
    """Median of `values` with the percentile-bootstrap interval of the median."""
    return bootstrap([values], _median, f"median of {len(values)} {unit}s", seed, resamples)
