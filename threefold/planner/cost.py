"""Step time of a layout, per category, as a sum that is linear in the cluster's efficiency
parameters, so that one function both predicts and (in `calibrate`) is fitted.

Each category is a `Terms` dict {parameter: coefficient}; its time is
sum(coefficient * unit(parameter)), where unit() is, per parameter:

    compute_efficiency   1 / efficiency          coefficient: seconds at 100% of peak
    *_bw_gbps            1 / (bandwidth * 1e9)   coefficient: bytes over that link
    *_latency_us         latency * 1e-6          coefficient: ring steps paid
    collective_overhead_us  overhead * 1e-6      coefficient: collective calls (launch and rendezvous)
    layer_overhead_us    overhead * 1e-6         coefficient: layer passes (forward + backward)
    step_overhead_s      overhead                coefficient: 1

The categories of one optimizer step on the slowest pipeline rank:

    compute    model FLOPs of the rank's m micro-batches / (peak * compute_efficiency), each layer's
               times its GEMMs' small-shape factor (planner/kernels.py), plus the memory-bound
               work's bytes / elementwise_bw_gbps
    recompute  the forward work recomputation does again (selective: attention core; full: layers)
    cp_comm    per layer and micro-batch, context_parallel.analytic_bytes over the cp link; ring:
               what outlasts each step's attention is exposed, a2a: all (planner/cp_cost.py)
    tp_comm    TP: 4 all-reduces of sbh per layer and micro-batch (2 forward, 2 backward); SP: 4
               all-gathers + 4 reduce-scatters + the 2 all-gathers backward repeats to rebuild
               the sequence-sharded inputs; full recompute repeats the forward's; the vocab-
               parallel embedding (forward) and head (backward) add one each: without SP 4l + 2
               collectives, what the training loop's tp_comm_bytes counts. Ring volumes and
               steps, plus a fixed cost per call, (1 - tp_overlap) of them exposed. An MoE
               block keeps attention's half; its routed
               experts split the tokens over tp instead: without SP an all-gather of the output
               forward and of the input gradient backward (SP: none), plus a latency-only
               gather of the routing counts; a shared expert is a TP MLP (the dense half again).
    ep_comm    per MoE block and micro-batch, 4 all-to-alls (dispatch and combine, forward and
               backward; full recompute repeats the forward's 2) of (b s / t) top_k h, each rank
               sending (ep-1)/ep of it, plus a latency-only exchange of counts per forward
    pp_comm    the slowest rank's own point-to-point transfers of sbh (sbh/t under SP): an end rank
               sends and receives 2 m (2 v - 1), a middle one 4 m v (what its pp_p2p span times)
    bubble     (compute + recompute + tp_comm + ep_comm + layer overhead) * B/(1-B), B = bubble_theory(...):
               the ideal-time form (p-1)/m (gpipe, 1f1b), (p-1)/(v m) (interleaved), (p-1)/(3m) (zb).
               Processes sharing too few cores (cpu): what the larger of the critical path at a
               full core and all ranks' work over the cores leaves beyond the rank's own work
    dp_comm    ZeRO 0 all-reduce 2(N-1)/N P; 1 and 2 reduce-scatter + all-gather, the same volume;
               3 reduce-scatter + an all-gather per micro-batch forward and backward; (1 - dp_overlap)
               of it exposed; on the last pipeline stage only what outlasts the p - 1 backward
               passes the earlier stages still run. MoE: dense parameters over dp*cp, the experts
               (E_params / ep per device) over expert_dp = tp*cp*dp / ep, the same formulas
    optimizer  AdamW reads and writes its state once: P_opt (2 K_opt + K_param + K_grad) bytes / mem_bw
               (at the process's core share, cpu: the bandwidth is the core's)
    overhead   layer_overhead per layer pass + step_overhead

Links (order tp-cp-ep-dp-pp: a group spans the product of the degrees up to its own): TP over
the intra-node link while tp fits in a node; CP while tp*cp does; DP (over dp*cp replicas)
while tp*cp*dp does; EP while tp*cp*ep does; PP over the inter-node link as soon as there is
more than one node. Latency: a ring step per peer inside a node; across nodes NCCL's trees pay
~2 log2(N) steps instead of 2(N-1).

A calibrated cluster may carry a measured category's own parameters (`Cluster.categories`,
from per-category least squares in calibrate.py); unit() uses them for that category's terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from threefold.planner.cluster import Cluster
from threefold.planner.cp_cost import cp_comm_terms, cp_link
from threefold.planner.kernels import elementwise_bytes, gemm_factor, head_factor
from threefold.planner.layout import Layout
from threefold.planner.memory import ACT_BYTES
from threefold.planner.model import ModelShape

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


def unit(cluster: Cluster, name: str, category: str = "") -> float:
    """Seconds per unit of coefficient for parameter `name` (see the module docstring), with
    `category`'s own fitted value where the cluster has one."""
    from threefold.planner.validation import BAND_OF

    own = cluster.categories.get(BAND_OF.get(category, category), {}) if category else {}
    value = own.get(name, getattr(cluster, name))
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


