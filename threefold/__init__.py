"""threefold: 3D-parallel (data x tensor x pipeline) training of transformer language models.

The stable names below are the library's surface (docs/library.md). Each is imported on first
use (module __getattr__), so `import threefold` stays cheap: the CLI's start-up, a worker's
spawn and `threefold plan` do not pay for torch until they need it.
"""

from __future__ import annotations

import importlib

from threefold.version import __version__

# name -> "module:attribute" it is exported from.
EXPORTS: dict[str, str] = {
    # configuration and the run
    "Config": "threefold.config:Config",
    "configure": "threefold.api:configure",
    "train": "threefold.api:train",
    "Callbacks": "threefold.training.callbacks:Callbacks",
    "Trainer": "threefold.training.trainer:Trainer",
    # your own model
    "ModelSpec": "threefold.model.custom:ModelSpec",
    "Parallel": "threefold.model.custom:Parallel",
    "UserModel": "threefold.model.custom:UserModel",
    "build_model": "threefold.distributed.parallelize:build_model",
    "apply_user_plan": "threefold.distributed.parallelize:apply_user_plan",
    # the rank grid
    "Grid": "threefold.distributed.grid:Grid",
    "RankLayout": "threefold.distributed.grid:RankLayout",
    # tensor parallelism: layers and the conjugate mappings
    "ColumnParallelLinear": "threefold.distributed.tensor_parallel.layers:ColumnParallelLinear",
    "RowParallelLinear": "threefold.distributed.tensor_parallel.layers:RowParallelLinear",
    "VocabParallelEmbedding": "threefold.distributed.tensor_parallel.layers:VocabParallelEmbedding",
    "vocab_parallel_cross_entropy": "threefold.distributed.tensor_parallel.layers:vocab_parallel_cross_entropy",
    "copy_to_region": "threefold.distributed.tensor_parallel.mappings:copy_to_region",
    "reduce_from_region": "threefold.distributed.tensor_parallel.mappings:reduce_from_region",
    "gather_from_sequence_region": "threefold.distributed.tensor_parallel.mappings:gather_from_sequence_region",
    "reduce_scatter_to_sequence_region": (
        "threefold.distributed.tensor_parallel.mappings:reduce_scatter_to_sequence_region"
    ),
    "scatter_to_sequence_region": "threefold.distributed.tensor_parallel.mappings:scatter_to_sequence_region",
    "gather_to_replicated": "threefold.distributed.tensor_parallel.mappings:gather_to_replicated",
    "gather_from_tensor_region": "threefold.distributed.tensor_parallel.mappings:gather_from_tensor_region",
    # pipeline: schedules as data, one executor
    "build_schedule": "threefold.distributed.pipeline.schedules:build_schedule",
    "gpipe": "threefold.distributed.pipeline.schedules:gpipe",
    "one_f_one_b": "threefold.distributed.pipeline.schedules:one_f_one_b",
    "interleaved_1f1b": "threefold.distributed.pipeline.schedules:interleaved_1f1b",
    "zero_bubble_h1": "threefold.distributed.pipeline.schedules:zero_bubble_h1",
    "PipelineExecutor": "threefold.distributed.pipeline.executor:PipelineExecutor",
    "build_stage": "threefold.distributed.pipeline.stage:build_stage",
    # data parallelism / ZeRO
    "build_data_parallel": "threefold.distributed.data_parallel.experts:build_data_parallel",
    "DataParallel": "threefold.distributed.data_parallel.engine:DataParallel",
    # checkpoints
    "Checkpointer": "threefold.checkpoint.writer:Checkpointer",
    "save_checkpoint": "threefold.checkpoint.io:save",
    "open_checkpoint": "threefold.checkpoint.io:open_checkpoint",
    "load_checkpoint": "threefold.checkpoint.io:load_into",
    "training_state": "threefold.checkpoint.state:training_state",
    # observability
    "SpanRecorder": "threefold.observe.spans:SpanRecorder",
}

__all__ = ["__version__", *EXPORTS]


def __getattr__(name: str):
    target = EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'threefold' has no attribute {name!r}")
    module, attr = target.split(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
