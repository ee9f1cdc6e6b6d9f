"""Process-group start-up and orderly shutdown for one worker (under torchrun or in-process)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from threefold.distributed import comm
from threefold.errors import ConfigError


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


def init_distributed(device: torch.device, timeout_s: float) -> WorkerEnv:
    """Join the job's process group (NCCL on CUDA, gloo on CPU).

    Under the elastic agent the group lives on a store prefixed by the restart count: restarted
    workers would otherwise read the dead attempt's stale gloo keys and fail to connect.
    """
    env = WorkerEnv.from_environ()
    comm.join(
        "nccl" if device.type == "cuda" else "gloo",
        device,
        timedelta(seconds=timeout_s),
        env.restart_count,
        under_launcher(),
    )
    return env


def shutdown_distributed() -> None:
    """Leave the job's group together with the other ranks (comm.leave)."""
    comm.leave()
