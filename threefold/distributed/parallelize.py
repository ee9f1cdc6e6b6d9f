"""Build this rank's part of the model: plain model -> parallelism applied -> materialized -> initialized.

The order is fixed (as in torchtitan):
  1. construct the plain model on the meta device (no memory);
  2. tensor/sequence parallelism swaps linears, embedding and loss for sharded ones; expert
     parallelism keeps this rank's experts and routes tokens to the others by all-to-all;
  3. activation recomputation wraps blocks (after TP, so a rerun repeats the TP collectives);
     train.compile then compiles each block, TP/EP/recompute modules kept eager (model/compile.py);
  4. materialize only this rank's shards, declare each parameter's sharding record once
     (model/sharding.py), re-tie tied weights, fill them with the layout-invariant initializer
     (with `defer_init`, ZeRO 3's: the trained parameters stay on the meta device with what
     their values will be, and the engine materializes them one unit at a time, so no rank
     ever holds its whole TP/PP-local model);
  5. seed the dropout generator for this rank's place in the grid.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from threefold.config import Config
from threefold.distributed.expert_parallel import apply_expert_parallel
from threefold.distributed.grid import Grid
from threefold.distributed.tensor_parallel import apply_tensor_parallel
from threefold.model.compile import compile_blocks
from threefold.model.meta import materialize, on_meta, tie_and_defer, tie_and_init
from threefold.model.recompute import apply_recompute
from threefold.model.sharding import declare
from threefold.model.transformer import Transformer


def build_model(
    cfg: Config,
    grid: Grid,
    device: torch.device,
    layer_ids: list[int] | None = None,
    first: bool = True,
    last: bool = True,
    defer_init: bool = False,
) -> nn.Module:
    """The whole model, or one pipeline chunk (its `layer_ids`, with the embedding if `first`
    and the head and loss if `last`). `defer_init`: leave the trained parameters on the meta
    device for the ZeRO-3 engine to materialize (model/meta.py: tie_and_defer)."""
    with on_meta():
        model = Transformer(cfg.model, layer_ids, first, last)
        apply_tensor_parallel(model, grid, cfg.parallel.sp, cfg.parallel.tp_comm_overlap)
        apply_expert_parallel(model, grid, cfg.model)
    apply_recompute(model, cfg.train.recompute, cfg.train.recompute_layers)
    if cfg.train.compile:  # after TP/EP/recompute: their modules stay outside the compiled code
        compile_blocks(model, cfg.train.compile_backend)
    materialize(model, device, defer=defer_init)
    declare(model, grid.tp)
    if defer_init:
        tie_and_defer(model, cfg.model, cfg.train.seed, device, first, last)
    else:
        tie_and_init(model, cfg.model, cfg.train.seed, first, last)
    torch.manual_seed(dropout_seed(cfg.train.seed, grid, cfg.parallel.sp))
    return model


def dropout_seed(seed: int, grid: Grid, sp: bool) -> int:
    """Seed of the default generator, which only dropout draws from. TP ranks share it while
    they hold the same replicated activations (their masks must agree); under SP each rank holds
    different sequence rows, and data-parallel ranks different samples: those seeds differ."""
    key = f"{seed}/dropout/dp{grid.dp_rank}/pp{grid.pp_rank}/tp{grid.tp_rank if sp else 0}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1
