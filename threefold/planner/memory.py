"""Per-device memory of a layout: model state by ZeRO stage, activations by Korthikanti et al.

Model state (parameters, gradients, optimizer) uses the ZeRO paper's formulas as implemented
in `distributed/data_parallel/memory.py` (`predict_memory`) with gradients accumulated and
reduced in fp32 (train.grad_reduce_dtype auto, Megatron's main grads): mixed precision
2P + 4P + 12P, ZeRO-1 2P + 4P + 12P/N, ZeRO-2 2P + 16P/N, ZeRO-3 18P/N; fp32 training
4P + 4P + 8P with the same sharding. P is what one device holds before data-parallel sharding: its pipeline stage's
layers and embedding/head, divided by tp. Mixture of experts: the routed experts are a second
state, E_params / ep per device (whole on each TP rank), sharded by ZeRO over expert_dp, the
tp * cp * dp / ep ranks holding the same experts; the dense part keeps N = dp * cp (context-
parallel ranks hold the same weights; N = dp without cp). Activations under cp: seq/cp tokens.

Activations per layer and micro-batch are Korthikanti et al. 2022, Table 2
(`model/activations.py`, `korthikanti_layer_bytes`): sbh(34 + 5as/h) without parallelism;
TP sbh(10 + 24/t + 5as/(ht)); TP+SP sbh/t (34 + 5as/h); selective recompute sbh(10 + 24/t),
with SP 34sbh/t; full recompute 2sbh. They assume 16-bit activations; fp32 doubles them. The
5as/h term is the s x s probabilities, dropout mask and dropped probabilities of an unfused
attention (Megatron-LM's, cluster.attention_scores 'square'); a fused kernel keeps q, k, v, its
output and the log-sum-exp only (threefold's SDPA, flash on GPUs and on CPU), so without recompute
its layer keeps the paper's selective-recompute row (Cluster.keeps_attention_scores).
An MoE block swaps the paper's MLP share (19sbh; TP 3sbh + 16sbh/t; SP 19sbh/t) for its routed
path, on the sb/t tokens each TP rank routes: the router's fp32 input (4h) and, per each of
the top_k assignments, the expert's input row (2h), its intermediates (GeLU 2 x 2f, SwiGLU
4 x 2f) and its output kept for the combine weight (2h); a shared expert keeps the MLP share.
A rank keeps that for each micro-batch in flight (forward done, backward not yet):

    gpipe: m on every rank         1f1b, zb: min(p, m) on rank 0, 1 on the last rank
    interleaved (Megatron's warm-up): rank 0 holds min(vm, (v-1)p + 2(p-1) + 1) chunks,
    the last rank min(vm, (v-1)p + 1), each chunk L/(pv) layers: p(1 + (p-1)/(pv)) stages' worth.

Added on top: the last rank's head (norm and head inputs 4sbh, the logits the loss keeps for
backward 2sbV/t: in the activation dtype, since model/loss.py upcasts only one chunk of tokens to
fp32 at a time; per micro-batch in flight there); full recompute's one layer being recomputed at full
size; ZeRO-3's gathered layers: the one computing and parallel.zero3_prefetch ahead (the engine's
in-flight limit). The report is the worse of rank 0 and the last.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from threefold.planner.layout import Layout
from threefold.planner.model import ModelShape

ACT_BYTES = {"bf16": 2, "fp32": 4}
STATE = ("params", "grads", "optimizer")


@cache
def _bytes_per_param(dp: int, zero: int, dtype: str) -> tuple[float, float, float]:
    import torch

    from threefold.distributed.data_parallel.memory import predict_memory

    param_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    pred = predict_memory(1, dp, zero, param_dtype, torch.float32)  # fp32 gradients (the default)
    return pred["params"], pred["grads"], pred["optimizer"]


def model_state_bytes(numel: float, dp: int, zero: int, dtype: str = "bf16") -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state per device for `numel` parameters."""
    return dict(zip(STATE, (k * numel for k in _bytes_per_param(dp, zero, dtype))))


