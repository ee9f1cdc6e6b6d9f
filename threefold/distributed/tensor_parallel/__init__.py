"""Tensor and sequence parallelism: collectives (mappings), the region entry and its overlapped
backward (region), sharded layers, and the model transform by a plan of module names (apply)."""

from threefold.distributed.tensor_parallel.apply import TP_PLAN, PlanContext, apply_plan, apply_tensor_parallel
from threefold.distributed.tensor_parallel.layers import (
    ColumnParallelLinear,
    HeadSliceLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "TP_PLAN",
    "PlanContext",
    "apply_plan",
    "apply_tensor_parallel",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "HeadSliceLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
]
