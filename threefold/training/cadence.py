"""When each checkpoint tier saves: storage (checkpoint.dir) and memory (checkpoint.memory_interval).

    cadence = Cadence(cfg, grid, goodput, log, start_step, memory=True)
    cadence.storage_due(step), cadence.memory_due(step)   # every rank, the same answer
    cadence.saved(tier, step, stall_s)                    # after a save of that tier
    cadence.observe(record)                               # rank 0, every read step
    cadence.rechoose(step)                                # report steps: auto intervals (one broadcast)

A fixed interval saves every N steps (step + 1 a multiple of N). `auto` applies Young's interval
per tier, tau = sqrt(2 C M) (observe/failure_model.py), re-chosen on report steps as the run's
own estimates move:

    C  the tier's save stall, measured (an average over its saves: ckpt_block_s for storage,
       snapshot_block_s for memory; the first save of a tier comes after log.interval steps for
       storage, after one step for memory, and measures it)
    M  the MTBF estimated from this run's failures (goodput.json's, every attempt) with the prior
       checkpoint.mtbf_h (0: 50,000 device-hours / devices): M = (prior + T) / (1 + n). The
       storage tier counts only the failures memory could not recover from when the memory
       tier is on (each is dated in goodput.json with the tier it resumed from).
    R  the restart cost (recovery time per failure, measured; before any failure the attempt's
       own start-up), for the predicted goodput: the product of Daly's goodput of each tier.

The interval in steps is tau over the median step time, between 1 and train.steps. A change of
less than a quarter is not made (the estimates are noisy); each change is one log line, and
goodput.json records the intervals, the inputs and the predicted goodput. Rank 0 decides (it
holds the records) and one broadcast of two numbers on report steps tells every rank.
"""

from __future__ import annotations

import statistics
import time

import torch

from threefold.distributed import comm
from threefold.observe.failure_model import estimated_mtbf, goodput, young_interval
from threefold.observe.goodput import process_start_time

DEVICE_MTBF_H = 50000.0
"""The planner's default device MTBF (planner/faults.py Faults.device_mtbf_h)."""
HYSTERESIS = 0.25
TIERS = ("storage", "memory")


