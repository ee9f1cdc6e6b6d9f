"""What the training loop does to survive failures, behind a few calls:

    guard = RunGuard(cfg, grid, chunks, state, start_step, log, scaler)
    guard.step_begins(step)                        # injected kill / hang / NaN
    compute_s = guard.compute_time(step, pipe)     # injected slowness; straggler input
    norm = guard.agree(norm, loss_sum, compute_s, engine, worst)  # one MAX all-reduce: skip NaN globally
    worst = guard.settle(host_values)              # after the step's host read (of guard.take_pending())
    guard.end_step(step, record, span, report)     # stragglers (report steps), counters, checkpoint, goodput
    guard.check_rollback(step, metrics)            # K non-finite steps in a row: roll back
    guard.close()

See faults.py, health.py, checkpoint/writer.py and observe/goodput.py.
"""

from __future__ import annotations

import contextlib
import time
import uuid

import torch

from threefold.checkpoint.writer import Checkpointer
from threefold.config import Config
from threefold.distributed.runtime import WorkerEnv
from threefold.observe.goodput import Goodput, record_fault
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
    ):
        """`scaler`: the engine's loss scaler, whose state each checkpoint carries (fp16).
        `faults`: the injector of an earlier attempt in this process (a rollback), already
        installed on `chunks`; None builds and installs one. `on_saved(step, directory)`: after
        each checkpoint is published (directory on the publishing rank, None elsewhere)."""
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

    def step_begins(self, step: int) -> None:
        self.faults.step_begins(step, on_fault=lambda f: record_fault(self.cfg.log.dir, self.rank, f.kind, step))

    def compute_time(self, step: int, pipe) -> float:
        """This rank's compute seconds in the schedule (waits for other stages excluded)."""
        return self.faults.slow(step, sum(pipe.compute_s.values()))

    def agree(
        self,
        grad_norm: torch.Tensor,
        loss_sum: torch.Tensor,
        compute_s: float,
        engine,
        worst=(0.0, 0.0, 0.0, 0.0),
        stop: int = 0,
    ) -> torch.Tensor:
        return self.health.agree(grad_norm, loss_sum, compute_s, engine.scaler.enabled, worst, stop)

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

    def save_due(self, step: int) -> bool:
        """Whether end_step(step) saves a checkpoint: every checkpoint.interval steps, the last,
        and the one a signal stops after."""
        c, t = self.cfg.checkpoint, self.cfg.train
        due = (c.interval and (step + 1) % c.interval == 0) or step + 1 == t.steps or self.stopping
        return self.ckpt is not None and bool(due)

    def end_step(self, step: int, record: dict, span=None, report: bool = True, late: bool = False) -> None:
        """Add health counters, save a checkpoint when one is due (its blocking time) and the
        goodput fields to this step's metrics record. `span("checkpoint")` times the save. On a
        `report` step rank 0 gets every rank's compute times and names stragglers (collective).
        A `late` step (read after the next one was queued) never saves: the state is past it."""
        if report:
            self.health.report()
        record.update(self.health.record(step, not record["step_skipped"]))
        record["segment"] = self.segment
        record["ckpt_block_s"] = 0.0
        if not late and self.save_due(step):
            extra = {"optimizer_step": step + 1}
            if self.scaler is not None:
                extra["loss_scaler"] = self.scaler.state_dict()
            with span("checkpoint") if span is not None else contextlib.nullcontext():
                record["ckpt_block_s"] = self.ckpt.save(step + 1, extra)
            self.goodput.write()
        elif report and self.ckpt is not None and self.ckpt.in_flight:
            # An asynchronous save is published at the first report step after it (every rank
            # is there together; its file is written by now unless the disk is slower than
            # log.interval steps, which then blocks here), not only when the next save begins.
            with span("checkpoint") if span is not None else contextlib.nullcontext():
                t0 = time.perf_counter()
                self.ckpt.wait()
                record["ckpt_block_s"] = time.perf_counter() - t0
        record.update(self.goodput.update(record))

    def check_rollback(self, step: int, metrics) -> None:
        """Raise NonFiniteRollback (after finishing the save in flight) when it is due."""
        if self.health.rollback_due:
            self.close()
            metrics.close()
            raise NonFiniteRollback(step, self.health.in_a_row)

    def close(self) -> None:
        """Wait for the save in flight (the end of training blocks on it too) and write the summary."""
        if self.ckpt is not None:
            t0 = time.perf_counter()
            self.ckpt.close()
            self.goodput.checkpoint_s += time.perf_counter() - t0
        self.goodput.write()
