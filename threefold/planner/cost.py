"""Step time of a layout, per category, as a sum that is linear in the cluster's efficiency
parameters, so that one function both predicts and (in `calibrate`) is fitted.

Each category is a `Terms` dict {parameter: coefficient}; its time is
sum(coefficient * unit(parameter)), where unit() (planner/units.py) is, per parameter:

    compute_efficiency   1 / efficiency          coefficient: seconds at 100% of peak
    *_bw_gbps            1 / (bandwidth * 1e9)   coefficient: bytes over that link
    *_latency_us         latency * 1e-6          coefficient: ring steps paid
    collective_overhead_us  overhead * 1e-6      coefficient: collective calls (launch and rendezvous)
    layer_overhead_us    overhead * 1e-6         coefficient: layer passes (forward + backward)
    step_overhead_s      overhead                coefficient: 1

The categories of one optimizer step on the slowest pipeline rank:

    compute    model FLOPs of the rank's m micro-batches / (peak * compute_efficiency), each layer's
               times its GEMMs' small-shape factor (planner/kernels.py), plus the memory-bound
               work's bytes / elementwise_bw_gbps: the layers' (unfused attention's dropout
               among them), the loss's over the logits and each micro-batch's weight gradients
               added into their buffers
    recompute  the forward work recomputation does again (selective: attention core, with an
               unfused core's softmax and dropout; full: layers)
    cp_comm    per layer and micro-batch, context_parallel.analytic_bytes over the cp link; ring:
               what outlasts each step's attention is exposed, a2a: all (planner/cp_cost.py)
    tp_comm    per layer and micro-batch, the TP/SP collectives distributed/tp_collectives.py counts
    ep_comm    per MoE block and micro-batch, the all-to-alls of expert parallelism
    pp_comm    the slowest rank's own point-to-point transfers (these three and the links each group
               runs over: planner/comm_cost.py)
    bubble     a fill-and-drain rank's (compute + recompute + tp_comm + ep_comm + layer overhead) * B/(1-B),
               the mean of the p - 1 ranks other than the slowest, B = bubble_theory(...):
               the ideal-time form (p-1)/m (gpipe, 1f1b), (p-1)/(v m) (interleaved), (p-1)/(3m) (zb).
               Processes sharing too few cores (cpu): what the larger of the critical path at a
               full core and all ranks' work over the cores leaves beyond the rank's own work
    dp_comm    the gradient synchronisation of the rank holding the most parameters (comm_cost.py);
               on the last pipeline stage only what outlasts the p - 1 backward passes the earlier
               stages still run
    optimizer  the global norm, AdamW's update, the master copied down and zero_grad: the bytes they
               stream / mem_bw (at the process's core share, cpu: the bandwidth is the core's)
    overhead   layer_overhead per layer pass + step_overhead

A calibrated cluster may carry a measured category's own parameters (`Cluster.categories`,
from per-category least squares in calibrate.py); unit() uses them for that category's terms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from threefold.planner.cluster import Cluster

# cp_cost.cp_comm_terms takes the latency rule as an argument; tests/planner/test_planner_cp.py reads it here.
from threefold.planner.comm_cost import (
    DpWindows,
    dp_link,
    ep_comm_terms,
    ep_group_link,
    gradient_sync_terms,
    latency_steps,
    pp_comm_terms,
    pp_link,
    tp_comm_terms,
    tp_link,
)
from threefold.planner.cp_cost import cp_comm_terms, cp_link
from threefold.planner.kernels import (
    ADAM_BYTES_PER_ELEMENT,
    LOSS_BYTES_PER_LOGIT,
    accumulation_bytes,
    attention_dropout_bytes,
    elementwise_bytes,
    gemm_factor,
    head_factor,
    reduction_bytes,
    rerun_attention_bytes,
)
from threefold.planner.layout import Layout
from threefold.planner.memory import ACT_BYTES, expert_dp
from threefold.planner.model import ModelShape
from threefold.planner.overlap import charged, exposed_share, fixed_exposed, modelled
from threefold.planner.units import seconds  # noqa: F401 (cost.seconds: the fits' API)

CATEGORIES = (
    "compute",
    "recompute",
    "tp_comm",
    "cp_comm",
    "ep_comm",
    "pp_comm",
    "dp_comm",
    "bubble",
    "optimizer",
    "overhead",
)
PARAMS = (
    "compute_efficiency",
    "elementwise_bw_gbps",
    "reduction_bw_gbps",
    "intra_bw_gbps",
    "inter_bw_gbps",
    "intra_latency_us",
    "inter_latency_us",
    "collective_overhead_us",
    "mem_bw_gbps",
    "layer_overhead_us",
    "step_overhead_s",
)

Terms = dict  # parameter name -> coefficient


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
        return {c: seconds(self.categories.get(c, {}), cluster, c) for c in CATEGORIES}

    def total(self) -> Terms:
        return merge_terms(*self.categories.values())


@dataclass(frozen=True)
class _StepInputs:
    """What every part of one layout's step reads: the model, the cluster, the layout, and what
    follows from them once (local tokens, the GEMMs' small-shape factors, cp traffic)."""

    shape: ModelShape
    cluster: Cluster
    layout: Layout
    dtype: str
    microbatches: int
    act_bytes: int
    """Bytes of one activation element (and of one working parameter) in the run's dtype."""
    tokens: int
    """One micro-batch's tokens on a rank: mbs x seq_len / cp (each attends over the whole
    sequence as layer_hw_flops counts: the zigzag layout gives every rank 1/cp of the work)."""
    gradient_replicas: int
    """dp x cp: the ranks that hold the same dense parameters and reduce their gradients."""
    full_recompute: int
    """1 when every layer's forward is rerun in backward, else 0."""
    layer_gemm_factor: float
    head_gemm_factor: float
    elementwise_bytes: float
    """Streaming element-wise bytes of one layer pass and micro-batch, at the process's core share."""
    dropout_bytes: float
    """Unfused attention's dropout (cluster.attention_dropout), one layer and micro-batch, each way."""
    rerun_bytes: float
    """Element-wise bytes selective recompute reruns per layer and micro-batch: an unfused
    core's softmax and dropout."""
    reduction_bytes: float
    """Normalisation and reduction bytes of one layer pass and micro-batch, likewise."""
    cp_layer: Terms
    """One layer's context-parallel attention traffic per micro-batch (planner/cp_cost.py)."""

    @classmethod
    def of(cls, shape: ModelShape, cluster: Cluster, layout: Layout, global_batch: int, dtype: str) -> _StepInputs:
        t, act = layout.tp, ACT_BYTES[dtype]
        tokens = layout.mbs * (shape.seq_len // layout.cp)
        replicas = layout.dp * layout.cp
        fused = cluster.attention_efficiency > 0  # a fused kernel keeps the probabilities on chip
        square = not fused and cluster.attention_scores == "square"
        per_token = tokens / cluster.core_share
        moved = elementwise_bytes(shape.cfg, t, act, layout.sp, fused, square) * per_token
        reduced = reduction_bytes(shape.cfg, t, act, layout.sp, fused) * per_token
        dropout = not fused and cluster.attention_dropout
        dropped = attention_dropout_bytes(shape.cfg, t, act, square) * per_token if dropout else 0.0
        unfused_rerun = not fused and layout.recompute == "selective"
        rerun = rerun_attention_bytes(shape.cfg, t, act, square, dropout) * per_token if unfused_rerun else 0.0
        return cls(
            shape=shape,
            cluster=cluster,
            layout=layout,
            dtype=dtype,
            microbatches=layout.microbatches(global_batch),
            act_bytes=act,
            tokens=tokens,
            gradient_replicas=replicas,
            full_recompute=int(layout.recompute == "full"),
            layer_gemm_factor=gemm_factor(shape.cfg, tokens, t, cluster),
            head_gemm_factor=head_factor(shape.cfg, tokens, t, cluster),
            elementwise_bytes=moved,
            dropout_bytes=dropped,
            rerun_bytes=rerun,
            reduction_bytes=reduced,
            cp_layer=cp_comm_terms(shape, cluster, layout, act, latency_steps),
        )


def _links(cluster: Cluster, layout: Layout) -> dict[str, str]:
    """Each group's link, "intra" or "inter" (planner/comm_cost.py)."""
    return {
        "tp": tp_link(cluster, layout.tp),
        "pp": pp_link(cluster),
        "dp": dp_link(cluster, layout),
        "ep": ep_group_link(cluster, layout.tp, layout.ep, layout.cp),
        "cp": cp_link(cluster, layout.tp, layout.cp),
    }


def step_terms(
    shape: ModelShape, cluster: Cluster, layout: Layout, global_batch: int, dtype: str = "bf16"
) -> StepTerms:
    """The layout's step on its slowest pipeline rank, per category (the module docstring)."""
    step = _StepInputs.of(shape, cluster, layout, global_batch, dtype)
    m = step.microbatches
    rank, slowest, lightest = _slowest_and_lightest_rank(step)
    categories: dict[str, Terms] = {name: _scaled(terms, m) for name, terms in slowest.items()}
    _add_bubble(step, categories, slowest, _fill_and_drain_rank(step, slowest, lightest))
    categories["pp_comm"] = _pp_comm_terms(step, slowest)
    dense, expert = _most_state_held(step)
    categories["dp_comm"] = _dp_comm_terms(step, dense, expert, rank, slowest)
    categories["optimizer"] = _optimizer_terms(step, dense, expert)
    categories["overhead"] = merge_terms(categories["overhead"], {"step_overhead_s": 1.0})
    # The idlest rank waits for the bubble, the transfers and for the slowest rank's extra work.
    imbalance = merge_terms(_scaled(merge_terms(*slowest.values()), m), _scaled(merge_terms(*lightest.values()), -m))
    pp_idle = merge_terms(categories["bubble"], categories["pp_comm"], imbalance) if layout.pp > 1 else {}
    links = _links(cluster, layout)
    return StepTerms(categories, rank, _hardware_flops(step, rank), links, {"pp_idle": pp_idle})


def _slowest_and_lightest_rank(step: _StepInputs) -> tuple[str, dict[str, Terms], dict[str, Terms]]:
    """("first" or "last", the slowest pipeline rank's micro-batch terms, the lightest rank's).
    The last rank also runs the head; ranks other than the last hold what rank 0 holds (at
    most), so the slowest and the lightest are rank 0 and the last."""
    shape, layout = step.shape, step.layout
    if layout.pp == 1:
        whole = _micro_batch_terms(step, shape.layers, True, True)
        return "last", whole, whole
    split = shape.stage_split(layout.pp, layout.vpp)
    first = _micro_batch_terms(step, split.first_layers, False, True)
    last = _micro_batch_terms(step, split.last_layers, True, False)
    layer_fwd, head_fwd = shape.layer_fwd_flops, shape.head_flops / 3
    if split.last_layers * layer_fwd + head_fwd >= split.first_layers * layer_fwd:
        return "last", last, first
    return "first", first, last


def _micro_batch_terms(step: _StepInputs, layers: int, has_head: bool, has_embedding: bool) -> dict[str, Terms]:
    """One micro-batch on a pipeline rank holding `layers` (all its v chunks), per category."""
    compute, recompute = _compute_terms(step, layers, has_head)
    shape = step.shape
    outside = shape.embed_params * has_embedding
    if has_head and not (shape.tied and has_embedding):
        outside += shape.head_params
    held = sum(shape.state_numel(layers, outside, step.layout.tp, step.layout.ep))
    _add(compute, "reduction_bw_gbps", accumulation_bytes(held, step.act_bytes, step.cluster) / step.cluster.core_share)
    moe_layers = layers * step.shape.moe_fraction  # MoE blocks among them (the model's share)
    # Host work per layer pass; processes sharing cores (cpu) pay it at their share too.
    passes = layers * (4 / 3 if step.full_recompute else 1.0) / step.cluster.core_share
    overhead: Terms = {}
    _add(overhead, "layer_overhead_us", passes * _host_exposed(step, compute, recompute, layers))
    return {
        "compute": compute,
        "recompute": recompute,
        "tp_comm": tp_comm_terms(step.shape, step.cluster, step.layout, step.act_bytes, layers, moe_layers),
        "cp_comm": _scaled(step.cp_layer, layers),
        "ep_comm": ep_comm_terms(step.shape, step.cluster, step.layout, step.act_bytes, moe_layers),
        "overhead": overhead,
    }


def _host_exposed(step: _StepInputs, compute: Terms, recompute: Terms, layers: int) -> float:
    """Share of the host's time per layer pass (layer_overhead_us) the step waits through. On a
    GPU (modelled overlap) the host queues kernels ahead of the device and only what outlasts
    the layer's device time is exposed (bench/gpu.py's breakdown: gpt-1.3b's device idled 3% of
    the step at micro-batch 4, 29% at micro-batch 1); on cpu the host is the device: all of it."""
    cluster = step.cluster
    if cluster.overlap != "modelled" or layers <= 0:
        return 1.0
    device = (seconds(compute, cluster, "compute") + seconds(recompute, cluster, "recompute")) / layers
    return exposed_share(cluster.layer_overhead_us * 1e-6, device)


def _compute_terms(step: _StepInputs, layers: int, has_head: bool) -> tuple[Terms, Terms]:
    """(compute, recompute) of one micro-batch: FLOPs at peak, each GEMM at its small-shape
    factor, plus the element-wise bytes; full recompute repeats the forward's element-wise third."""
    shape, layout, peak = step.shape, step.layout, step.cluster.peak_flops
    head = shape.head_flops * step.head_gemm_factor if has_head else 0.0
    # The loss streams the rank's logits (every token's vocabulary slice) LOSS_BYTES_PER_LOGIT times.
    loss_bytes = (
        step.tokens * shape.vocab / layout.tp * LOSS_BYTES_PER_LOGIT / step.cluster.core_share if has_head else 0.0
    )
    base_flops = (layers * shape.layer_hw_flops["none"] * step.layer_gemm_factor + head) * step.tokens / layout.tp
    rerun_per_layer = shape.layer_hw_flops[layout.recompute] - shape.layer_hw_flops["none"]
    rerun_flops = layers * rerun_per_layer * step.layer_gemm_factor * step.tokens / layout.tp
    compute = {
        "compute_efficiency": base_flops / peak,
        "elementwise_bw_gbps": layers * (step.elementwise_bytes + 2 * step.dropout_bytes),
        "reduction_bw_gbps": layers * step.reduction_bytes + loss_bytes,
    }
    if not step.full_recompute:
        selective = {"compute_efficiency": rerun_flops / peak, "elementwise_bw_gbps": layers * step.rerun_bytes}
        return compute, _scaled(selective, 1)  # without the zero entries
    rerun = {
        "compute_efficiency": rerun_flops / peak,
        "elementwise_bw_gbps": layers * (step.elementwise_bytes / 3 + step.dropout_bytes),
        "reduction_bw_gbps": layers * step.reduction_bytes / 3,
    }
    return compute, _scaled(rerun, 1)  # without the zero entries


def _fill_and_drain_rank(step: _StepInputs, slowest: dict[str, Terms], lightest: dict[str, Terms]) -> dict[str, Terms]:
    """One micro-batch's work of a rank the fill and drain pass through: the mean of the p - 1
    ranks other than the slowest. The slowest rank sets the steady state (m of its passes); the
    first micro-batch's forward reaches it, and the last one's backward leaves it, through the
    others, so a 1F1B step is m t_slowest + (p - 1) t_other, not (m + p - 1) t_slowest (a last
    stage that also runs the vocabulary head does not lengthen the fill). Ranks between the
    first and the last hold what rank 0 holds (model.split_layers), so the others are p - 2 of
    those and the lighter end rank."""
    p = step.layout.pp
    if p <= 2:
        return lightest
    middle = _micro_batch_terms(step, step.shape.stage_split(p, step.layout.vpp).first_layers, False, False)
    return {c: merge_terms(_scaled(middle[c], (p - 2) / (p - 1)), _scaled(lightest[c], 1 / (p - 1))) for c in middle}


def _add_bubble(
    step: _StepInputs, categories: dict[str, Terms], slowest: dict[str, Terms], other: dict[str, Terms]
) -> None:
    """categories["bubble"]: a fill-and-drain rank's micro-batch work times m B/(1-B)
    (_fill_and_drain_rank); processes that share too few cores (cpu) rescale the work categories
    too (_oversubscribed_pipeline)."""
    layout, m, share = step.layout, step.microbatches, step.cluster.core_share
    ratio = bubble_ratio(layout.schedule, layout.pp, m, layout.vpp)
    if layout.pp > 1 and share < 1.0:
        whole_model = _micro_batch_terms(step, step.shape.layers, True, True)
        _oversubscribed_pipeline(categories, slowest, other, whole_model, m, layout.pp, ratio, share)
    else:
        categories["bubble"] = _scaled(merge_terms(*other.values()), m * ratio)


def _pp_comm_terms(step: _StepInputs, mb: dict[str, Terms]) -> Terms:
    """The slowest rank's own pipeline transfers (comm_cost.py). Modelled overlap (overlap.py):
    posted ahead, each hides behind one chunk's forward of a micro-batch; the 2 (p - 1) of the
    fill and drain wait on the critical path. A fixed pp_overlap leaves its share of the
    exchanges exposed, each send moving at once with a receive."""
    shape, cluster, layout, m = step.shape, step.cluster, step.layout, step.microbatches
    if cluster.pp_overlap >= 0:
        # A fixed share: Megatron-LM's blocking exchanges batch each send with a receive
        # (send_forward_recv_backward and the like in one batch_isend_irecv).
        paired = pp_comm_terms(shape, cluster, layout, m, step.act_bytes, paired=True)
        return _scaled(paired, fixed_exposed(cluster.pp_overlap))
    terms = pp_comm_terms(shape, cluster, layout, m, step.act_bytes)
    if not terms or cluster.overlap != "modelled":
        return terms
    transfers = 4 * m * layout.vpp if layout.pp >= 3 else 2 * m * (2 * layout.vpp - 1)
    one = seconds(terms, cluster, "pp_comm") / transfers
    chunk = seconds(mb["compute"], cluster, "compute") / 3 / layout.vpp
    critical = min(1.0, 2 * (layout.pp - 1) / transfers)
    share = critical + (1 - critical) * exposed_share(one, chunk)
    return _scaled(terms, charged(share, cluster))


def _most_state_held(step: _StepInputs) -> tuple[float, float]:
    """(dense, expert) parameters of the pipeline rank holding the most: dense over tp, experts
    whole on each TP rank and split over ep (ModelShape.state_numel)."""
    shape, layout = step.shape, step.layout
    tp, ep = layout.tp, layout.ep
    if layout.pp == 1:
        outside = shape.embed_params + (0 if shape.tied else shape.head_params)
        return shape.state_numel(shape.layers, outside, tp, ep)
    split = shape.stage_split(layout.pp, layout.vpp)
    held = [
        shape.state_numel(split.first_layers, shape.embed_params, tp, ep),
        shape.state_numel(split.last_layers, shape.head_params, tp, ep),
    ]
    return max(held, key=sum)


def _dp_comm_terms(step: _StepInputs, dense: float, expert: float, rank: str, mb: dict[str, Terms]) -> Terms:
    """The gradient synchronisation of the rank holding the most (comm_cost.py). Modelled
    overlap (overlap.py): the buckets reduce behind the last micro-batch's backward, and on the
    last of several stages behind the p - 1 backward passes the earlier stages still run; the
    link's other traffic in that window (pipeline sends, cp, ep on the same link) waits with
    them. Fixed overlap: only the last stage's window applies (evaluated at the cluster's
    values, which keeps the terms linear around them)."""
    layout, cluster, m = step.layout, step.cluster, step.microbatches
    compute = seconds(mb["compute"], cluster, "compute") + seconds(mb["recompute"], cluster, "recompute")
    stages_behind = (layout.pp - 1) if layout.pp > 1 and rank == "last" else 0
    backward = compute * 2 / 3 * (1 + stages_behind)
    if modelled(cluster, cluster.dp_overlap):
        link = dp_link(cluster, layout)
        shared = sum(
            seconds(terms, cluster, cat) * share
            for cat, terms, share in (
                ("pp_comm", pp_comm_terms(step.shape, cluster, layout, 1, step.act_bytes), 0.5),
                ("cp_comm", mb["cp_comm"], 2 / 3),
                ("ep_comm", mb["ep_comm"], 2 / 3),
            )
            if any(name.startswith(link) for name in terms)
        )
        layers = step.shape.layers if layout.pp == 1 else step.shape.stage_split(layout.pp, layout.vpp).first_layers
        windows = DpWindows(backward, compute / 3, m * compute, layers, shared, layout.vpp, layout.pp)
        return gradient_sync_terms(cluster, layout, dense, expert, m, step.act_bytes, windows)
    terms = gradient_sync_terms(cluster, layout, dense, expert, m, step.act_bytes)
    if not stages_behind or not terms or cluster.dp_overlap >= 0:
        # A fixed share: the first stage's backward ends the pipeline, and its reduction
        # follows with that share hidden, whichever rank is slowest.
        return terms
    # 1F1B: the last stage's final backward ends p - 1 backward passes before the first stage's,
    # and its reduction runs in that window; only what outlasts it is exposed.
    window = stages_behind * seconds(mb["compute"], cluster, "compute") * 2 / 3
    comm = seconds(terms, cluster, "dp_comm")
    return _scaled(terms, max(0.0, comm - window) / comm) if comm > 0 else {}


def _optimizer_terms(step: _StepInputs, dense: float, expert: float) -> Terms:
    """What the optimizer phase streams, at the bandwidth the update kernel reaches (mem_bw_gbps:
    bench/gpu.py's sweep fits it to torch's fused AdamW): the global norm reads the owned
    gradients (4 bytes), the update reads parameter, gradient and both moments in fp32 and writes
    three back (kernels.ADAM_BYTES_PER_ELEMENT), a 16-bit run copies the fp32 master down (reads
    4, writes 2), and zero_grad writes the gradient buffer (4 bytes an element: the whole buffer
    below ZeRO 2, the owned slice from 2 on). ZeRO >= 1 keeps 1/replicas of the state."""
    layout = step.layout
    full = dense + expert
    owned = dense / step.gradient_replicas + expert / expert_dp(layout) if layout.zero >= 1 else full
    grads = owned if layout.zero >= 2 else full
    copy_down = 6.0 if step.act_bytes < 4 else 0.0
    moved = owned * (4.0 + ADAM_BYTES_PER_ELEMENT + copy_down) + grads * 4.0
    return {"mem_bw_gbps": moved / step.cluster.core_share}


def _hardware_flops(step: _StepInputs, rank: str) -> float:
    """FLOPs the slowest rank's device runs in the step, recomputation included."""
    shape, layout = step.shape, step.layout
    if layout.pp == 1:
        layers = shape.layers
    else:
        split = shape.stage_split(layout.pp, layout.vpp)
        layers = split.last_layers if rank == "last" else split.first_layers
    flops = layers * shape.layer_hw_flops[layout.recompute] + (shape.head_flops if rank == "last" else 0)
    return flops * (step.tokens / layout.tp * step.microbatches)


WORK = ("compute", "recompute", "overhead")


def _oversubscribed_pipeline(
    cats: dict[str, Terms],
    mb: dict[str, Terms],
    other: dict[str, Terms],
    whole: dict[str, Terms],
    m: int,
    p: int,
    ratio: float,
    share: float,
) -> None:
    """Pipeline ranks that share too few cores (cpu: more processes than cores): a rank waiting
    in the bubble leaves its core to the others, so the step is bounded below both by the
    critical path at a full core each, m times the slowest rank's work and m ratio times a
    fill-and-drain rank's (_fill_and_drain_rank), and by all
    ranks' work spread over the cores, m times the average rank's work at the share. The
    larger of the two (per parameter, which keeps the terms linear) is the work the slowest
    rank's categories and the bubble split: its own work at the share where the step is that
    long, the rest bubble. Only a critical-path-bound step idles in the bubble's collectives."""
    work = merge_terms(*(mb[c] for c in WORK))
    fill = merge_terms(*(other[c] for c in WORK))
    critical = _scaled(merge_terms(work, _scaled(fill, ratio)), m * share)
    spread = _scaled(merge_terms(*(whole[c] for c in WORK)), m / p)
    total = {k: max(critical.get(k, 0.0), spread.get(k, 0.0)) for k in set(critical) | set(spread)}
    own = merge_terms(*(cats[c] for c in WORK))
    # The slowest rank's own work cannot take longer than the step's: it ran faster than its share.
    fit = min([1.0] + [total[k] / own[k] for k in own if own[k] > 0])
    for c in WORK:
        cats[c] = _scaled(cats[c], fit)
    bubble = {k: total[k] - fit * own.get(k, 0.0) for k in total}
    flops = "compute_efficiency"
    if critical.get(flops, 0.0) >= spread.get(flops, 0.0):
        waits = merge_terms(other["tp_comm"], other["cp_comm"], other["ep_comm"])
        bubble = merge_terms(bubble, _scaled(waits, m * ratio))
    cats["bubble"] = {k: c for k, c in bubble.items() if c > 0}
