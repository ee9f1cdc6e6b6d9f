"""Checkpoint interval and goodput under failures (Young 1974, Daly 2006), and the MTBF a run
estimates from its own failures: the planner advises with it before a run (planner/faults.py),
the training loop re-chooses its intervals with it during one (training/cadence.py).

With M the mean time between failures of the whole job, C the time a checkpoint stalls
training and R the time from a failure to training again (detection, restart, loading):

    Young:  tau = sqrt(2 C M)                                   (first order, C << M)
    Daly:   tau = sqrt(2 C M) (1 + sqrt(C/(2M))/3 + C/(18M)) - C  (C < 2M; else tau = M)
    goodput(tau) = tau / (M e^(R/M) (e^((tau + C)/M) - 1))       (Daly's expected wall time)

MTBF from a run's failures: failures as a Poisson process with a Gamma prior on the rate worth
one failure seen in `prior_s` seconds (the configured or planned MTBF); after n failures in T
seconds of run the posterior mean rate is (1 + n) / (prior_s + T), so

    M = (prior_s + T) / (1 + n)

which is the prior before anything is seen and tends to T / n as failures accumulate.
"""

from __future__ import annotations

import math


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    c, m = checkpoint_s, mtbf_s
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def goodput(
    interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float, restarts_fail: bool = True
) -> float:
    """Useful time / wall time for checkpoints every `interval_s` of work (Daly 2006, eq. 13).
    `restarts_fail=False`: failures strike only while the job works, never during a restart (a
    drill fires at a step; M is then work time per failure), so each costs R once and the
    restart term M e^(R/M) becomes M + R: the expected time of a segment of length x is
    (M + R)(e^(x/M) - 1)."""
    m = mtbf_s
    if interval_s <= 0:
        return 0.0
    exponent = (interval_s + checkpoint_s) / m
    if exponent > 700 or restart_s / m > 700:
        return 0.0
    restart = m * math.exp(restart_s / m) if restarts_fail else m + restart_s
    return interval_s / (restart * math.expm1(exponent))


def estimated_mtbf(prior_s: float, observed_s: float, failures: int) -> float:
    """Posterior mean time between failures: a prior worth one failure in `prior_s`, then
    `failures` seen in `observed_s` seconds."""
    return (prior_s + observed_s) / (1 + failures)