class Cadence:
    def __init__(self, cfg, grid, goodput_book, log, start_step: int, memory: bool):
        c, t = cfg.checkpoint, cfg.train
        self.grid, self.book, self.log, self.steps = grid, goodput_book, log, t.steps
        self.auto = {"storage": c.interval == "auto", "memory": memory and c.memory_interval == "auto"}
        self.every = {
            "storage": cfg.log.interval if self.auto["storage"] else int(c.interval),
            "memory": (1 if self.auto["memory"] else int(c.memory_interval)) if memory else 0,
        }
        self.last = {"storage": start_step, "memory": start_step}
        self.stalls: dict[str, list[float]] = {"storage": [], "memory": []}
        self.step_times: list[float] = []
        self.prior_s = (c.mtbf_h or DEVICE_MTBF_H / grid.world.size) * 3600.0
        self.memory_on = memory
        self.started = process_start_time()
        self.startup_s: float | None = None  # this attempt: process start to its first step
        self.model: dict = {}

    @property
    def any_auto(self) -> bool:
        return any(self.auto.values())

    def _due(self, tier: str, step: int) -> bool:
        every = self.every[tier]
        if not every:
            return False
        if self.auto[tier]:
            return step + 1 - self.last[tier] >= every
        return (step + 1) % every == 0

    def storage_due(self, step: int) -> bool:
        return self._due("storage", step)

    def memory_due(self, step: int) -> bool:
        return self._due("memory", step)

    def next_storage_save(self, step: int) -> int:
        """The first step from `step` on that saves to storage at the current interval (0-based)."""
        every = max(1, self.every["storage"])
        if self.auto["storage"]:
            return max(step, self.last["storage"] + every - 1)
        return step + (-(step + 1) % every)

    def saved(self, tier: str, step: int, stall_s: float) -> None:
        self.last[tier] = step + 1
        self.stalls[tier] = (self.stalls[tier] + [stall_s])[-20:]

    def observe(self, record: dict) -> None:
        """Rank 0: a read step's time (kept steps only: a skipped step is not the step's cost)."""
        if self.startup_s is None:
            self.startup_s = max(0.0, record["time"] - record.get("step_time_s", 0.0) - self.started)
        if not record.get("step_skipped"):
            self.step_times = (self.step_times + [record.get("step_time_s", 0.0)])[-50:]

    # --- auto ------------------------------------------------------------------------------------
    def rechoose(self, step: int) -> None:
        """Report steps (collective when a tier is auto): rank 0 picks the intervals, every rank
        learns them."""
        if not self.any_auto:
            return
        proposal = self._choose() if self.book.enabled else None
        values = [self.every[t] for t in TIERS] if proposal is None else [proposal[t] for t in TIERS]
        box = torch.tensor(values, dtype=torch.int64, device=self.grid.world.device)
        chosen = comm.broadcast(box, self.grid.world).tolist()
        for tier, every in zip(TIERS, chosen):
            if every != self.every[tier] and self.auto[tier]:
                if self.book.enabled:
                    self.log(self._line(tier, every))
                self.every[tier] = every
        if self.book.enabled:
            self.model["intervals"] = {t: self.every[t] for t in TIERS if self.every[t]}
            self.book.model = dict(self.model)

    def _choose(self) -> dict[str, int] | None:
        """Rank 0: each auto tier's Young interval in steps (None before any step time)."""
        if not self.step_times:
            return None
        step_s = statistics.median(self.step_times)
        summary = self.book.summary(self.book.prev["time"] if self.book.prev else None)  # up to the last record
        failures = summary["failures"]
        observed = summary["wall_s"]
        from_storage = [f for f in failures if f.get("source") != "memory"]
        recovery = [f["mttr_s"] - step_s for f in failures if "mttr_s" in f]
        restart_s = statistics.mean(recovery) if recovery else (self.startup_s or 0.0)
        if self.memory_on:  # each tier's failures: memory's are those it recovered from
            counts = {"memory": len(failures) - len(from_storage), "storage": len(from_storage)}
        else:
            counts = {"memory": 0, "storage": len(failures)}
        mtbf = {tier: estimated_mtbf(self.prior_s, observed, n) for tier, n in counts.items()}
        out = dict(self.every)
        model = {"step_s": step_s, "restart_s": restart_s, "observed_s": observed, "failures": len(failures)}
        predicted = 1.0
        for tier in TIERS:
            if not self.every[tier] or not self.stalls[tier]:
                continue
            stall = statistics.mean(self.stalls[tier])
            tau = young_interval(max(stall, 1e-6), mtbf[tier])
            model[tier] = {"stall_s": stall, "mtbf_s": mtbf[tier], "failures": counts[tier], "young_s": tau}
            if self.auto[tier]:
                steps = min(self.steps, max(1, round(tau / step_s))) if step_s > 0 else self.every[tier]
                if abs(steps - self.every[tier]) > HYSTERESIS * self.every[tier]:
                    out[tier] = steps
            predicted *= goodput(out[tier] * step_s, stall, restart_s, mtbf[tier])
        model["predicted_goodput"] = predicted
        model["at"] = time.time()
        self.model = model
        return out

    def _line(self, tier: str, every: int) -> str:
        m = self.model.get(tier, {})
        key = "checkpoint.interval" if tier == "storage" else "checkpoint.memory_interval"
        return (
            f"threefold: {key} auto: every {every} steps (was {self.every[tier]}): Young's interval "
            f"{m.get('young_s', 0):.2f} s from a save stall of {m.get('stall_s', 0):.4f} s and an MTBF of "
            f"{m.get('mtbf_s', 0):.0f} s ({m.get('failures', 0)} failures in "
            f"{self.model.get('observed_s', 0):.0f} s), at {self.model.get('step_s', 0):.3f} s a step"
        )
