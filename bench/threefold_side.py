"""threefold as a benchmark contestant: its Trainer, so a bench times the very step `threefold
train` runs (schedule, gradient finalization, the ranks' agreement on the step, AdamW, the
loss and health reductions), not a copy of it."""

from __future__ import annotations

import tempfile


class MemoryAfterFirstStep:
    """A Trainer probe: the engine's model-state bytes once, after the first update (before
    zero_grad, where the PyTorch peers are measured too)."""

    def __init__(self):
        self.report = None

    def watch(self, chunks):
        import contextlib

        return contextlib.nullcontext()

    def after_step(self, engine) -> None:
        if self.report is None:
            from threefold.distributed.data_parallel import measure_memory

            self.report = measure_memory(engine)


def trainer(cfg, grid, probe=None):
    """A Trainer on `grid` (CPU) whose records go to a throw-away directory."""
    import torch

    from threefold.training.trainer import Trainer

    cfg.log.dir, cfg.log.quiet = tempfile.mkdtemp(prefix="threefold-bench-"), True
    return Trainer(cfg, grid, torch.device("cpu"), log=lambda *args: None, probe=probe)


def stepper(trainer):
    """step(micro_batches) -> the global batch's loss per token, one train_step per call."""
    count = [0]

    def step(micro) -> float:
        result = trainer.train_step(count[0], micro)
        count[0] += 1
        return result.loss

    return step
