"""Step time of a layout, per category, as a sum that is linear in the cluster's efficiency
parameters, so that one function both predicts and (in `calibrate`) is fitted.

Each category is a `Terms` dict {parameter: coefficient}; its time is
sum(coefficient * unit(parameter)), where unit() is, per parameter:

    compute_efficiency   1 / efficiency          coefficient: seconds at 100% of peak
    *_bw_gbps            1 / (bandwidth * 1e9)   coefficient: bytes over that link
    *_latency_us         latency * 1e-6          coefficient: ring steps paid
    layer_overhead_us    overhead * 1e-6         coefficient: layer passes (forward + backward)
    step_overhead_s      overhead                coefficient: 1

The categories of one optimizer step on the slowest pipeline rank:

    compute    model FLOPs of the rank's m micro-batches / (peak * compute_efficiency)
    recompute  the forward work recomputation does again (selective: attention core; full: layers)
    tp_comm    TP: 4 all-reduces of sbh per layer and micro-batch (2 forward, 2 backward); SP: 4
               all-gathers + 4 reduce-scatters + the 2 all-gathers backward repeats to rebuild
               the sequence-sharded inputs; full recompute repeats the forward's; the vocab-
               parallel embedding (forward) and head (backward) add one each: without SP 4l + 2
               collectives, what the training loop's tp_comm_bytes counts. Ring volumes,
               (1 - tp_overlap) of them exposed.
    pp_comm    2 (v m + p - 1) point-to-point transfers of sbh (sbh/t under SP) on the critical path
    bubble     (compute + recompute + tp_comm + layer overhead) * B/(1-B), B = bubble_theory(...):
               the ideal-time form (p-1)/m (gpipe, 1f1b), (p-1)/(v m) (interleaved), (p-1)/(3m) (zb)
    dp_comm    ZeRO 0 all-reduce 2(N-1)/N P; 1 and 2 reduce-scatter + all-gather, the same volume;
               3 reduce-scatter + an all-gather per micro-batch forward and backward; (1 - dp_overlap)
               of it exposed
    optimizer  AdamW reads and writes its state once: P_opt (2 K_opt + K_param + K_grad) bytes / mem_bw
    overhead   layer_overhead per layer pass + step_overhead

Links: TP over the intra-node link while tp fits in a node; DP inside a node while tp*dp does;
PP over the inter-node link as soon as there is more than one node. Latency: a ring step per
peer inside a node; across nodes NCCL's trees pay ~2 log2(N) steps instead of 2(N-1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from threefold.planner.cluster import Cluster
from threefold.planner.layout import Layout
from threefold.planner.memory import ACT_BYTES, Memory, device_memory
from threefold.planner.model import ModelShape

CATEGORIES = ("compute", "recompute", "tp_comm", "pp_comm", "dp_comm", "bubble", "optimizer", "overhead")
PARAMS = ("compute_efficiency", "intra_bw_gbps", "inter_bw_gbps", "intra_latency_us", "inter_latency_us",
          "mem_bw_gbps", "layer_overhead_us", "step_overhead_s")

Terms = dict  # parameter name -> coefficient


def unit(cluster: Cluster, name: str) -> float:
    """Seconds per unit of coefficient for parameter `name` (see the module docstring)."""
    value = getattr(cluster, name)
    if name == "compute_efficiency":
        return 1.0 / value
    if name.endswith("_gbps"):
        return 1.0 / (value * 1e9)
    if name.endswith("_us"):
        return value * 1e-6
    return value


def from_unit(name: str, u: float) -> float:
    """The parameter value whose unit() is `u` (the inverse of unit)."""
    if name == "compute_efficiency":
        return 1.0 / u
    if name.endswith("_gbps"):
        return 1.0 / (u * 1e9)
    if name.endswith("_us"):
        return u * 1e6
    return u


def seconds(terms: Terms, cluster: Cluster) -> float:
    return sum(coef * unit(cluster, name) for name, coef in terms.items())


def _add(into: Terms, name: str, coef: float) -> None:
    if coef:
        into[name] = into.get(name, 0.0) + coef


def _scaled(terms: Terms, k: float) -> Terms:
    return {name: coef * k for name, coef in terms.items() if coef * k}


def merge_terms(*parts: Terms) -> Terms:
    out: Terms = {}
    for part in parts:
        for name, coef in part.items():
            _add(out, name, coef)
    return out


def _collective(into: Terms, link: str, nbytes: float, steps: float) -> None:
    _add(into, f"{link}_bw_gbps", nbytes)
    _add(into, f"{link}_latency_us", steps)


def _latency_steps(n: int, link: str, ring_steps: float) -> float:
    """Ring steps inside a node; across nodes tree algorithms pay ~2 log2(n) per collective."""
    if link == "inter":
        return min(ring_steps, 2 * math.ceil(math.log2(max(n, 2))))
    return ring_steps


def bubble_ratio(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Pipeline idle time / ideal time, from the simulator's bubble fraction B: B / (1 - B)."""
    if p == 1:
        return 0.0
    from threefold.distributed.pipeline.simulate import bubble_theory

    b = bubble_theory(schedule, p, m, v)
    return b / (1.0 - b)


