"""The tune loop: choose by expected improvement, run, recalibrate, until the budget or until no
untried candidate has more than a 5% chance of beating the best measured one beyond noise.

Every trial is journaled (journal.jsonl, one line as it finishes) with the prediction made
before it ran: the planner's tokens/s and interval, the surrogate's belief, and the residual
per measured category. Failures teach too: an out-of-memory trial caps the memory the planner
may predict for any later choice, and a refused or failed candidate is never chosen again.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from threefold.config import Config
from threefold.planner.runs import SPANS
from threefold.planner.tune.cache import TuneCache, default_root, key_parts
from threefold.planner.tune.space import Candidate, Space
from threefold.planner.tune.surrogate import Belief, Surrogate
from threefold.planner.tune.trials import TrialResult, run_trial

STOP_CHANCE = 0.05
"""Stop when no untried candidate beats the best beyond noise with at least this probability."""
NOISE_FLOOR = 0.02
"""The least relative margin that counts as beyond noise (two runs of one config on a shared host)."""


@dataclass
class TuneOptions:
    """How long and where a tune runs."""

    out: str = "runs/tune"
    """Directory for the journal, the best config, its bands, the report page and each trial's run."""
    trials: int = 0
    """Most new trials (0: a quarter of the candidates, at least 2)."""
    minutes: float = 0.0
    """Wall-clock budget in minutes (0: none); a trial is not started that would likely overrun it."""
    steps: int = 6
    """Optimizer steps per trial (the first fifth, at least one, is warm-up and not timed)."""
    trial_timeout_s: float = 900.0
    """A trial running longer than this is stopped and recorded as failed."""
    cache: str = ""
    """Cache directory ('' = ~/.cache/threefold/tune, 'none' = no cache)."""
    cluster_pairs: list = field(default_factory=list)
    """--cluster.KEY values for the planner (a profile, a GPU name)."""


@dataclass
class TuneResult:
    best: Candidate | None
    best_result: TrialResult | None
    trials: list[dict]
    """The journal's entries, in order (cached ones first)."""
    stop_reason: str
    space: Space
    new_trials: int
    tau: float | None
    beliefs: dict[str, Belief]
    """Final belief per candidate name (for sensitivity and the report)."""
    cache_key: str
    notes: list[str]