@cache
def _korthikanti(s: int, b: int, h: int, a: int, t: int, sp: bool, recompute: str) -> float:
    from threefold.model.activations import korthikanti_layer_bytes

    return korthikanti_layer_bytes(s, b, h, a, t, sp, recompute)


def _kept(recompute: str, scores: bool) -> str:
    """The paper's row for what a layer keeps: a fused attention kernel (scores False) never keeps
    the s x s probabilities, its mask or dropout (the 5as/h term), which is exactly what the
    paper's selective recompute drops."""
    return "selective" if recompute == "none" and not scores else recompute


def layer_activation_bytes(
    s: int,
    b: int,
    h: int,
    heads: int,
    t: int = 1,
    sp: bool = False,
    recompute: str = "none",
    dtype: str = "bf16",
    scores: bool = True,
) -> float:
    """Bytes one layer keeps for backward per micro-batch (Korthikanti Table 2, scaled to dtype);
    `scores` False: a fused attention kernel (no 5as/h term)."""
    return _korthikanti(s, b, h, heads, t, sp, _kept(recompute, scores)) * ACT_BYTES[dtype] / 2


def _mlp_share_bytes(s: int, b: int, h: int, t: int, sp: bool, recompute: str) -> float:
    """The MLP's part of Korthikanti's layer (16-bit): input 2sbh, GeLU in and out 16sbh, mask sbh."""
    sbh = s * b * h
    if recompute == "full":
        return 0.0
    if sp:
        return 19 * sbh / t
    return (3 + 16 / t) * sbh if t > 1 else 19 * sbh


def moe_layer_activation_bytes(
    s: int,
    b: int,
    h: int,
    heads: int,
    ffn: int,
    top_k: int,
    gated: bool,
    shared: bool,
    t: int = 1,
    sp: bool = False,
    recompute: str = "none",
    dtype: str = "bf16",
    scores: bool = True,
) -> float:
    """Bytes an MoE block keeps for backward per micro-batch (module docstring), balanced routing."""
    dense = _korthikanti(s, b, h, heads, t, sp, _kept(recompute, scores))
    if recompute == "full":
        return dense * ACT_BYTES[dtype] / 2  # only the block's input, as for a dense block
    routed = s * b / t * (4 * h + top_k * (2 * h + (8 if gated else 4) * ffn + 2 * h))
    mlp = _mlp_share_bytes(s, b, h, t, sp, recompute)
    return (dense - mlp + routed + (mlp if shared else 0.0)) * ACT_BYTES[dtype] / 2


def mean_layer_activation_bytes(
    shape: ModelShape, b: int, t: int, sp: bool, recompute: str, dtype: str = "bf16", cp: int = 1, scores: bool = True
) -> float:
    """Per layer and micro-batch, the mean over dense and MoE blocks. Context parallelism (`cp`)
    leaves each rank seq/cp tokens of every token-local activation, and its attention keeps only
    the local q, k, v, output and log-sum-exp: the formula at seq/cp."""
    s, h, a = shape.seq_len // cp, shape.hidden, shape.heads
    dense = layer_activation_bytes(s, b, h, a, t, sp, recompute, dtype, scores)
    if not shape.is_moe:
        return dense
    cfg = shape.cfg
    moe = moe_layer_activation_bytes(
        s,
        b,
        h,
        a,
        cfg.ffn_hidden,
        shape.top_k,
        cfg.arch == "llama",
        bool(getattr(cfg, "shared_expert", False)),
        t,
        sp,
        recompute,
        dtype,
        scores,
    )
    return (1 - shape.moe_fraction) * dense + shape.moe_fraction * moe


