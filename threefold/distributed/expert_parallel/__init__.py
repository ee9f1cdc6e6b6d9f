"""Expert parallelism: experts sharded over grid.ep, tokens exchanged by all-to-all."""

from threefold.distributed.expert_parallel.apply import apply_expert_parallel
from threefold.distributed.expert_parallel.dispatch import AllToAllDispatcher
from threefold.distributed.expert_parallel.mappings import all_to_all, exchange_counts

__all__ = ["AllToAllDispatcher", "all_to_all", "apply_expert_parallel", "exchange_counts"]
