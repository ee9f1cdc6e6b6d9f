"""What the training loop does to survive failures: a RunGuard per attempt, with three hook
points the loop (training/loop.py) calls for every step, in this order (a step read one step late
gets its two record hooks after the next step began), and one at the end:

    guard = RunGuard(cfg, grid, chunks, state, start_step, log, scaler)
    guard.before_step(step)                  # as the step begins: the fault drills (kill, hang, NaN)
    guard.after_step(step, record, span, report, late)  # its record: stragglers, counters, save, goodput
    guard.after_record(step, metrics)        # once the record is written: roll back when it is due
    guard.close()                            # at the end: the save in flight, goodput.json

Inside the step (Trainer.queue_step and read_step) its agreement, after the update: one MAX
all-reduce that makes every rank count a NaN step alike and stop after the same step (the skip
itself is decided before the update from the global norm, health.skip_nonfinite), and the host's
side once it is read:

    compute_s = guard.compute_time(step, pipe)     # a slow drill; the straggler check's input
    guard.agree(norm, loss_sum, compute_s, engine, worst, stop)
    worst = guard.settle(host_values)              # after the step's host read (of guard.take_pending())

Between before_step and after_step the loop asks whether a step saves (save_due) or the run stops after it
(stopping): such a step is read at once. A fault drill costs a step nothing when none is set.
Saves come in two tiers, each on its own interval (cadence.py, fixed or `auto`): storage
(checkpoint.dir) and memory replicas (checkpoint.memory_interval, checkpoint/replicas.py); a
storage save is always snapshotted to memory too, so memory is never older than storage. A
storage save that fails (a full disk) is one line and the run goes on from the previous
checkpoint, unless it is the last one or a signal's.
See faults.py, health.py, cadence.py, checkpoint/writer.py and observe/goodput.py.
"""

from __future__ import annotations

import contextlib
import sys
import time
import uuid

import torch

from threefold.checkpoint.manifest import CheckpointError
from threefold.checkpoint.writer import Checkpointer
from threefold.config import Config
from threefold.distributed.runtime import WorkerEnv
from threefold.observe.goodput import Goodput
from threefold.training.cadence import Cadence
from threefold.training.faults import FaultInjector
from threefold.training.health import NonFiniteRollback, StepHealth


def continues_run(start_step: int) -> bool:
    """This attempt appends to an earlier one's records (resumed, restarted or rolled back)."""
    return start_step > 0 or WorkerEnv.from_environ().restart_count > 0