def seconds(terms: Terms, cluster: Cluster, category: str = "") -> float:
    return sum(coef * unit(cluster, name, category) for name, coef in terms.items())


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


def _collective(into: Terms, link: str, nbytes: float, steps: float, calls: float) -> None:
    _add(into, f"{link}_bw_gbps", nbytes)
    _add(into, f"{link}_latency_us", steps)
    _add(into, "collective_overhead_us", calls)


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
        return {c: seconds(self.categories.get(c, {}), cluster, c) for c in CATEGORIES}

    def total(self) -> Terms:
        return merge_terms(*self.categories.values())


def step_terms(
    shape: ModelShape, cluster: Cluster, layout: Layout, global_batch: int, dtype: str = "bf16"
) -> StepTerms:
    # Context parallelism: gradients are reduced over dp x cp replicas and each rank computes
    # seq/cp tokens, each attending over the whole sequence as layer_hw_flops counts: the
    # zigzag layout gives every rank 1/cp of the quadratic attention work too.
    t, p, v, b, d = layout.tp, layout.pp, layout.vpp, layout.mbs, layout.dp * layout.cp
    s, h = shape.seq_len // layout.cp, shape.hidden
    m = layout.microbatches(global_batch)
    act = ACT_BYTES[dtype]
    kp, kg = act, 4  # working parameters in the run's dtype; gradients reduced in fp32 (the default)
    ko = 12 if dtype == "bf16" else 8
    share = cluster.core_share  # of a core, per process (cpu with more processes than cores; else 1)
    peak = cluster.peak_flops
    dpn = cluster.devices_per_node
    split = shape.stage_split(p, v)

    tokens = b * s
    tp_link = "intra" if (t <= dpn and dpn % t == 0) or cluster.nodes == 1 else "inter"
    ep_link = ep_group_link(cluster, t, layout.ep, layout.cp)
    cp_layer = cp_comm_terms(shape, cluster, layout, act, _latency_steps)
    full = int(layout.recompute == "full")
    shared = bool(getattr(shape.cfg, "shared_expert", False))

    gemm = gemm_factor(shape.cfg, tokens, t, cluster.gemm_half_dim)
    head_gemm = head_factor(shape.cfg, tokens, t, cluster.gemm_half_dim)
    moved = elementwise_bytes(shape.cfg, t, act, layout.sp, cluster.device != "cpu") * tokens / share

    def micro_batch(layers: int, has_head: bool) -> dict[str, Terms]:
        """One micro-batch on a pipeline rank holding `layers` (all its v chunks)."""
        head = shape.head_flops * head_gemm if has_head else 0.0
        base = (layers * shape.layer_hw_flops["none"] * gemm + head) * tokens / t
        extra = layers * (shape.layer_hw_flops[layout.recompute] - shape.layer_hw_flops["none"]) * gemm * tokens / t
        mb = {
            "compute": {"compute_efficiency": base / peak, "elementwise_bw_gbps": layers * moved},
            # full recompute repeats the forward's element-wise third
            "recompute": _scaled({"compute_efficiency": extra / peak, "elementwise_bw_gbps": layers * moved / 3}, 1)
            if full
            else {"compute_efficiency": extra / peak},
            "tp_comm": {},
            "cp_comm": _scaled(cp_layer, layers),
            "ep_comm": {},
            "overhead": {},
        }
        moe = layers * shape.moe_fraction  # MoE blocks among them (the model's share)
        if t > 1:
            x = tokens * h * act
            ring = (t - 1) / t
            exposed = 1.0 - cluster.tp_overlap
            # Collectives per block as (all-reduces, all-gathers or reduce-scatters, latency-only).
            if layout.sp:  # 4 AG + 4 RS, 2 AG repeated in backward; full recompute repeats 2 + 2
                dense_block = (0, 10 + 4 * full, 0)
                attention = (0, 5 + 2 * full, 0)
                routed = (0, 0, 1 + full)  # tokens arrive split; only the routing counts are gathered
            else:  # 2 all-reduces forward, 2 backward; full recompute repeats the forward's
                dense_block = (4 + 2 * full, 0, 0)
                attention = (2 + full, 0, 0)
                # each rank routes its slice of the sequence: the output is all-gathered forward, the
                # input gradient backward; plus the routing counts
                routed = (0, 2 + full, 1 + full)
            moe_block = tuple(a + r + (d - a if shared else 0) for a, r, d in zip(attention, routed, dense_block))
            n_ar, n_ag, n_lat = (((layers - moe) * d + moe * e) for d, e in zip(dense_block, moe_block))
            if layout.sp:
                n_ag += 2  # the vocab-parallel embedding (forward) and head (backward)
            else:
                n_ar += 2
            nbytes = n_ar * 2 * ring * x + n_ag * ring * x
            steps = n_ar * _latency_steps(t, tp_link, 2 * (t - 1)) + (n_ag + n_lat) * _latency_steps(t, tp_link, t - 1)
            calls = n_ar + n_ag + n_lat
            _collective(mb["tp_comm"], tp_link, exposed * nbytes, exposed * steps, exposed * calls)
        if layout.ep > 1 and moe:
            a2a = ep_all_to_all(shape, cluster, layout, act)
            # dispatch + combine forward and the same two backward; full recompute repeats the
            # forward's; one exchange of counts per forward
            n = 4 + 2 * full
            _collective(
                mb["ep_comm"],
                ep_link,
                moe * n * a2a["bytes"],
                moe * (n + 1 + full) * a2a["steps"],
                moe * (n + 1 + full),
            )
        # Host work per layer pass; processes sharing cores (cpu) pay it at their share too.
        _add(mb["overhead"], "layer_overhead_us", layers * (4 / 3 if full else 1.0) / share)
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
    if p > 1 and share < 1.0:
        _oversubscribed_pipeline(cats, mb, micro_batch(shape.layers, True), m, p, ratio, share)
    else:
        cats["bubble"] = _scaled(merge_terms(*mb.values()), m * ratio)

    cats["pp_comm"] = {}
    pp_link = "intra" if cluster.nodes == 1 else "inter"
    if p > 1:
        # The slowest rank's own transfers: an end rank sends and receives once per micro-batch
        # and chunk boundary it owns, a middle rank (p >= 3 has one on the critical path) both ways.
        n = 4 * m * v if p >= 3 else 2 * m * (2 * v - 1)
        x = tokens * h * act / (t if layout.sp else 1)
        # Sends and receives are posted ahead and wait for no group: no rendezvous to pay.
        _collective(cats["pp_comm"], pp_link, n * x, n, 0)

    # Data parallel: the rank holding the most parameters. Dense gradients over dp, experts'
    # over expert_dp (tp * dp / ep ranks), which spans the same consecutive ranks as dp.
    if p == 1:
        held = [
            shape.state_numel(shape.layers, shape.embed_params + (0 if shape.tied else shape.head_params), t, layout.ep)
        ]
    else:
        held = [
            shape.state_numel(split.first_layers, shape.embed_params, t, layout.ep),
            shape.state_numel(split.last_layers, shape.head_params, t, layout.ep),
        ]
    dense, expert = max(held, key=sum)
    edp = t * d // layout.ep
    cats["dp_comm"] = {}
    dp_link = "intra" if t * d <= dpn or cluster.nodes == 1 else "inter"
    exposed = 1.0 - cluster.dp_overlap
    for numel, n in ((dense, d), (expert, edp)):
        if n > 1 and numel:
            nbytes, steps, calls = _gradient_sync(numel, n, layout.zero, m, dp_link, kp, kg)
            _collective(cats["dp_comm"], dp_link, exposed * nbytes, exposed * steps, exposed * calls)

    if p > 1 and rank == "last" and cats["dp_comm"]:
        # 1F1B: the last stage's final backward ends p - 1 backward passes before the first
        # stage's, and its reduction runs in that window; only what outlasts it is exposed
        # (evaluated at the cluster's values, which keeps the terms linear around them).
        window = (p - 1) * seconds(mb["compute"], cluster, "compute") * 2 / 3
        comm = seconds(cats["dp_comm"], cluster, "dp_comm")
        cats["dp_comm"] = _scaled(cats["dp_comm"], max(0.0, comm - window) / comm) if comm > 0 else {}
    opt_numel = (dense / d + expert / edp) if layout.zero >= 1 else dense + expert
    cats["optimizer"] = {"mem_bw_gbps": opt_numel * (2 * ko + kp + kg) / share}
    cats["overhead"] = merge_terms(cats["overhead"], {"step_overhead_s": 1.0})
    # The idlest rank waits for the bubble, the transfers and for the slowest rank's extra work.
    imbalance = merge_terms(_scaled(merge_terms(*mb.values()), m), _scaled(merge_terms(*light.values()), -m))
    extra = {"pp_idle": merge_terms(cats["bubble"], cats["pp_comm"], imbalance) if p > 1 else {}}
    slow_layers = shape.layers if p == 1 else (split.last_layers if rank == "last" else split.first_layers)
    hw_flops = slow_layers * shape.layer_hw_flops[layout.recompute] + (shape.head_flops if rank == "last" else 0)
    hw_flops *= tokens / t * m
    links = {"tp": tp_link, "pp": pp_link, "dp": dp_link, "ep": ep_link, "cp": cp_link(cluster, t, layout.cp)}
    return StepTerms(cats, rank, hw_flops, links, extra)


