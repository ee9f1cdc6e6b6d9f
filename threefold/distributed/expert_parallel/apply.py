"""Apply expert parallelism to a plain Transformer (on the meta device, after tensor
parallelism): each MoE layer keeps experts [ep_rank * E/ep, (ep_rank+1) * E/ep) and routes
through the all-to-all dispatcher. The expert weights declare their slice of the full stacked
tensor in `shard_specs` over grid.ep, so the layout-invariant initializer, the checkpoint
manifest and the gradient norm (each expert counted once over ep) treat them like any shard.
"""

from __future__ import annotations

from torch import nn

from threefold.config import ModelConfig
from threefold.distributed.expert_parallel.dispatch import AllToAllDispatcher
from threefold.distributed.grid import Grid
from threefold.model.init import ShardSpec
from threefold.model.moe import Experts, moe_layers


def _shard_experts(experts: Experts, group, cfg: ModelConfig) -> Experts:
    local = experts.num // group.size
    first = group.rank * local
    mine = Experts(cfg, num=local)
    for name in ("w1", "w3", "w2"):
        part = getattr(mine, name)
        if part is None:
            continue
        rows = part.out_features
        part.shard_specs = {"weight": ShardSpec(0, first * rows, local * rows, (experts.num * rows, part.in_features))}
        part.shard_group = group
    return mine


def apply_expert_parallel(model: nn.Module, grid: Grid, cfg: ModelConfig) -> nn.Module:
    """A no-op without MoE layers or when ep is 1 (every rank holds every expert)."""
    layers = moe_layers(model)
    if not layers or grid.ep.size == 1:
        return model
    for moe in layers.values():
        moe.experts = _shard_experts(moe.experts, grid.ep, cfg)
        moe.dispatcher = AllToAllDispatcher(grid.ep, moe.num_experts)
    return model
