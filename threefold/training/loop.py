"""The training loop of a Trainer: steps from start_step to train.steps, with reads one step late
on CUDA, evaluation, checkpoints, a NaN rollback, and a stop on a signal.

    last = trainer.train()    # the last step's metrics record

A mixin of Trainer (training/trainer.py), which builds everything the loop uses and defines the step
(queue_step / read_step).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from threefold.checkpoint import choose
from threefold.checkpoint.manifest import step_dir_name
from threefold.data import Prefetcher
from threefold.data.blend import tokens_per_dataset
from threefold.errors import UserError
from threefold.observe.step import StepResult, step_record
from threefold.training.health import NonFiniteRollback
from threefold.training.signals import Stopped


class DivergedError(UserError):
    """Non-finite losses or gradients that rolling back does not cure."""


class TrainingLoop:
    def train(self) -> dict:
        """Steps start_step .. train.steps; returns the last step's metrics record (or, with a
        memory probe, every rank's memory rows on rank 0). After train.nan_rollback_after
        non-finite steps in a row every rank reloads the newest checkpoint and goes on."""
        try:
            while True:
                try:
                    last = self._steps()
                    break
                except NonFiniteRollback as err:
                    self.rollback(err)
        finally:  # a stop on a signal too: its records are complete
            self.metrics.close()
            self.observer.close()
        if self.probe:
            return self.probe.gather(self.cfg, self.grid, self.chunks, self.dtype)
        saved = (
            Path(self.cfg.checkpoint.dir) / step_dir_name(last["step"]) if self.cfg.checkpoint.dir and last else None
        )
        builtin = ":" not in self.cfg.model.arch  # threefold generate serves the built-in architectures
        if self.is_logger and saved is not None and saved.is_dir() and builtin:
            self.log(
                f"threefold: saved {saved}; sample from it: threefold generate --checkpoint {saved} --prompt 'def '"
            )
        return last

    def _steps(self) -> dict:
        """The steps from start_step. With read_lag 1 (CUDA) a step's scalars are read once the
        next step is queued, so the host never idles the device between steps; a report,
        evaluation or save step is read at once (its own host reads wait for the device anyway,
        and its record must be complete before the next step changes the state)."""
        cfg, t, last = self.cfg, self.cfg.train, {}
        held, since = None, None  # a queued step not read yet; when the last read ended
        prefetcher = Prefetcher(self.batches, self.start_step, t.steps, depth=cfg.data.prefetch, device=self.device)
        with prefetcher as prefetch:
            for step in range(self.start_step, t.steps):
                if self.stop is not None:
                    self.stop.boundary()
                self.guard.step_begins(step)
                self.observer.begin_step(step)
                with self.observer.phase("data_wait"):
                    batches, data_wait = prefetch.get(step)
                queued = self.queue_step(step, batches, data_wait)
                report = self.reports(step)  # per-rank detail reaches rank 0 on these steps only
                queued.extra.update(self.expert_load.collect(self.grid.world, report))
                if held is not None:  # the previous step, complete on the device by now
                    last, since = self._account(self.read_step(held, since), held.extra), time.perf_counter()
                    held = None
                evaluate = self.heldout is not None and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps)
                if self.read_lag and not (report or evaluate or self.guard.save_due(step) or self.guard.stopping):
                    queued.extra.update(self.observer.end_step(self.engine, report))  # host sums only
                    held = queued
                    continue
                result = self.read_step(queued, since)
                if evaluate:
                    with self.observer.phase("eval"):
                        queued.extra["val_loss"] = self.heldout.evaluate(self.chunks, self.grid, cfg)["loss"]
                last = self._account(result, queued.extra, report)
                if self.guard.stopping:  # every rank read the same flag: all stop after this step
                    break
            if held is not None:
                last = self._account(self.read_step(held, since), held.extra)
            self.guard.close()
        if self.guard.stopping:
            saved = Path(cfg.checkpoint.dir) / step_dir_name(last["step"]) if cfg.checkpoint.dir else None
            raise Stopped(last["step"], self.guard.stopping, str(saved) if saved else None)
        return last

    def _account(self, result: StepResult, extra: dict, report: bool | None = None) -> dict:
        """A read step's metrics line: health counters, the checkpoint when one is due (after
        step_time: a save blocks the run and is reported as its own category), goodput, where the
        time went (`report`: None for a step read late, whose spans were closed when it was
        queued; it is no report, evaluation or save step); a rollback when one is due."""
        cfg, step = self.cfg, result.step - 1
        result.extra.update(extra)
        record = step_record(result, self.throughput, time.time())
        if counts := tokens_per_dataset(self.tokens.tokens, result.step * cfg.train.global_batch, cfg.model.seq_len):
            record["data_tokens"] = counts  # a blend: what each dataset supplied so far
        self.guard.end_step(step, record, span=self.observer.phase, report=bool(report), late=report is None)
        if report is not None:
            record.update(self.observer.end_step(self.engine, report))
        self.metrics.write(record)
        self.callbacks.metrics(record, self.is_logger)
        if record.get("moe_hot_experts") and (step + 1) % cfg.log.interval == 0:
            self.log(
                f"threefold: step {step + 1}: experts above 2x their layer's mean load: "
                f"{', '.join(record['moe_hot_experts'])}"
            )
        self.status.update(step, result.loss, record["tokens_per_s"], record["mfu"])
        self.callbacks.step_end(step + 1, self)
        self.guard.check_rollback(step, self.metrics)
        return record

    def reports(self, step: int) -> bool:
        """Whether step `step` (0-based) is a report step: every log.interval steps, the last
        step and the traced ones. Only there do stragglers, spans and expert load go to rank 0:
        the other steps cost every rank the same, whatever the world size."""
        n = step + 1
        return n % self.cfg.log.interval == 0 or n == self.cfg.train.steps or n in self.observer.trace_steps

    def rollback(self, err: NonFiniteRollback) -> None:
        """Reload the newest checkpoint on every rank (each took the same decision) and continue
        from its step; a divergence that comes back no later than last time is an error. Every
        rank takes each of these decisions alike (the checkpoint is rank 0's choice, broadcast)."""
        c = self.cfg.checkpoint
        if not c.dir:
            raise DivergedError(
                f"train: {err} and there is no checkpoint to roll back to "
                "(set checkpoint.dir and checkpoint.interval, or lower train.lr)"
            ) from None
        if self._last_failure is not None and err.step <= self._last_failure:
            raise DivergedError(
                f"train: {err}, again after rolling back (lower train.lr or check the data around step {err.step + 1})"
            ) from None
        self._last_failure = err.step
        if self.is_logger:
            print(f"threefold: {err}: rolling back to the last checkpoint", file=sys.stderr, flush=True)
        # A checkpoint saved during the streak holds the same weights (its steps were skipped)
        # but would skip the steps that failed: the newest from before the streak.
        found = choose(self.state, self.grid.world, root=c.dir, warn=self.log, at_most=err.step - err.count + 1)
        if found is None:
            raise DivergedError(
                f"train: {err} and there is no checkpoint to roll back to in {c.dir} (none saved yet, "
                "or none verifies: save more often with checkpoint.interval, or lower train.lr)"
            ) from None
        self.start_step = self.load(*found)
        self._open_records(faults=self.guard.faults)
