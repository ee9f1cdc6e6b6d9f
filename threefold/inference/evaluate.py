"""Validation loss and perplexity on held-out windows, in any layout.

Data-parallel rank r takes windows r, r+dp, ...; its pipeline and tensor-parallel peers take
the same ones. Every dp rank runs the same number of micro-batches (a rank with fewer windows
repeats one and discards its loss), because ZeRO-3 gathers parameters collectively over dp in
each forward. The summed loss leaves the last stage's first TP rank (the vocab-parallel loss is
already whole on every TP rank) and is summed over the world in fp64, so the result depends
on the layout only through summation order.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from threefold.config import Config
from threefold.data.heldout import HeldOut
from threefold.distributed.comm import all_reduce_sum
from threefold.distributed.context_parallel.apply import split_sequence
from threefold.distributed.grid import Grid
from threefold.inference.forward import pipeline_forward


def evaluate(chunks: list[nn.Module], grid: Grid, cfg: Config, held: HeldOut) -> dict:
    """{"loss", "perplexity", "tokens"} of the held-out windows (seq_len + 1 tokens each)."""
    starts = held.starts
    seq, mb, dp = cfg.model.seq_len, cfg.train.micro_batch, grid.layout.dp
    mine = starts[grid.dp_rank :: dp]
    rounds = math.ceil(math.ceil(len(starts) / dp) / mb)
    was_training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    total = 0.0
    try:
        for i in range(rounds):
            batch = mine[i * mb : (i + 1) * mb]
            real = len(batch) > 0
            if not real:  # keep in step with the other dp ranks (ZeRO-3 gathers); loss discarded
                batch = starts[:1]
            x, y = (split_sequence(t, grid) for t in held.windows(batch))  # cp: this rank's columns
            out = pipeline_forward(chunks, grid, x, y, cfg.model.hidden, cfg.parallel.sp)
            if out is not None and real:
                total += float(out.double())
    finally:
        for c, mode in zip(chunks, was_training):
            c.train(mode)
    owner = grid.is_last_stage and grid.tp_rank == 0
    device = next(chunks[0].parameters()).device
    summed = all_reduce_sum(torch.tensor([total if owner else 0.0], dtype=torch.float64, device=device), grid.world)
    n = len(starts) * seq
    loss = float(summed[0]) / n
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": n}


class HeldOutEval:
    """Validation loss on a run's held-out windows (threefold.data.heldout), loaded once."""

    def __init__(self, cfg: Config):
        self.held = HeldOut(cfg)

    def evaluate(self, chunks: list[nn.Module], grid: Grid, cfg: Config) -> dict:
        return evaluate(chunks, grid, cfg, self.held)
