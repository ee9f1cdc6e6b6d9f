"""What the tuner believes about a candidate's tokens/s: the planner's prediction from a cluster
calibrated on the trials so far, corrected by a Gaussian process over the log residuals of the
measured trials (the planner's structural errors, e.g. a per-micro-batch cost it does not model,
are smooth over the layout coordinates), with the uncertainty that goes with it.

log(tokens/s) of candidate c ~ Normal(mu_c, sigma_c):
    mu_c    = log(planner_c) + GP mean of the residual at c
    sigma_c = GP standard deviation at c (prior amplitude: the calibration's step spread)
Expected improvement over the best measured B is the lognormal's E[max(T - B, 0)].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from threefold.errors import UserError
from threefold.planner.categories import SIGMA_PRIOR
from threefold.planner.cluster import Cluster
from threefold.planner.predict import Prediction, predict
from threefold.planner.tune.space import Candidate

LENGTH_WEIGHT = 0.7
"""Per unit of a layout coordinate (a factor of 2 in a degree or count, a flag): how fast two
candidates' residuals decorrelate, exp(-0.7) per step."""
RUN_TO_RUN = 0.03
"""Log spread between two runs of one config on a shared host, beyond each run's own step spread."""
AMPLITUDE_FLOOR = 0.05
"""The residual prior never claims the calibrated planner better than 5%."""


@dataclass
class Belief:
    planner: Prediction
    mu: float
    """log tokens/s"""
    sigma: float

    @property
    def tokens_per_s(self) -> float:
        return math.exp(self.mu)

    def interval(self, k: float = 2.0) -> tuple[float, float]:
        return math.exp(self.mu - k * self.sigma), math.exp(self.mu + k * self.sigma)

    def expected_improvement(self, best: float) -> float:
        if best <= 0:
            return math.exp(self.mu + self.sigma**2 / 2)
        if self.sigma <= 0:
            return max(0.0, math.exp(self.mu) - best)
        d2 = (self.mu - math.log(best)) / self.sigma
        return math.exp(self.mu + self.sigma**2 / 2) * _phi(d2 + self.sigma) - best * _phi(d2)

    def chance_above(self, level: float) -> float:
        if self.sigma <= 0:
            return float(self.mu > math.log(level))
        return 1.0 - _phi((math.log(level) - self.mu) / self.sigma)


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


class Surrogate:
    """The planner (recalibrated on every measured trial) plus the residual process."""

    def __init__(self, shape, base: Cluster, global_batch: int, dtype: str):
        self.shape, self.base, self.global_batch, self.dtype = shape, base, global_batch, dtype
        self.cluster = base
        self.calibrated_on = 0
        self.note = ""
        self.errors: list[float] = []
        """log(measured / predicted) of each trial against the planner as it stood BEFORE the
        trial: out-of-sample errors, unlike the calibration's residuals on the runs it fitted."""

    def recalibrate(self, paths: list[str]) -> None:
        """Refit the cluster's parameters and per-category values to every measured run
        directory (planner.calibrate.fit from the uncalibrated profile, so nothing compounds);
        the runs are read only when one was added since the last fit."""
        from threefold.planner.calibrate import fit
        from threefold.planner.runs import load_run

        if not paths or len(paths) == self.calibrated_on:
            return
        try:
            self.cluster = fit([load_run(p) for p in paths], self.base).cluster
            self.note = ""
        except UserError as err:  # too few distinct runs for any parameter: keep the last fit
            self.note = str(err)
        self.calibrated_on = len(paths)

    def planner(self, cand: Candidate) -> Prediction:
        return predict(self.shape, self.cluster, cand.layout, self.global_batch, self.dtype)

    @property
    def amplitude(self) -> float:
        """The residual prior's spread: how wrong the planner has been on trials it had not
        seen (root mean square), or its calibration's step spread, whichever is larger; the
        profile's prior before any trial."""
        step = self.cluster.categories.get("step", {}).get("log_sigma", SIGMA_PRIOR)
        seen = math.sqrt(sum(e * e for e in self.errors) / len(self.errors)) if self.errors else 0.0
        return max(AMPLITUDE_FLOOR, step, seen)

    def beliefs(self, cands: list[Candidate], observed: list[tuple[Candidate, float, float]]) -> list[Belief]:
        """`observed`: (candidate, measured tokens/s, its noise as a log standard deviation)."""
        preds = [self.planner(c) for c in cands]
        s2 = self.amplitude**2
        if not observed:
            return [Belief(p, math.log(p.tokens_per_s), math.sqrt(s2)) for p in preds]
        xo = np.array([c.features() for c, _, _ in observed])
        resid = np.array([math.log(t / self.planner(c).tokens_per_s) for c, t, _ in observed])
        noise = np.array([n**2 + RUN_TO_RUN**2 for _, _, n in observed])
        gram = s2 * _kernel(xo, xo) + np.diag(noise)
        chol = np.linalg.cholesky(gram)
        alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, resid))
        xc = np.array([c.features() for c in cands])
        cross = s2 * _kernel(xc, xo)
        mean = cross @ alpha
        v = np.linalg.solve(chol, cross.T)
        var = np.maximum(s2 - np.sum(v * v, axis=0), 1e-12)
        return [
            Belief(p, math.log(p.tokens_per_s) + float(m), float(math.sqrt(sv))) for p, m, sv in zip(preds, mean, var)
        ]


def _kernel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """exp(-w * L1 distance): an Ornstein-Uhlenbeck kernel over the layout coordinates."""
    return np.exp(-LENGTH_WEIGHT * np.abs(a[:, None, :] - b[None, :, :]).sum(axis=2))
