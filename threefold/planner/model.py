"""What the planner needs to know about a model, computed once from its config.

Parameter counts and FLOPs come from `threefold.model.flops` (the functions the training
metrics use), split into one transformer layer and the embedding/head part by evaluating them
at `layers=0`. Stages are cut the way `distributed/pipeline/partition.py` cuts them: layers
balanced by cost, the vocabulary head counted on the last stage.

Mixture of experts: a layer's parameters split into a dense part (attention, norms, dense MLPs,
router, shared expert), tensor-parallel and replicated over dp, and the routed experts, which
are not tensor-sharded (the TP ranks split tokens instead) but spread over the ep ranks and
replicated over expert_dp (docs/moe.md). FLOPs already count active parameters only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from threefold.config import ModelConfig
from threefold.model.flops import hardware_flops_per_token, moe_layers, total_params, train_flops_per_token

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class StageSplit:
    """How p * v virtual stages share the layers, seen from the two ranks that matter."""

    first_layers: int
    """Layers on pipeline rank 0 (all its chunks): the rank holding the most activations."""
    last_layers: int
    """Layers on the last pipeline rank (all its chunks), which also holds the head."""
    other_stage_layers: int
    """Layers of a virtual stage other than the last (the most any of them holds)."""


def split_layers(layers: int, p: int, v: int, layer_cost: float, head_cost: float) -> StageSplit:
    """Balanced cut of `layers` into S = p*v contiguous virtual stages, the last paying `head_cost`
    too: choose the last stage's layer count k >= 1 minimising max(k*c + H, ceil((L-k)/(S-1))*c).
    The same optimum as partition.balanced_partition's slowest stage, in O(L/S)."""
    s = p * v
    if s == 1:
        return StageSplit(layers, layers, layers)
    best = None
    for k in range(1, layers - (s - 1) + 1):
        other = math.ceil((layers - k) / (s - 1))
        cost = max(k * layer_cost + head_cost, other * layer_cost)
        if best is None or cost < best[0] * (1 - 1e-12):
            best = (cost, k, other)
    _, k, other = best
    return StageSplit(first_layers=v * other, last_layers=(v - 1) * other + k, other_stage_layers=other)


SHAPE_KEYS = (
    "preset",
    "arch",
    "hidden",
    "layers",
    "heads",
    "kv_heads",
    "ffn_hidden",
    "vocab",
    "seq_len",
    "tie_embeddings",
)
"""The [model] keys that fix a model's shape: what a plan writes and reports of the model."""
MOE_KEYS = ("num_experts", "top_k", "moe_every", "shared_expert", "capacity_factor")
"""The mixture-of-experts shape, written whenever the model has experts."""


@dataclass
class ModelShape:
    """Per-layer and per-model numbers of one model config (duck-typed like model.flops)."""

    cfg: object
    seq_len: int
    layer_params: float
    """Parameters of one transformer layer."""
    embed_params: float
    """Parameters on the first stage outside the layers (token embedding, learned positions)."""
    head_params: float
    """Parameters on the last stage outside the layers (the head, or the tied embedding's copy)."""
    total_params: int
    tied: bool
    """Head shares the embedding: one copy when the first and last stage are the same rank."""
    layer_fwd_flops: float
    """Forward FLOPs per token of one layer (causal attention): the stage-balancing cost."""
    layer_hw_flops: dict[str, float]
    """Training FLOPs per token of one layer, recomputation included, per recompute mode."""
    head_flops: float
    """Training FLOPs per token of the vocabulary head (never recomputed)."""
    model_flops_per_token: float
    """train_flops_per_token: MFU's numerator per token."""
    expert_layer_params: float = 0.0
    """Routed experts' parameters of one layer (all experts), the mean over layers; part of layer_params."""
    moe_fraction: float = 0.0
    """Share of the layers that are MoE blocks (1/moe_every, 0 for a dense model)."""
    num_experts: int = 0
    top_k: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dense_layer_params(self) -> float:
        """Parameters of one layer that tensor parallelism shards and dp replicates (the mean)."""
        return self.layer_params - self.expert_layer_params

    def state_numel(self, layers: float, outside: float, t: int, ep: int) -> tuple[float, float]:
        """(dense, expert) parameters one device holds for `layers` layers plus `outside`
        (embedding or head): dense over tp, experts whole on each TP rank and split over ep."""
        return (layers * self.dense_layer_params + outside) / t, layers * self.expert_layer_params / ep

    @property
    def hidden(self) -> int:
        return self.cfg.hidden

    @property
    def heads(self) -> int:
        return self.cfg.heads

    @property
    def layers(self) -> int:
        return self.cfg.layers

    @property
    def vocab(self) -> int:
        return self.cfg.vocab

    def stage_split(self, p: int, v: int) -> StageSplit:
        return _split_cached(self.layers, p, v, self.layer_fwd_flops, self.head_flops / 3)

    def hardware_flops_per_step(self, global_batch: int, recompute: str) -> float:
        """Every device's FLOPs of one step summed: hardware_flops_per_token * tokens."""
        return (self.layers * self.layer_hw_flops[recompute] + self.head_flops) * global_batch * self.seq_len


@lru_cache(maxsize=4096)
def _split_cached(layers: int, p: int, v: int, c: float, h: float) -> StageSplit:
    return split_layers(layers, p, v, c, h)


def model_shape(cfg: ModelConfig, causal: bool = True) -> ModelShape:
    """Measure `cfg` through model.flops. `causal=False` counts full attention (Megatron's formula)."""
    s = cfg.seq_len
    empty = dataclasses.replace(cfg, layers=0) if dataclasses.is_dataclass(cfg) else _replace(cfg, layers=0)
    n_layers = cfg.layers
    total = total_params(cfg)
    outside = total_params(empty)
    layer_params = (total - outside) / n_layers
    vh = cfg.vocab * cfg.hidden
    tied = bool(getattr(cfg, "tie_embeddings", False))
    # What is left besides the vocab matrices (final norm, learned positions) is small: count it on stage 0.
    rest = outside - vh * (1 if tied else 2)
    embed, head = vh + rest, vh  # head: the untied head, or the copy of a tied embedding on the last stage
    head_flops = hardware_flops_per_token(empty, s, causal)
    layer_hw = {r: (hardware_flops_per_token(cfg, s, causal, r) - head_flops) / n_layers for r in RECOMPUTE}
    layer_fwd = (train_flops_per_token(cfg, s, True) - train_flops_per_token(empty, s, True)) / 3 / n_layers
    n_moe = moe_layers(cfg)
    experts = (total - total_params(cfg, experts=0)) / n_layers if n_moe else 0.0
    return ModelShape(
        cfg=cfg,
        seq_len=s,
        layer_params=layer_params,
        embed_params=embed,
        head_params=head,
        total_params=total,
        tied=tied,
        layer_fwd_flops=layer_fwd,
        layer_hw_flops=layer_hw,
        head_flops=head_flops,
        model_flops_per_token=train_flops_per_token(cfg, s, causal),
        expert_layer_params=experts,
        moe_fraction=n_moe / n_layers,
        num_experts=cfg.num_experts if n_moe else 0,
        top_k=cfg.top_k if n_moe else 0,
    )


def _replace(cfg: ModelConfig, **changes):
    from types import SimpleNamespace

    return SimpleNamespace(**{**vars(cfg), **changes})