@dataclass
class StepTerms:
    """A layout's step as linear terms per category, plus what does not depend on the parameters."""

    categories: dict[str, Terms]
    slowest_rank: str
    hardware_flops_per_device: float
    links: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Terms] = field(default_factory=dict)
    """Quantities that are not part of the step sum: "pp_idle", the idlest rank's receive wait."""

    def times(self, cluster: Cluster) -> dict[str, float]:
        return {c: seconds(self.categories.get(c, {}), cluster) for c in CATEGORIES}

    def total(self) -> Terms:
        return merge_terms(*self.categories.values())


def step_terms(shape: ModelShape, cluster: Cluster, layout: Layout, global_batch: int,
               dtype: str = "bf16") -> StepTerms:
    t, p, v, b, d = layout.tp, layout.pp, layout.vpp, layout.mbs, layout.dp
    s, h = shape.seq_len, shape.hidden
    m = layout.microbatches(global_batch)
    act = ACT_BYTES[dtype]
    kp = kg = act
    ko = 12 if dtype == "bf16" else 8
    peak = cluster.peak_flops
    dpn = cluster.devices_per_node
    split = shape.stage_split(p, v)

    tokens = b * s
    tp_link = "intra" if (t <= dpn and dpn % t == 0) or cluster.nodes == 1 else "inter"

    def micro_batch(layers: int, has_head: bool) -> dict[str, Terms]:
        """One micro-batch on a pipeline rank holding `layers` (all its v chunks)."""
        base = (layers * shape.layer_hw_flops["none"] + (shape.head_flops if has_head else 0.0)) * tokens / t
        extra = layers * (shape.layer_hw_flops[layout.recompute] - shape.layer_hw_flops["none"]) * tokens / t
        mb = {"compute": {"compute_efficiency": base / peak}, "recompute": {"compute_efficiency": extra / peak},
              "tp_comm": {}, "overhead": {}}
        if t > 1:
            x = tokens * h * act
            ring = (t - 1) / t
            if layout.sp:  # all-gathers and reduce-scatters, (t-1)/t x each
                per_layer = 10 + (4 if layout.recompute == "full" else 0)
                coll_bytes, coll_steps = ring * x, (t - 1)
            else:  # all-reduces, 2 (t-1)/t x each
                per_layer = 4 + (2 if layout.recompute == "full" else 0)
                coll_bytes, coll_steps = 2 * ring * x, 2 * (t - 1)
            n_coll = per_layer * layers + 2
            exposed = 1.0 - cluster.tp_overlap
            _collective(mb["tp_comm"], tp_link, exposed * n_coll * coll_bytes,
                        exposed * n_coll * _latency_steps(t, tp_link, coll_steps))
        _add(mb["overhead"], "layer_overhead_us", layers * (4 / 3 if layout.recompute == "full" else 1.0))
        return mb

    # The slowest pipeline rank sets the pace; the last one also runs the head. Ranks other
    # than the last hold what rank 0 holds (at most), so the lightest is rank 0 or the last.
    c, head_fwd = shape.layer_fwd_flops, shape.head_flops / 3
    if p == 1:
        rank, mb = "last", micro_batch(shape.layers, True)
        light = mb
    else:
        first, last = micro_batch(split.first_layers, False), micro_batch(split.last_layers, True)
        if split.last_layers * c + head_fwd >= split.first_layers * c:
            rank, mb, light = "last", last, first
        else:
            rank, mb, light = "first", first, last

    cats: dict[str, Terms] = {name: _scaled(terms, m) for name, terms in mb.items()}
    ratio = bubble_ratio(layout.schedule, p, m, v)
    cats["bubble"] = _scaled(merge_terms(*mb.values()), m * ratio)

    cats["pp_comm"] = {}
    pp_link = "intra" if cluster.nodes == 1 else "inter"
    if p > 1:
        n = 2 * (m * v + p - 1)
        x = tokens * h * act / (t if layout.sp else 1)
        _collective(cats["pp_comm"], pp_link, n * x, n)

    # Data parallel: the rank holding the most parameters.
    first_numel = (split.first_layers * shape.layer_params + shape.embed_params) / t
    last_numel = (split.last_layers * shape.layer_params + shape.head_params) / t
    if p == 1:
        first_numel = last_numel = (shape.layers * shape.layer_params + shape.embed_params
                                    + (0 if shape.tied else shape.head_params)) / t
    numel = max(first_numel, last_numel)
    cats["dp_comm"] = {}
    dp_link = "intra" if t * d <= dpn or cluster.nodes == 1 else "inter"
    if d > 1:
        ring = (d - 1) / d
        if layout.zero == 0:
            nbytes, steps = 2 * ring * numel * kg, _latency_steps(d, dp_link, 2 * (d - 1))
        elif layout.zero in (1, 2):
            nbytes, steps = ring * numel * (kg + kp), 2 * _latency_steps(d, dp_link, d - 1)
        else:
            nbytes = ring * numel * (kg + 2 * m * kp)
            steps = (1 + 2 * m) * _latency_steps(d, dp_link, d - 1)
        exposed = 1.0 - cluster.dp_overlap
        _collective(cats["dp_comm"], dp_link, exposed * nbytes, exposed * steps)

    opt_numel = numel / d if layout.zero >= 1 else numel
    cats["optimizer"] = {"mem_bw_gbps": opt_numel * (2 * ko + kp + kg)}
    cats["overhead"] = merge_terms(cats["overhead"], {"step_overhead_s": 1.0})
    # The idlest rank waits for the bubble, the transfers and for the slowest rank's extra work.
    imbalance = merge_terms(_scaled(merge_terms(*mb.values()), m), _scaled(merge_terms(*light.values()), -m))
    extra = {"pp_idle": merge_terms(cats["bubble"], cats["pp_comm"], imbalance) if p > 1 else {}}
    hw_flops = sum(mb[k]["compute_efficiency"] for k in ("compute", "recompute") if mb[k]) * peak * m
    return StepTerms(cats, rank, hw_flops, {"tp": tp_link, "pp": pp_link, "dp": dp_link}, extra)