def inflight(schedule: str, p: int, m: int, v: int = 1) -> tuple[float, float]:
    """(rank 0, last rank) activations held at the peak, in whole micro-batches of the rank's layers."""
    if p == 1:
        return 1.0, 1.0
    if schedule == "gpipe":
        return float(m), float(m)
    if schedule == "interleaved":
        return min(v * m, (v - 1) * p + 2 * (p - 1) + 1) / v, min(v * m, (v - 1) * p + 1) / v
    return float(min(p, m)), 1.0  # 1f1b; zb (ZB-H1) holds what 1F1B holds


@dataclass
class Memory:
    """Bytes per device on the worse of pipeline rank 0 and the last rank."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    inflight: float
    """Micro-batches of the rank's layers held at the peak."""
    rank: str
    """"first" or "last": which pipeline rank is the worse."""
    expert_state: float = 0.0
    """Of params + grads + optimizer, the routed experts' part (MoE)."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def as_dict(self) -> dict:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "buffers": self.buffers,
            "total": self.total,
            "inflight_microbatches": self.inflight,
            "worst_pipeline_rank": self.rank,
            "expert_state": self.expert_state,
        }


def expert_dp(layout: Layout) -> int:
    """Ranks holding the same experts: the TP and CP ranks (which split tokens) times dp / ep."""
    return layout.tp * layout.cp * layout.dp // layout.ep


def device_memory(
    shape: ModelShape, layout: Layout, global_batch: int, dtype: str = "bf16", scores: bool = True
) -> Memory:
    """The worse of the first and last pipeline rank. `scores`: the attention keeps its s x s
    probabilities for backward (an unfused kernel, cluster.attention_scores 'square'); threefold's
    SDPA does not (Cluster.keeps_attention_scores)."""
    t, p, v, b, s = layout.tp, layout.pp, layout.vpp, layout.mbs, shape.seq_len // layout.cp
    replicas = layout.dp * layout.cp  # dense state: reduced and ZeRO-sharded over dp x cp (grid.dp_cp)
    m = layout.microbatches(global_batch)
    h, V = shape.hidden, shape.vocab
    split = shape.stage_split(p, v)
    per_layer = mean_layer_activation_bytes(shape, b, t, layout.sp, layout.recompute, dtype, layout.cp, scores)
    first_inflight, last_inflight = inflight(layout.schedule, p, m, v)
    head_inflight = float(m) if (layout.schedule == "gpipe" and p > 1) else 1.0
    region = t if layout.sp else 1
    head_acts = (4 * s * b * h / region + 2 * s * b * V / t) * ACT_BYTES[dtype] / 2
    kp = ACT_BYTES[dtype]
    buffers = 0.0
    if layout.recompute == "full":
        buffers += mean_layer_activation_bytes(shape, b, t, layout.sp, "none", dtype, layout.cp, scores)
    edp = expert_dp(layout)
    if layout.zero == 3 and (replicas > 1 or edp > 1):  # the gathered layer and the prefetched ones
        dense, expert = shape.state_numel(1, 0.0, t, layout.ep)
        whole = layout.zero3_prefetch + 1
        buffers += whole * ((dense if replicas > 1 else 0.0) + (expert if edp > 1 else 0.0)) * kp

    if p == 1:
        outside = shape.embed_params + (0 if shape.tied else shape.head_params)
        ranks = [("first", shape.layers, outside, first_inflight, head_acts)]
    else:
        ranks = [
            ("first", split.first_layers, shape.embed_params, first_inflight, 0.0),
            ("last", split.last_layers, shape.head_params, last_inflight, head_acts * head_inflight),
        ]
    worst = None
    for name, layers, outside, held, extra in ranks:
        dense, expert = shape.state_numel(layers, outside, t, layout.ep)
        state = model_state_bytes(dense, replicas, layout.zero, dtype)
        experts = model_state_bytes(expert, edp, layout.zero, dtype)
        acts = layers * per_layer * held + extra
        mem = Memory(*(state[k] + experts[k] for k in STATE), acts, buffers, held, name, sum(experts.values()))
        if worst is None or mem.total > worst.total:
            worst = mem
    return worst
