"""The training loop: steps from start_step to train.steps, read one step late on CUDA, with
evaluation, checkpoints, a NaN rollback, and a stop on a signal.

    last = TrainingLoop(trainer).run()    # what Trainer.train() does: the last step's record

The loop drives one Trainer (training/trainer.py) through the parts `TrainerParts` names: the step
in two halves (queue_step, then read_step: the host read), the records a read step goes to, and
the attempt's RunGuard (training/resilience.py), whose hook points it calls as a step begins,
while a read step's record is made, and once it is written.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from threefold.checkpoint.manifest import step_dir_name
from threefold.data import Prefetcher
from threefold.data.blend import tokens_per_dataset
from threefold.errors import UserError
from threefold.observe.step import QueuedStep, StepResult, step_record
from threefold.training.health import NonFiniteRollback
from threefold.training.signals import Stopped

if TYPE_CHECKING:
    import torch

    from threefold.config import Config
    from threefold.data import TokenFile
    from threefold.distributed.grid import Grid
    from threefold.inference.evaluate import HeldOutEval
    from threefold.observe.diagnose import Diagnosis
    from threefold.observe.layers import LayerClock
    from threefold.observe.metrics import MetricsWriter
    from threefold.observe.observer import StepObserver
    from threefold.observe.prometheus import Exporter
    from threefold.observe.step import Throughput
    from threefold.training.actions import Actions
    from threefold.training.callbacks import Callbacks
    from threefold.training.expert_load import ExpertLoad
    from threefold.training.resilience import RunGuard
    from threefold.training.signals import StopSignals
    from threefold.training.status import StatusLine


class DivergedError(UserError):
    """Non-finite losses or gradients that rolling back does not cure."""


class TrainerParts(Protocol):
    """What the loop uses of the Trainer it drives; the Trainer builds each."""

    cfg: Config
    grid: Grid
    device: torch.device
    chunks: list  # this rank's pipeline chunks (held-out evaluation runs them)
    engine: object  # the data-parallel engine (the observer reads its timers)
    read_lag: int  # 1: a step is read once the next one is queued (CUDA); 0: at once
    start_step: int  # where the attempt begins; a rollback moves it back
    stop: StopSignals | None  # the signals this rank listens to
    guard: RunGuard  # the attempt's: fault drills, health, checkpoints, goodput
    metrics: MetricsWriter  # the attempt's metrics.jsonl
    observer: StepObserver  # spans: where each step's time went
    diagnosis: Diagnosis  # rank 0's detectors: the slow link, rank, layer, the change point
    layers: LayerClock  # per-layer forward and backward time on traced steps
    actions: Actions  # train.on_slow: exclude a slow node, rebalance a slow stage
    exporter: Exporter  # the node's Prometheus endpoint
    expert_load: ExpertLoad  # MoE routing, gathered on report steps
    heldout: HeldOutEval | None  # evaluation every train.eval_every steps
    throughput: Throughput  # tokens/s and MFU of a step time
    tokens: TokenFile  # the training tokens (a blend's parts are counted in the record)
    status: StatusLine
    callbacks: Callbacks
    is_logger: bool
    log: Callable[[str], None]  # quiet on every rank but the first

    def batches(self, step: int) -> list: ...  # this rank's micro-batches of a step

    def queue_step(self, step: int, batches: list, data_wait_s: float) -> QueuedStep: ...

    def read_step(self, queued: QueuedStep, since: float | None) -> StepResult: ...

    def reload(self, at_most: int) -> bool: ...  # a rollback: the newest checkpoint up to a step


class TrainingLoop:
    def __init__(self, trainer: TrainerParts):
        self.trainer = trainer
        self.last_divergence: int | None = None  # the step the last rollback was for

    def run(self) -> dict:
        """Steps start_step .. train.steps; returns the last step's metrics record. After
        train.nan_rollback_after non-finite steps in a row every rank reloads the newest checkpoint
        and goes on: the next attempt."""
        trainer = self.trainer
        try:
            while True:
                try:
                    return self._attempt()
                except NonFiniteRollback as err:
                    self._roll_back(err)
        finally:  # a stop on a signal too: its records are complete
            trainer.metrics.close()
            trainer.observer.close()
            trainer.exporter.close()

    def _attempt(self) -> dict:
        """Steps from start_step until train.steps (returns the last record), a signal (raises
        Stopped) or a rollback that is due (raises NonFiniteRollback).

        The read-late rule. Reading a step (read_step) waits until the device has run it. With
        read_lag 1 (CUDA) step N is read once step N+1 is queued, so the device runs N+1 while
        the host waits for N, and never idles between steps. Four kinds of step are read at once:
        a report step and an evaluation step (their own host reads wait for the device anyway),
        a save step (its checkpoint and record must be taken before the next step changes the
        state) and the step the run stops after (it saves). The last step is a report step, so
        none is left unread. A late step's time runs from the previous late read
        (`late_read_end`): consecutive step times tile the host's wall time. With read_lag 0
        (CPU: nothing to overlap) every step is read at once."""
        trainer, t = self.trainer, self.trainer.cfg.train
        guard = trainer.guard  # the attempt's (a rollback opens new records)
        last: dict = {}
        unread: QueuedStep | None = None  # queued, not read: the device may still be running it
        late_read_end: float | None = None
        prefetcher = Prefetcher(
            trainer.batches, trainer.start_step, t.steps, depth=trainer.cfg.data.prefetch, device=trainer.device
        )
        with prefetcher as prefetch:
            for step in range(trainer.start_step, t.steps):
                queued, report = self._queue(step, prefetch)
                if unread is not None:  # the previous step, complete on the device by now
                    last = self._record(trainer.read_step(unread, late_read_end), unread.extra, late=True)
                    unread, late_read_end = None, time.perf_counter()
                evaluate = trainer.heldout is not None and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps)
                at_once = report or evaluate or guard.save_due(step) or guard.stopping
                if trainer.read_lag and not at_once:
                    queued.extra.update(trainer.observer.end_step(trainer.engine, report))  # host sums only
                    unread = queued
                    continue
                result = trainer.read_step(queued, late_read_end)
                if evaluate:
                    with trainer.observer.phase("eval"):
                        held_out = trainer.heldout.evaluate(trainer.chunks, trainer.grid, trainer.cfg)
                        queued.extra["val_loss"] = held_out["loss"]
                last = self._record(result, queued.extra, report=report)
                if guard.stopping:  # every rank read the same flag: all stop after this step
                    break
            guard.close()
        if guard.stopping:
            c = trainer.cfg.checkpoint
            saved = Path(c.dir) / step_dir_name(last["step"]) if c.dir else None
            raise Stopped(last["step"], guard.stopping, str(saved) if saved else None)
        return last

    def _queue(self, step: int, prefetch) -> tuple[QueuedStep, bool]:
        """Step `step` from its boundary (signals, the fault drills) to its queued kernels and
        collectives (Trainer.queue_step); and whether it is a report step."""
        trainer = self.trainer
        if trainer.stop is not None:
            trainer.stop.boundary()
        trainer.guard.before_step(step)
        trainer.observer.begin_step(step)
        trainer.layers.begin_step(step)
        with trainer.observer.phase("data_wait"):
            batches, data_wait = prefetch.get(step)
        queued = trainer.queue_step(step, batches, data_wait)
        report = self.reports(step)  # per-rank detail reaches rank 0 on these steps only
        queued.extra.update(trainer.expert_load.collect(trainer.grid.world, report))
        return queued, report

    def _record(self, result: StepResult, extra: dict, report: bool = False, late: bool = False) -> dict:
        """A read step's metrics line: health counters, the checkpoint when one is due (after
        step_time: a save blocks the run and is reported as its own category), goodput, where the
        time went (a `late` step's spans were closed when it was queued), the callbacks; a
        rollback when one is due."""
        trainer, cfg, step = self.trainer, self.trainer.cfg, result.step - 1
        result.extra.update(extra)
        record = step_record(result, trainer.throughput, time.time())
        if counts := tokens_per_dataset(trainer.tokens.tokens, result.step * cfg.train.global_batch, cfg.model.seq_len):
            record["data_tokens"] = counts  # a blend: what each dataset supplied so far
        trainer.guard.after_step(step, record, span=trainer.observer.phase, report=report, late=late)
        if not late:
            record.update(trainer.observer.end_step(trainer.engine, report))
        layer_fields, layer_table = trainer.layers.end_step(step)  # traced steps only
        record.update(layer_fields)
        view = trainer.observer.report_view(record, layer_table) if report else None
        record.update(trainer.diagnosis.after_step(step, record, view))  # rank 0 names what drags
        trainer.metrics.write(record)
        trainer.exporter.update(record, list(trainer.diagnosis.active.values()))
        trainer.actions.after_step(step, record, trainer.diagnosis, report)  # may end the attempt
        trainer.callbacks.metrics(record, trainer.is_logger)
        if record.get("moe_hot_experts") and (step + 1) % cfg.log.interval == 0:
            trainer.log(
                f"threefold: step {step + 1}: experts above 2x their layer's mean load: "
                f"{', '.join(record['moe_hot_experts'])}"
            )
        trainer.status.update(step, result.loss, record["tokens_per_s"], record["mfu"])
        trainer.callbacks.step_end(step + 1, trainer)
        trainer.guard.after_record(step, trainer.metrics)
        return record

    def reports(self, step: int) -> bool:
        """Whether step `step` (0-based) is a report step: every log.interval steps, the last
        step and the traced ones. Only there do stragglers, spans and expert load go to rank 0:
        the other steps cost every rank the same, whatever the world size."""
        n, cfg = step + 1, self.trainer.cfg
        return n % cfg.log.interval == 0 or n == cfg.train.steps or n in self.trainer.observer.trace_steps

    def _roll_back(self, err: NonFiniteRollback) -> None:
        """Every rank reloads the newest checkpoint from before the streak (each took the same
        decision; the checkpoint is rank 0's choice, broadcast) and continues from its step; a
        divergence that comes back no later than last time is an error."""
        trainer, c = self.trainer, self.trainer.cfg.checkpoint
        if not c.dir:
            raise DivergedError(
                f"train: {err} and there is no checkpoint to roll back to "
                "(set checkpoint.dir and checkpoint.interval, or lower train.lr)"
            ) from None
        if self.last_divergence is not None and err.step <= self.last_divergence:
            raise DivergedError(
                f"train: {err}, again after rolling back (lower train.lr or check the data around step {err.step + 1})"
            ) from None
        self.last_divergence = err.step
        if trainer.is_logger:
            print(f"threefold: {err}: rolling back to the last checkpoint", file=sys.stderr, flush=True)
        # A checkpoint saved during the streak holds the same weights (its steps were skipped)
        # but would skip the steps that failed: the newest from before the streak.
        if not trainer.reload(at_most=err.step - err.count + 1):
            raise DivergedError(
                f"train: {err} and there is no checkpoint to roll back to in {c.dir} (none saved yet, "
                "or none verifies: save more often with checkpoint.interval, or lower train.lr)"
            ) from None
