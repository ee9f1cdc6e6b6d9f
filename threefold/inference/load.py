"""Build this rank's model chunks for a layout and fill them from a checkpoint of any layout."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from threefold.checkpoint import Manifest, load_into, model_tensors, open_checkpoint
from threefold.config import Config, ModelConfig
from threefold.distributed.grid import Grid
from threefold.distributed.parallelize import build_model
from threefold.distributed.pipeline.partition import stage_layer_ids


def build_chunks(cfg: Config, grid: Grid, device: torch.device) -> list[nn.Module]:
    """This rank's virtual-stage chunks (one without interleaving), as training builds them."""
    p, v = cfg.parallel.pp, cfg.parallel.vpp
    stages = stage_layer_ids(cfg.model, p, v, cfg.parallel.stage_layers)
    ids = [c * p + grid.pp_rank for c in range(v)]
    return [build_model(cfg, grid, device, stages[s], s == 0, s == p * v - 1) for s in ids]


def tied_aliases(chunks: list[nn.Module], tied: bool) -> dict[int, str]:
    """A last stage without the embedding holds a copy of the tied weight: it loads from the embedding."""
    if not tied:
        return {}
    return {id(c.head.weight): "tok_embed.weight" for c in chunks if c.head is not None and c.tok_embed is None}


def load_model(chunks: list[nn.Module], cfg: Config, directory: Path, manifest: Manifest) -> None:
    load_into(model_tensors(chunks, tied_aliases(chunks, cfg.model.tie_embeddings)), directory, manifest)


def checkpoint_model_config(path: str) -> tuple[Path, Manifest, ModelConfig]:
    directory, manifest = open_checkpoint(path)
    return directory, manifest, ModelConfig(**manifest.config["model"])
