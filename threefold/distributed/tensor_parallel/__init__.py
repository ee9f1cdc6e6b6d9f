"""Tensor and sequence parallelism: collectives (mappings), sharded layers, and the model transform."""
from threefold.distributed.tensor_parallel.apply import apply_tensor_parallel, partial_grad_params
from threefold.distributed.tensor_parallel.layers import (ColumnParallelLinear, HeadSliceLinear, RowParallelLinear,
                                                           VocabParallelEmbedding, vocab_parallel_cross_entropy)

__all__ = ["apply_tensor_parallel", "partial_grad_params", "ColumnParallelLinear", "RowParallelLinear",
           "HeadSliceLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]
