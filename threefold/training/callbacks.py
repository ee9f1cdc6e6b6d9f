"""Hooks a library user hands the training loop (threefold.train(cfg, callbacks=...)).

    Callbacks(on_metrics=print)                       # each metrics.jsonl record, on rank 0
    Callbacks(on_step_end=lambda step, trainer: ...)  # every rank, after each step's record
    Callbacks(on_checkpoint=lambda step, path: ...)   # rank 0, once a checkpoint is published

They run in the loop's thread between two steps: whatever they take is host time the run does not
train. A callback that raises stops the run like any other error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Callbacks:
    on_metrics: Callable[[dict], None] | None = None
    """Each step's metrics record (the line metrics.jsonl gets), on rank 0 only."""
    on_step_end: Callable[[int, object], None] | None = None
    """(step counted from 1, the Trainer) on every rank, after the step's record."""
    on_checkpoint: Callable[[int, Path], None] | None = None
    """(step, the checkpoint's directory) on rank 0, once every rank's files are in it."""

    def metrics(self, record: dict, is_logger: bool) -> None:
        if self.on_metrics is not None and is_logger:
            self.on_metrics(record)

    def step_end(self, step: int, trainer) -> None:
        if self.on_step_end is not None:
            self.on_step_end(step, trainer)

    def checkpoint(self, step: int, directory: Path | None) -> None:
        if self.on_checkpoint is not None and directory is not None:
            self.on_checkpoint(step, directory)
