"""Per-step expert load of an MoE model: routed tokens per layer and expert, dropped tokens,
balance losses, and the experts running hot.

Each MoE layer counts what it routed on this rank (its tokens: its TP slice of its data-parallel
micro-batches); layers live on their pipeline stage. So a plain sum over every rank of a
[layers, experts + 3] table counts each token once. Ranks add up their tables step by step and
sum them over the world on report steps only (log.interval): no per-step collective or host read.
"""

from __future__ import annotations

import torch

from threefold.config import ModelConfig
from threefold.distributed.comm import all_reduce_sum
from threefold.model.moe import MoE, is_moe_layer, moe_layers

HOT = 2.0  # an expert routed more than HOT x the layer's mean is flagged


class ExpertLoad:
    def __init__(
        self, layers: dict[int, MoE], moe_rows: list[int], num_layers: int, num_experts: int, microbatches: int, device
    ):
        self.layers, self.moe_rows, self.num_layers, self.num_experts = layers, moe_rows, num_layers, num_experts
        self.microbatches, self.device = microbatches, device
        self.table: torch.Tensor | None = None  # counts since the last report
        self.steps = 0

    @classmethod
    def of(cls, chunks, model: ModelConfig, microbatches: int, device) -> ExpertLoad:
        """This rank's MoE layers; `microbatches` of the whole global batch."""
        layers = {i: layer for chunk in chunks for i, layer in moe_layers(chunk).items()}
        rows = [i for i in range(model.layers) if is_moe_layer(model, i)]
        return cls(layers, rows, model.layers, model.num_experts, microbatches, device)

    def set_loss_weight(self, loss_scale: float) -> None:
        """Every micro-batch's balance loss counts 1/micro-batches (a mean over the global batch),
        times the loss scale its gradient joins."""
        for layer in self.layers.values():
            layer.aux_weight = loss_scale / self.microbatches

    def collect(self, world, report: bool = True) -> dict:
        """The step's counts join this rank's running table (on the device, no communication);
        on a `report` step one sum over `world` (collective) gives the metrics of the steps
        since the last report (`moe_steps` of them; empty for a dense model)."""
        if not self.num_experts:
            return {}
        if self.table is None:
            self.table = torch.zeros(self.num_layers, self.num_experts + 3, device=self.device)
        for index, layer in self.layers.items():
            self.table[index] += layer.pop_stats().to(self.device)
        self.steps += 1
        if not report:
            return {}
        table, steps = all_reduce_sum(self.table, world), self.steps
        self.table, self.steps = None, 0
        moe_rows = self.moe_rows
        counts = table[moe_rows, : self.num_experts]
        mean = counts.mean(1, keepdim=True).clamp_min(1e-9)
        load = counts / mean
        hot = [f"L{moe_rows[r]}/E{e}" for r, e in (load > HOT).nonzero().tolist()]
        return {
            "moe_steps": steps,
            "moe_aux_loss": float(table[moe_rows, -2].mean()) / self.microbatches / steps,
            "moe_z_loss": float(table[moe_rows, -1].mean()) / self.microbatches / steps,
            "moe_dropped_tokens": int(table[:, -3].sum()),
            "moe_max_load": float(load.max()) if moe_rows else 0.0,
            "moe_expert_tokens": {str(i): [int(c) for c in counts[r].tolist()] for r, i in enumerate(moe_rows)},
            "moe_hot_experts": hot,
        }