@dataclass
class Prediction:
    """Everything the planner says about one layout."""

    layout: Layout
    microbatches: int
    memory: Memory
    usable_bytes: float
    times: dict[str, float]
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_device: float
    mfu: float
    hfu: float
    bubble_fraction: float
    slowest_rank: str
    links: dict[str, str]
    devices_used: int

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_bytes

    def as_dict(self) -> dict:
        out = self.layout.as_dict()
        out.update(microbatches=self.microbatches, memory_bytes_per_device=self.memory.total,
                   memory=self.memory.as_dict(), usable_bytes_per_device=self.usable_bytes, fits=self.fits,
                   step_time_s=self.step_time_s, tokens_per_s=self.tokens_per_s,
                   model_tflops_per_device=self.model_tflops_per_device, mfu=self.mfu, hfu=self.hfu,
                   bubble_fraction=self.bubble_fraction, time_split_s=dict(self.times),
                   time_split_fraction={k: v / self.step_time_s for k, v in self.times.items()},
                   slowest_pipeline_rank=self.slowest_rank, links=dict(self.links),
                   devices_used=self.devices_used)
        return out


def predict(shape: ModelShape, cluster: Cluster, layout: Layout, global_batch: int, dtype: str = "bf16",
            memory: Memory | None = None) -> Prediction:
    """Memory and step time of `layout` (assumed structurally valid: see layout.structural_reason)."""
    memory = memory or device_memory(shape, layout, global_batch, dtype)
    terms = step_terms(shape, cluster, layout, global_batch, dtype)
    times = terms.times(cluster)
    step = sum(times.values())
    tokens = global_batch * shape.seq_len
    world = layout.world
    model_flops = shape.model_flops_per_token * tokens
    peak = cluster.peak_tflops * 1e12
    return Prediction(
        layout=layout, microbatches=layout.microbatches(global_batch), memory=memory,
        usable_bytes=cluster.usable_bytes, times=times, step_time_s=step, tokens_per_s=tokens / step,
        model_tflops_per_device=model_flops / step / world / 1e12, mfu=model_flops / (step * world * peak),
        hfu=shape.hardware_flops_per_step(global_batch, layout.recompute) / (step * world * peak),
        bubble_fraction=times["bubble"] / step,
        slowest_rank=terms.slowest_rank, links=terms.links, devices_used=world)
