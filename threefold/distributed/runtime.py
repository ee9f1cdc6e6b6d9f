"""Process-group start-up and orderly shutdown for one worker (under torchrun or in-process)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class WorkerEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    restart_count: int

    @classmethod
    def from_environ(cls) -> "WorkerEnv":
        env = os.environ
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)),
                   int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", 1))),
                   int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))


def under_launcher() -> bool:
    """True inside a process started by torchrun / the elastic agent."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def resolve_device(kind: str, local_rank: int) -> torch.device:
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(kind)


def init_distributed(device: torch.device, timeout_s: float) -> WorkerEnv:
    """Join the job's process group (NCCL on CUDA, gloo on CPU).

    Under the elastic agent the group lives on a store prefixed by the restart count: restarted
    workers would otherwise read the dead attempt's stale gloo keys and fail to connect.
    """
    env = WorkerEnv.from_environ()
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if under_launcher():
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        store = dist.PrefixStore(f"threefold/attempt_{env.restart_count}", store)
    else:
        store, rank, world = dist.HashStore(), 0, 1
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
    return env


def shutdown_distributed() -> None:
    """Barrier, then destroy: ranks leave together, so no peer sees a closed connection mid-collective."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