class RunGuard:
    def __init__(
        self,
        cfg: Config,
        grid,
        chunks: list,
        state: list,
        start_step: int,
        log=print,
        scaler=None,
        faults: FaultInjector | None = None,
        on_saved=lambda step, directory: None,
        fingerprint: dict | None = None,
        replicas=None,
        attempt_start: dict | None = None,
        updates=None,
    ):
        """`scaler`: the engine's loss scaler, whose state each checkpoint carries (fp16).
        `faults`: the injector of an earlier attempt in this process (a rollback), already
        installed on `chunks`; None builds and installs one. `on_saved(step, directory)`: after
        each checkpoint is published (directory on the publishing rank, None elsewhere).
        `fingerprint`: the stack (preflight/fingerprint.py) each checkpoint's manifest records.
        `replicas`: the run's memory replicas (checkpoint/replicas.py), or None.
        `attempt_start`: when this attempt started, pre-flighted and loaded, for its first record
        (goodput's recovery parts). `updates()`: the updates the optimizer applied so far, which
        each checkpoint records as `optimizer_step` (AdamW's bias correction; a skipped step is
        not one); None: every step counted."""
        self.fingerprint, self.replicas, self.attempt_start = fingerprint, replicas, attempt_start
        self.updates = updates
        t, c = cfg.train, cfg.checkpoint
        self.scaler = scaler
        self.cfg, self.rank, self.log = cfg, grid.global_rank, log
        is_logger = grid.global_rank == 0
        self.segment = uuid.uuid4().hex[:8]
        if faults is None:
            faults = FaultInjector.from_config(
                cfg.train, cfg.log.dir, grid.global_rank, WorkerEnv.from_environ().restart_count
            )
            faults.install(chunks)
        self.faults = faults
        faults.lose_memory = self._lose_memory  # ramloss, killnode: this node's memory replicas go
        self.health = StepHealth(
            grid.world,
            t.nan_rollback_after,
            t.straggler_steps,
            log if is_logger else (lambda *_: None),
            # Only the first rank names stragglers: the others skip the O(world) table.
            stage_of=[grid.layout.coords(r)["pp"] for r in range(grid.world.size)] if is_logger else None,
        )
        self.goodput = Goodput(cfg.log.dir, enabled=is_logger, continuing=continues_run(start_step))
        # Events of the whole run, every attempt included (steps lost to a failure too): a NaN
        # that forced a rollback still happened. Rank 0 reports them; it read the records.
        self.health.skipped = self.goodput.previous_counters.get("steps_skipped", 0)
        self.health.nonfinite = self.goodput.previous_counters.get("nonfinite_steps", 0)
        self.cadence = Cadence(cfg, grid, self.goodput, log, start_step, memory=replicas is not None)
        self._said: str | None = None  # the replicas' last failure said
        self.ckpt = None
        if c.dir:
            self.ckpt = Checkpointer(
                c.dir,
                state,
                cfg.to_dict(),
                grid.describe(),
                c.keep,
                c.async_save,
                on_published=lambda step, directory: (
                    self.faults.after_save(step, directory),
                    on_saved(step, directory),
                ),
                group=grid.world,
            )

    def before_step(self, step: int) -> None:
        """Hook point: step `step` begins. The fault drills due now kill or hang this rank, or arm
        the NaN hook; faults.jsonl records the time first (goodput's failure)."""
        if self.faults.armed:  # faults.jsonl dates each as it fires (goodput's failure time)
            self.faults.step_begins(step, on_fault=lambda fault: None)

    def _lose_memory(self) -> None:
        if self.replicas is not None:
            self.replicas.store.wipe()

    def compute_time(self, step: int, pipe) -> float:
        """This rank's compute seconds in the schedule (waits for other stages excluded), stretched
        by a slow drill."""
        compute_s = sum(pipe.compute_s.values())
        return self.faults.slow(step, compute_s) if self.faults.armed else compute_s

    def agree(
        self,
        grad_norm: torch.Tensor,
        loss_sum: torch.Tensor,
        compute_s: float,
        engine,
        worst=(0.0, 0.0, 0.0, 0.0),
        stop: int = 0,
    ) -> None:
        self.health.agree(grad_norm, loss_sum, compute_s, engine.scaler.enabled, worst, stop)

    @property
    def stopping(self) -> int:
        """The signal a read step showed some rank received (0: none): save and stop after it."""
        return self.health.stop

    def take_pending(self) -> torch.Tensor:
        """The step's reduced health vector, handed to the caller for its one host read (see
        settle); the next step's agree() may run before that read."""
        pending, self.health.pending = self.health.pending, None
        return pending

    def settle(self, values: list[float]) -> dict:
        return self.health.settle(values)

    def _storage_due(self, step: int) -> bool:
        """Every checkpoint.interval steps (cadence.py), the last, and the one a signal stops after."""
        due = self.cadence.storage_due(step) or step + 1 == self.cfg.train.steps or self.stopping
        return self.ckpt is not None and bool(due)

    def save_due(self, step: int) -> bool:
        """Whether after_step(step) saves a checkpoint: to storage (see _storage_due), or a memory
        snapshot every checkpoint.memory_interval steps."""
        return self._storage_due(step) or (self.replicas is not None and self.cadence.memory_due(step))

    def after_step(self, step: int, record: dict, span=None, report: bool = True, late: bool = False) -> None:
        """Hook point: step `step` was read and its metrics `record` is being made. Add health
        counters, save a checkpoint when one is due (its blocking time) and the goodput fields;
        `span("checkpoint")` times the save. On a `report` step rank 0 gets every rank's compute
        times and names stragglers (collective). A `late` step (read after the next one was
        queued) never saves: the state is past it."""
        if report:
            self.health.report()
        record.update(self.health.record(step, not record["step_skipped"]))
        record["segment"] = self.segment
        record["ckpt_block_s"] = 0.0
        if self.replicas is not None:
            record["snapshot_block_s"] = 0.0
        if not late and self.save_due(step):
            extra = {"optimizer_step": self.updates() if self.updates is not None else step + 1}
            if self.fingerprint is not None:
                extra["fingerprint"] = self.fingerprint
            if self.scaler is not None:
                extra["loss_scaler"] = self.scaler.state_dict()
            storage = self._storage_due(step)
            with span("checkpoint") if span is not None else contextlib.nullcontext():
                if self.replicas is not None:  # memory first (a host copy): never older than storage
                    record["snapshot_block_s"] = self.replicas.snapshot(step + 1, extra)
                    self.cadence.saved("memory", step, record["snapshot_block_s"])
                if storage:
                    if self.faults.armed:
                        self.ckpt.fail_next = self.faults.save_error(step)
                    record["ckpt_block_s"] = self._saving(step, lambda: self.ckpt.save(step + 1, extra))
                    self.cadence.saved("storage", step, record["ckpt_block_s"])
                self.goodput.write()  # the save's own bookkeeping: timed with it
        elif report and self.ckpt is not None and self.ckpt.in_flight:
            # An asynchronous save is published at the first report step after it (every rank
            # is there together; its file is written by now unless the disk is slower than
            # log.interval steps, which then blocks here), not only when the next save begins.
            with span("checkpoint") if span is not None else contextlib.nullcontext():
                record["ckpt_block_s"] = self._saving(step, self.ckpt.wait)
        if self.replicas is not None and self.replicas.error and self.replicas.error != self._said:
            self._said = self.replicas.error  # this rank's own failure, said once
            print(f"threefold: {self._said}; the previous memory copy stays", file=sys.stderr, flush=True)
        if self.attempt_start is not None:
            record["attempt_start"], self.attempt_start = self.attempt_start, None
        if self.goodput.enabled:
            self.cadence.observe(record)
        if report and not late:
            self.cadence.rechoose(step)  # interval auto: collective
        record.update(self.goodput.update(record))
        if report:
            self.goodput.progress()

    def _saving(self, step: int, save) -> float:
        """Run `save` (a storage save or the publication of one in flight); returns the seconds it
        blocked. A save that fails on any rank raises the same CheckpointError everywhere: the
        last step's and a signal's end the run as before; any other is one line, and training goes
        on from the previous checkpoint (a full disk must not cost the run)."""
        t0 = time.perf_counter()
        try:
            blocked = save()
        except CheckpointError as err:
            if step + 1 == self.cfg.train.steps or self.stopping:
                raise
            self.log(f"threefold: {err}; training goes on (the previous checkpoint stays)")
            return time.perf_counter() - t0
        return time.perf_counter() - t0 if blocked is None else blocked

    def after_record(self, step: int, metrics) -> None:
        """Hook point: step `step`'s record is written (and the callbacks have seen it). After
        train.nan_rollback_after non-finite steps in a row, finish the save in flight, close
        `metrics` and raise NonFiniteRollback: the loop reloads a checkpoint."""
        if self.health.rollback_due:
            self.close()
            metrics.close()
            raise NonFiniteRollback(step, self.health.in_a_row)

    def close(self) -> None:
        """Wait for the save in flight (the end of training blocks on it too) and write the summary."""
        if self.replicas is not None:
            self.replicas.wait()
        if self.ckpt is not None:
            t0 = time.perf_counter()
            self.ckpt.close()
            self.goodput.checkpoint_s += time.perf_counter() - t0
        self.goodput.write()
