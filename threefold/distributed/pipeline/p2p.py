"""What crosses a pipeline stage boundary.

Shapes and dtypes are known ahead from the configuration (micro-batch, sequence shard,
hidden), so no per-micro-batch shape handshake is needed: a receive allocates its buffer and
posts (the executor batches the transfers with batch_isend_irecv).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WireFormat:
    """Shape and dtype of every activation/gradient crossing a stage boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)