class Tuner:
    def __init__(self, cfg: Config, world: int, space: Space, options: TuneOptions, runner=run_trial, log=print):
        from threefold.planner.model import model_shape

        self.cfg, self.world, self.space, self.opt = cfg, world, space, options
        self.runner, self.log = runner, log
        self.out = Path(options.out)
        cpu = cfg.train.device == "cpu" or cfg.train.device == "auto" and not _cuda()
        self.surrogate = Surrogate(
            model_shape(cfg.model),
            _cluster(options.cluster_pairs, world, cpu, cfg),
            cfg.train.global_batch,
            "fp32" if cpu or cfg.train.dtype == "fp32" else "bf16",
        )
        root = None if options.cache == "none" else Path(options.cache or default_root())
        self.cache = TuneCache(root, key_parts(cfg, world, options.steps))
        self.by_name = {c.name: c for c in space.candidates}
        self.results: dict[str, TrialResult] = {}
        self.memory_ceiling = math.inf
        self.journal: list[dict] = []

    def run(self) -> TuneResult:
        self.out.mkdir(parents=True, exist_ok=True)
        journal_path = self.out / "journal.jsonl"
        journal_path.write_text("", encoding="utf-8")
        notes = [n for n in (self.cache.note,) if n]
        for name, result in self.cache.load().items():
            if name in self.by_name:
                self._record(journal_path, self.by_name[name], result, None, cached=True)
        budget = self.opt.trials or max(2, len(self.space.candidates) // 4)
        start, new, stop = time.perf_counter(), 0, ""
        while True:
            beliefs = self._beliefs()
            open_ = [c for c in self.space.candidates if self._open(c, beliefs[c.name])]
            best = self._top()  # what another trial has to beat
            if not open_:
                stop = "every candidate of the space has been measured or ruled out"
                break
            if new >= budget:
                stop = f"the trial budget ({budget}) is spent"
                break
            spent = time.perf_counter() - start
            if self.opt.minutes and new and spent + spent / new > self.opt.minutes * 60:
                stop = f"the time budget ({self.opt.minutes:g} min) would be overrun by another trial"
                break
            if best is not None:
                level = best[1].tokens_per_s * (1 + self._margin(best[1]))
                if max(beliefs[c.name].chance_above(level) for c in open_) < STOP_CHANCE:
                    stop = f"no untried candidate has a {STOP_CHANCE:.0%} chance of beating {best[0].name} beyond noise"
                    break
            floor = best[1].tokens_per_s if best else 0.0
            cand = max(open_, key=lambda c: beliefs[c.name].expected_improvement(floor))
            belief = beliefs[cand.name]
            new += 1
            self.log(
                f"tune: trial {new}/{budget} {cand.name}: predicted {belief.tokens_per_s:,.0f} tokens/s "
                f"[{belief.interval()[0]:,.0f}, {belief.interval()[1]:,.0f}]"
            )
            result = self.runner(
                self.cfg, cand, self.out / "trials" / f"{new:02d}-{cand.name}", self.opt.steps, self.opt.trial_timeout_s
            )
            result = self.cache.add(result)
            if result.status == "ok":
                self.surrogate.errors.append(math.log(result.tokens_per_s / belief.planner.tokens_per_s))
            self._record(journal_path, cand, result, belief, cached=False)
            self.log(
                f"tune:   {result.status}: "
                + (f"{result.tokens_per_s:,.0f} tokens/s" if result.status == "ok" else result.reason)
            )
        self._calibrate()
        beliefs = self._beliefs()
        best = self._best()
        return TuneResult(
            best=best[0] if best else None,
            best_result=best[1] if best else None,
            trials=self.journal,
            stop_reason=stop,
            space=self.space,
            new_trials=new,
            tau=self._tau(),
            beliefs=beliefs,
            cache_key=self.cache.key,
            notes=notes + ([self.surrogate.note] if self.surrogate.note else []),
        )

    # ------------------------------------------------------------------ the parts
    def _ok(self) -> list[tuple[Candidate, TrialResult]]:
        return [(self.by_name[n], r) for n, r in self.results.items() if r.status == "ok"]

    def _top(self) -> tuple[Candidate, TrialResult] | None:
        ok = self._ok()
        return max(ok, key=lambda cr: cr[1].tokens_per_s) if ok else None

    def _best(self) -> tuple[Candidate, TrialResult] | None:
        """The fastest measured trial; among those it does not beat beyond noise, the simplest
        (the planner's tie-break: less ZeRO, SP, recompute, interleaving), since a faster
        measurement inside the noise is not evidence for the extra machinery."""
        from threefold.planner.search import complexity

        top = self._top()
        if top is None:
            return None
        ok = self._ok()
        floor = top[1].tokens_per_s / (1 + self._margin(top[1]))
        tied = [cr for cr in ok if cr[1].tokens_per_s >= floor]
        return min(tied, key=lambda cr: (complexity(cr[0].layout), -cr[1].tokens_per_s))

    def _margin(self, result: TrialResult) -> float:
        """Beyond noise: twice the measurement's standard error, at least NOISE_FLOOR."""
        return max(NOISE_FLOOR, 2 * result.noise / math.sqrt(max(1, result.steps_used)))

    def _open(self, cand: Candidate, belief: Belief) -> bool:
        if cand.name in self.results:  # measured, or failed: a failure is never retried
            return False
        return belief.planner.memory.total < self.memory_ceiling and belief.planner.fits

    def _calibrate(self) -> None:
        self.surrogate.recalibrate([r.path for _, r in self._ok()])

    def _beliefs(self) -> dict[str, Belief]:
        self._calibrate()
        observed = [(c, r.tokens_per_s, r.noise / math.sqrt(max(1, r.steps_used))) for c, r in self._ok()]
        cands = self.space.candidates
        return {c.name: b for c, b in zip(cands, self.surrogate.beliefs(cands, observed))}

    def _tau(self) -> float | None:
        """Kendall's tau between the calibrated planner (without the residual process, which is
        fitted to these very points) and the measured tokens/s of the measured trials."""
        from threefold.planner.categories import kendall_tau

        ok = self._ok()
        if len(ok) < 2:
            return None
        return kendall_tau([self.surrogate.planner(c).tokens_per_s for c, _ in ok], [r.tokens_per_s for _, r in ok])

    def _record(self, path: Path, cand: Candidate, result: TrialResult, belief: Belief | None, cached: bool) -> None:
        self.results[cand.name] = result
        if result.status == "oom":
            self.memory_ceiling = min(self.memory_ceiling, self.surrogate.planner(cand).memory.total)
        entry = {
            "trial": len(self.journal) + 1,
            "name": cand.name,
            "cached": cached,
            "layout": cand.layout.as_dict(),
            "microbatches": cand.microbatches,
            **{f"measured_{k}": v for k, v in result.as_dict().items()},
        }
        if belief is not None:
            pred = belief.planner
            entry.update(
                predicted_tokens_per_s=belief.tokens_per_s,
                predicted_interval=list(belief.interval()),
                planner_tokens_per_s=pred.tokens_per_s,
                planner_interval=list(pred.tokens_per_s_interval),
                planner_memory_bytes=pred.memory.total,
                predicted_categories=_predicted_categories(pred),
            )
            if result.status == "ok":
                entry["residual"] = {
                    k: result.categories[k] / v - 1
                    for k, v in entry["predicted_categories"].items()
                    if v > 0 and k in result.categories
                }
                entry["residual"]["step"] = result.step_time_s / pred.step_time_s - 1
        self.journal.append(entry)
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(entry, default=str) + "\n")


def _predicted_categories(pred) -> dict[str, float]:
    """The planner's seconds per MEASURED key (the categories a trial's spans record)."""
    return {key: sum(pred.times.get(c, 0.0) for c in predicted) for key, (_, predicted) in SPANS.items()}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _cluster(pairs: list, world: int, cpu: bool, cfg: Config):
    """The planner's cluster for this tune: the given --cluster.* keys; on CPU this host with the
    world's processes on it."""
    from threefold.planner.cluster import build_cluster

    pairs = list(pairs)
    named = {k for k, _ in pairs}
    if cpu:
        if "device" not in named and "profile" not in named:
            pairs.append(("device", "cpu"))
        pairs += [(k, v) for k, v in (("devices_per_node", world), ("nodes", 1)) if k not in named]
    cluster = build_cluster(pairs, cache_dir=cfg.data.cache_dir)
    if not cpu and "nodes" not in named:
        cluster.nodes = max(1, -(-world // cluster.devices_per_node))
    return cluster
