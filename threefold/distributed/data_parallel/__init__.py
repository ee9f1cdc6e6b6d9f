"""Data parallelism: bucketed gradient reduction overlapped with backward, the ZeRO 1/2/3
distributed AdamW, mixed precision with loss scaling, and memory accounting.

Process groups come from the `Grid` handed in (its `dp` group); nothing is looked up globally.
See docs/data_parallel.md.
"""

from threefold.distributed.data_parallel.engine import DataParallel
from threefold.distributed.data_parallel.experts import ExpertDataParallel, build_data_parallel
from threefold.distributed.data_parallel.memory import MemoryReport, measure_memory, predict_memory
from threefold.distributed.data_parallel.precision import LossScaler, MixedPrecision
from threefold.distributed.data_parallel.state import Piece, owned_pieces, refresh_params

__all__ = [
    "DataParallel",
    "ExpertDataParallel",
    "build_data_parallel",
    "LossScaler",
    "MemoryReport",
    "MixedPrecision",
    "Piece",
    "measure_memory",
    "owned_pieces",
    "predict_memory",
    "refresh_params",
]
