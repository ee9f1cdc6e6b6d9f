"""Process-group start-up and orderly shutdown for one worker (under torchrun or in-process), and
the phases whose collectives wait longer than train.timeout_s.

    give_deadlines(grid, timeout_s, startup_s)  # start-up: every group waits startup_s ...
    startup_done(grid)                          # ... until after the first step; then timeout_s
    with patient(grid.world): save()            # startup_s again while one rank writes or hashes

A phase ends with a barrier under its long deadline before the regular one returns, so no rank
issues a collective under the short deadline while a peer is still inside the phase. On NCCL a
collective gets its group's deadline when it is issued and the watchdog aborts the rank when it
runs out (barrier(timeout=) is ignored there), so the deadline is set on the groups themselves
(comm.set_timeout); NCCL's barrier blocks the host until it has completed, which also drains the
work queued before it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from threefold.config import Config
from threefold.distributed import comm, hang
from threefold.distributed.grid import RankLayout
from threefold.errors import ConfigError

if TYPE_CHECKING:
    from threefold.distributed.grid import Grid


@dataclass(frozen=True)
class WorkerEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    restart_count: int

    @classmethod
    def from_environ(cls) -> WorkerEnv:
        env = os.environ
        return cls(
            int(env.get("RANK", 0)),
            int(env.get("WORLD_SIZE", 1)),
            int(env.get("LOCAL_RANK", 0)),
            int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", 1))),
            int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
        )


def under_launcher() -> bool:
    """True inside a process started by torchrun / the elastic agent."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def resolve_device(kind: str, local_rank: int) -> torch.device:
    """This worker's device. On CUDA the local rank picks the GPU modulo the GPUs the process
    sees: a launcher that hands each process its own GPU (CUDA_VISIBLE_DEVICES=<one id>, as
    Slurm's --gpus-per-task does) leaves every process one visible device, index 0."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise ConfigError("train.device", "cuda: no CUDA device is visible to this process", "valid: auto or cpu")
        index = local_rank % count
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(kind)


def init_distributed(device: torch.device, timeout_s: float, store=None) -> WorkerEnv:
    """Join the job's process group (NCCL on CUDA, gloo on CPU).

    Under the elastic agent the group lives on a store prefixed by the restart count: restarted
    workers would otherwise read the dead attempt's stale gloo keys and fail to connect.
    `store`: the launcher's store when this worker's RANK and WORLD_SIZE are its seat in the round
    (training/seats.py), not the ones torchrun numbered the store's clients by.
    """
    env = WorkerEnv.from_environ()
    # torch's flight recorder (a ring of hang.FR_ENTRIES collectives per process; its cost is
    # within the noise of a 25 us gloo call) for a hang's attribution; a user's setting wins.
    os.environ.setdefault(hang.FR_ENV, str(hang.FR_ENTRIES))
    comm.join(
        "nccl" if device.type == "cuda" else "gloo",
        device,
        timedelta(seconds=timeout_s),
        env.restart_count,
        under_launcher(),
        None if store is None else (store, env.rank, env.world_size),
    )
    return env


def shutdown_distributed() -> None:
    """Leave the job's group together with the other ranks (comm.leave)."""
    comm.leave()


def abandon_distributed() -> None:
    """Destroy this process's groups, if any are left, without waiting for the other ranks (a
    failed worker's peers may be gone): a later run in the same process can join a new group."""
    if comm.is_initialized():
        comm.destroy_group(None)


def _distinct(groups: Iterable[comm.Group]) -> list[comm.Group]:
    """Each Group object once (dp_cp is dp without cp), those with a communicator."""
    seen: dict[int, comm.Group] = {}
    for group in groups:
        if group.pg is not None:
            seen.setdefault(id(group), group)
    return list(seen.values())


def give_deadlines(grid: Grid, timeout_s: float, startup_s: float) -> None:
    """Every group of `grid` waits `startup_s` (train.startup_timeout_s) until startup_done(grid):
    building, resuming and compiling happen rank by rank while peers wait in collectives they
    issued. After it, `timeout_s` (train.timeout_s), and `startup_s` again inside patient()."""
    regular, long = timedelta(seconds=timeout_s), timedelta(seconds=startup_s)
    for group in _distinct(grid.groups.values()):
        group.deadlines = comm.Deadlines(regular, long)
    _open(grid.groups.values())


def startup_done(grid: Grid) -> None:
    """The start-up phase give_deadlines opened ends (collective over the world: a barrier under
    its deadline); the regular deadline holds from here. Called again, it does nothing."""
    if any(g.deadlines is not None and g.deadlines.open_phases for g in _distinct([grid.world])):
        _close(grid.groups.values(), grid.world)


@contextlib.contextmanager
def patient(group: comm.Group) -> Iterator[None]:
    """Collectives on `group` inside wait its patient deadline (a no-op for a group without
    deadlines); collective: every rank of `group` enters and leaves it together. A phase left by
    an exception ends without its barrier (a rank that failed may have peers that did not)."""
    opened = _open([group])
    try:
        yield
    except BaseException:
        _close(opened, None)
        raise
    _close(opened, group)


def _open(groups: Iterable[comm.Group]) -> list[comm.Group]:
    """One more open phase on each group with deadlines; those it makes patient wait that long."""
    opened = [g for g in _distinct(groups) if g.deadlines is not None]
    for group in opened:
        group.deadlines.open_phases += 1
        if group.deadlines.open_phases == 1:
            comm.set_timeout(group, group.deadlines.patient)
    return opened


def _close(groups: Iterable[comm.Group], barrier: comm.Group | None) -> None:
    """One phase fewer on each group; where the last one closes, the regular deadline returns,
    after a barrier on `barrier` (under the patient deadline) when one is given."""
    ending = [g for g in _distinct(groups) if g.deadlines is not None and g.deadlines.open_phases == 1]
    if ending and barrier is not None:
        comm.barrier(barrier)
    for group in _distinct(groups):
        if group.deadlines is not None and group.deadlines.open_phases > 0:
            group.deadlines.open_phases -= 1
            if group.deadlines.open_phases == 0:
                comm.set_timeout(group, group.deadlines.regular)


def layout_of(cfg: Config) -> RankLayout:
    p = cfg.parallel
    return RankLayout(tp=p.tp, cp=p.cp, ep=p.ep, dp=p.dp, pp=p.pp, order=p.order)


def join_group(cfg: Config, env: WorkerEnv, timeout_s: float | None = None, store=None) -> torch.device:
    """This process's device (its intra-op threads on CPU), and the job's process group joined
    with `timeout_s` (default train.timeout_s), on `store` when given (init_distributed)."""
    device = resolve_device(cfg.train.device, env.local_rank)
    if device.type == "cpu":
        torch.set_num_threads(cfg.train.threads)
    init_distributed(device, cfg.train.timeout_s if timeout_s is None else timeout_s, store)
    return device