WORK = ("compute", "recompute", "overhead")


def _oversubscribed_pipeline(
    cats: dict[str, Terms], mb: dict[str, Terms], whole: dict[str, Terms], m: int, p: int, ratio: float, share: float
) -> None:
    """Pipeline ranks that share too few cores (cpu: more processes than cores): a rank waiting
    in the bubble leaves its core to the others, so the step is bounded below both by the
    critical path at a full core each, m (1 + ratio) times the slowest rank's work, and by all
    ranks' work spread over the cores, m times the average rank's work at the share. The
    larger of the two (per parameter, which keeps the terms linear) is the work the slowest
    rank's categories and the bubble split: its own work at the share where the step is that
    long, the rest bubble. Only a critical-path-bound step idles in the bubble's collectives."""
    work = merge_terms(*(mb[c] for c in WORK))
    critical = _scaled(work, m * (1 + ratio) * share)
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
        bubble = merge_terms(bubble, _scaled(merge_terms(mb["tp_comm"], mb["cp_comm"], mb["ep_comm"]), m * ratio))
    cats["bubble"] = {k: c for k, c in bubble.items() if c > 0}


def _gradient_sync(numel: float, n: int, zero: int, m: int, link: str, kp: int, kg: int) -> tuple[float, float, float]:
    """(bytes, latency steps, collective calls) one rank pays to synchronise `numel` parameters
    over `n` replicas (the buckets' calls counted as one: they overlap each other)."""
    ring = (n - 1) / n
    if zero == 0:
        return 2 * ring * numel * kg, _latency_steps(n, link, 2 * (n - 1)), 1
    if zero in (1, 2):
        return ring * numel * (kg + kp), 2 * _latency_steps(n, link, n - 1), 2
    return ring * numel * (kg + 2 * m * kp), (1 + 2 * m) * _latency_steps(n, link, n - 1), 1 + 2 * m


