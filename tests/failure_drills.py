"""Failures staged inside real training workers, for tests/training/test_failures.py (module level: the
elastic agent's spawned workers and the harness's ranks import it).

    python failure_drills.py OVERRIDES_JSON DRILLS_JSON   # `threefold train` with drills, as cli.py
    slow_phases(cfg_dict, first_step_s, save_s)           # a harness rank with long host phases

A drill fires in a worker's step-end callback on one rank of one attempt. "watchdog" does, seen
from outside the process, what NCCL's watchdog does to a rank whose collective outlived its
deadline: it logs the watchdog's line to stderr and aborts the process (SIGABRT, no Python after).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass

WATCHDOG_LINE = (
    "[rank{rank}]:[E1202 06:45:59.184000 4242 torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:683] "
    "[PG ID 0 PG GUID 0(default_pg) Rank {rank}] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=41, OpType=ALLREDUCE, NumelIn=8, NumelOut=8, Timeout(ms)=5000) ran for 5012 "
    "milliseconds before timing out.\n"
)


@dataclass(frozen=True)
class Drill:
    what: str  # "watchdog", "hang" or "raise"
    rank: int
    step: int  # counted from 1: fires after this step's record
    attempt: int = 0
    message: str = ""

    def fire(self) -> None:
        if self.what == "watchdog":
            sys.stderr.write(WATCHDOG_LINE.format(rank=self.rank))
            sys.stderr.flush()
            os.abort()
        elif self.what == "hang":
            # Hung outside any step (its SIGTERM handler would wait for a boundary): the agent's
            # SIGTERM ends it, rather than torch's SIGKILL 30 s later.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(600)
        elif self.what == "raise":
            raise AttributeError(self.message)


@dataclass(frozen=True)
class Drills:
    """A step-end callback (threefold.Callbacks.on_step_end) firing each drill where it is due."""

    drills: tuple[Drill, ...]

    def __call__(self, step: int, trainer) -> None:
        rank = trainer.grid.global_rank
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        for drill in self.drills:
            if (drill.rank, drill.step, drill.attempt) == (rank, step, attempt):
                drill.fire()


def main(argv: list[str]) -> int:
    """`threefold train` with the overrides and drills given as JSON; one line and the exit code
    on a failure, as the command line does."""
    from threefold.api import configure, train
    from threefold.distributed.launch import WorkersFailed
    from threefold.training.callbacks import Callbacks

    overrides, drills = json.loads(argv[0]), json.loads(argv[1])
    callbacks = Callbacks(on_step_end=Drills(tuple(Drill(**d) for d in drills)))
    try:
        train(configure(None, overrides), callbacks=callbacks)
    except WorkersFailed as err:
        if str(err):
            print(f"threefold: {err}", file=sys.stderr)
        return err.exit_code
    return 0


def slow_phases(cfg_dict: dict, first_step_s: float, save_s: float):
    """One rank of a harness run (tests/harness.py run_ranks) through run_worker, with two long
    host phases its peers wait through: rank 1 takes `first_step_s` before its first step (as a
    compilation does) and rank 0 `save_s` writing each checkpoint (as dp rank 0 alone does)."""
    import threefold.checkpoint.writer as writer
    from threefold.training.trainer import Trainer
    from threefold.training.worker import run_worker

    rank = int(os.environ["RANK"])
    if rank == 1:
        queue_step = Trainer.queue_step

        def slow_first_step(self, step, *args, **kwargs):
            if step == self.start_step:
                time.sleep(first_step_s)
            return queue_step(self, step, *args, **kwargs)

        Trainer.queue_step = slow_first_step
    if rank == 0:
        write_shards = writer.write_shards

        def slow_write(*args, **kwargs):
            time.sleep(save_s)
            return write_shards(*args, **kwargs)

        writer.write_shards = slow_write
    return run_worker(cfg_dict)


class StopHere(Exception):
    """Raised by a step-end callback: the job ends as a failed one does (nothing cleaned up)."""


def train_then_stop(cfg_dict: dict, steps: int):
    """One rank of a harness run that trains `steps` steps and then fails on every rank at once,
    leaving its memory replicas in shared memory as a crashed job would (tests of a restart that
    finds them). The snapshot in flight is let finish first."""
    import torch

    from threefold.config import Config
    from threefold.distributed.grid import Grid
    from threefold.distributed.runtime import init_distributed, layout_of, shutdown_distributed
    from threefold.training.callbacks import Callbacks
    from threefold.training.trainer import Trainer

    def stop(step, _trainer):
        if step == steps:
            raise StopHere

    cfg = Config.from_dict(cfg_dict)
    init_distributed(torch.device("cpu"), timeout_s=120)
    trainer = Trainer(cfg, Grid.build(layout_of(cfg)), torch.device("cpu"), callbacks=Callbacks(on_step_end=stop))
    try:
        trainer.train()
    except StopHere:
        trainer.replicas.wait()
    shutdown_distributed()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
