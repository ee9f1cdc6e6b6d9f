"""Point-to-point transfers between neighbouring pipeline stages.

Shapes and dtypes are known ahead from the configuration (micro-batch, sequence shard,
hidden), so no per-micro-batch shape handshake is needed: a receive allocates its buffer and
posts. All transfers of one schedule step are posted together with batch_isend_irecv, which
lets a rank send forward and receive backward at once (no ordering deadlock between peers).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from threefold.distributed.grid import Group


@dataclass(frozen=True)
class WireFormat:
    """Shape and dtype of every activation/gradient crossing a stage boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)


@dataclass
class Transfer:
    """One send (tensor given) or receive (tensor allocated here) with a pipeline-rank peer."""

    send: bool
    peer: int
    tensor: torch.Tensor
    tag: object = None  # what the executor files the received tensor under


def exchange(transfers: list[Transfer], group: Group, stats=None) -> None:
    """Post all transfers as one batch and wait for them. Peers are pipeline ranks."""
    if not transfers:
        return
    ops = [dist.P2POp(dist.isend if t.send else dist.irecv, t.tensor, group.ranks[t.peer], group=group.pg)
           for t in transfers]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if stats is not None:
        for t in transfers:
            if t.send:
                stats.record("send", t.tensor.numel() * t.tensor.element_size())