def ep_group_link(cluster: Cluster, t: int, ep: int, cp: int = 1) -> str:
    """The ep ranks are consecutive data-parallel ranks after tp and cp (order tp-cp-ep-dp-pp):
    the group spans tp * cp * ep neighbouring ranks, inside a node while that fits one."""
    return "intra" if t * cp * ep <= cluster.devices_per_node or cluster.nodes == 1 else "inter"


def ep_all_to_all(shape: ModelShape, cluster: Cluster, layout: Layout, act: int) -> dict[str, float]:
    """One all-to-all of an MoE layer's dispatch (or combine) for one micro-batch, per rank.

    A rank routes tokens / tp tokens (the TP ranks split them; cp ranks hold s / cp each), each
    to top_k experts: V = (b s / (cp tp)) top_k h bytes. Balanced, it keeps 1/ep of V, sends the rest.
    Inside a node that is (ep-1)/ep of V over the intra link; across nodes the share bound for
    other nodes' ranks, (ep - local)/ep with `local` group members per node, over the inter
    link (the in-node part moves at the same time, over the faster link)."""
    t, ep = layout.tp, layout.ep
    volume = layout.mbs * shape.seq_len / layout.cp / t * shape.top_k * shape.hidden * act
    link = ep_group_link(cluster, t, ep, layout.cp)
    local = ep if link == "intra" else max(1, min(ep, cluster.devices_per_node // (t * layout.cp)))
    return {
        "volume": volume,
        "bytes": volume * (ep - local if link == "inter" else ep - 1) / ep,
        "steps": _latency_steps(ep, link, ep - 1),
        "link": link,
    }
