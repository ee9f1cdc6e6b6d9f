"""The communication of a layout's step as linear terms (planner/cost.py assembles the step):
per category, bytes over a link, latency steps and collective calls.

    tp_comm  per layer and micro-batch, the collectives distributed/tp_collectives.py counts: a
             dense block's attention and MLP, an MoE block's attention, routed experts (the TP
             ranks split the tokens) and shared expert; full recompute's rerun; and once per
             micro-batch on every rank the vocab-parallel embedding and head (the loss's two
             all-reduces of a few fp32 per token are left out). A ring all-reduce moves
             2 (t-1)/t X over 2 (t-1) steps, an all-gather or reduce-scatter (t-1)/t X over t - 1,
             a gather of routing counts only its steps; a fixed cost per call; (1 - tp_overlap)
             of it exposed
    ep_comm  per MoE block and micro-batch, 4 all-to-alls (dispatch and combine, forward and
             backward; full recompute repeats the forward's 2) of (b s / t) top_k h, each rank
             sending (ep-1)/ep of it, plus a latency-only exchange of counts per forward
    pp_comm  the slowest rank's own point-to-point transfers of sbh (sbh/t under SP): an end rank
             sends and receives 2 m (2 v - 1), a middle one 4 m v (what its pp_p2p span times);
             with pp_scatter_gather and no SP, sbh/t each and an all-gather of sbh over the TP
             link after each receive
    dp_comm  ZeRO 0 all-reduce 2(N-1)/N P; 1 and 2 reduce-scatter + all-gather, the same volume;
             3 reduce-scatter + an all-gather per micro-batch forward and backward; (1 - dp_overlap)
             of it exposed. MoE: dense parameters over dp*cp, the experts (E_params / ep per
             device) over expert_dp = tp*cp*dp / ep, the same formulas

Links (order tp-cp-ep-dp-pp: a group spans the product of the degrees up to its own): TP over
the intra-node link while tp fits in a node; CP while tp*cp does (planner/cp_cost.py); DP (over
dp*cp replicas) while tp*cp*dp does; EP while tp*cp*ep does; PP over the inter-node link as soon
as there is more than one node. Latency: a ring step per peer inside a node; across nodes
NCCL's trees pay ~2 log2(N) steps instead of 2(N-1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from threefold.distributed.tp_collectives import (
    DENSE_BLOCK,
    TP_COLLECTIVES,
    Collectives,
    block_collectives,
    moe_block,
)
from threefold.planner.cluster import Cluster
from threefold.planner.kernels import region_gemm_seconds
from threefold.planner.layout import Layout
from threefold.planner.memory import expert_dp
from threefold.planner.model import ModelShape
from threefold.planner.overlap import BUCKET_PARAMS, charged, exposed_share, fixed_exposed, modelled
from threefold.planner.units import seconds

Terms = dict  # parameter name -> coefficient (planner/cost.py)


def latency_steps(n: int, link: str, ring_steps: float) -> float:
    """Ring steps inside a node; across nodes tree algorithms pay ~2 log2(n) per collective."""
    if link == "inter":
        return min(ring_steps, 2 * math.ceil(math.log2(max(n, 2))))
    return ring_steps


def collective(into: Terms, link: str, nbytes: float, steps: float, calls: float) -> None:
    """Add bytes over `link`, its latency steps and the calls' fixed cost to `into` (zeros left out)."""
    for name, coef in ((f"{link}_bw_gbps", nbytes), (f"{link}_latency_us", steps), ("collective_overhead_us", calls)):
        if coef:
            into[name] = into.get(name, 0.0) + coef


def _scaled(terms: Terms, k: float) -> Terms:
    return {name: coef * k for name, coef in terms.items() if coef * k}


def tp_link(cluster: Cluster, tp: int) -> str:
    if "tp" in cluster.links:
        return cluster.links["tp"]
    per_node = cluster.devices_per_node
    return "intra" if (tp <= per_node and per_node % tp == 0) or cluster.nodes == 1 else "inter"


def dp_link(cluster: Cluster, layout: Layout) -> str:
    if "dp" in cluster.links:
        return cluster.links["dp"]
    return "intra" if layout.tp * layout.dp * layout.cp <= cluster.devices_per_node or cluster.nodes == 1 else "inter"


def pp_link(cluster: Cluster) -> str:
    if "pp" in cluster.links:
        return cluster.links["pp"]
    return "intra" if cluster.nodes == 1 else "inter"


def ep_group_link(cluster: Cluster, t: int, ep: int, cp: int = 1) -> str:
    """The ep ranks are consecutive data-parallel ranks after tp and cp (order tp-cp-ep-dp-pp):
    the group spans tp * cp * ep neighbouring ranks, inside a node while that fits one."""
    if "ep" in cluster.links:
        return cluster.links["ep"]
    return "intra" if t * cp * ep <= cluster.devices_per_node or cluster.nodes == 1 else "inter"


def _activation_bytes(shape: ModelShape, layout: Layout, act: int) -> int:
    """X: one micro-batch's activation [seq / cp, mbs, hidden] on a rank."""
    return layout.mbs * (shape.seq_len // layout.cp) * shape.hidden * act


def tp_comm_terms(
    shape: ModelShape, cluster: Cluster, layout: Layout, act: int, layers: int, moe_layers: float
) -> Terms:
    """TP/SP collectives of one micro-batch over `layers` layers, `moe_layers` of them MoE blocks."""
    tp, sp, full = layout.tp, layout.sp, layout.recompute == "full"
    terms: Terms = {}
    if tp == 1:
        return terms
    shared = bool(getattr(shape.cfg, "shared_expert", False))
    dense_block = _by_cost(block_collectives(sp, DENSE_BLOCK, full))
    moe = _by_cost(block_collectives(sp, moe_block(shared), full))
    all_reduces, gathers, latency_only = ((layers - moe_layers) * d + moe_layers * e for d, e in zip(dense_block, moe))
    # Both vocab-parallel ends on every rank's micro-batch; the loss's all-reduces left out.
    ends = TP_COLLECTIVES[sp]["embedding"].both + TP_COLLECTIVES[sp]["head"].both
    all_reduces += ends.all_reduce
    gathers += ends.all_gather + ends.reduce_scatter
    activation = _activation_bytes(shape, layout, act)
    ring = (tp - 1) / tp
    link = tp_link(cluster, tp)
    nbytes = all_reduces * 2 * ring * activation + gathers * ring * activation
    steps_per_call = latency_steps(tp, link, 2 * (tp - 1)), latency_steps(tp, link, tp - 1)
    steps = all_reduces * steps_per_call[0] + (gathers + latency_only) * steps_per_call[1]
    calls = all_reduces + gathers + latency_only
    collective(terms, link, nbytes, steps, calls)
    if not modelled(cluster, cluster.tp_overlap):
        return _scaled(terms, fixed_exposed(cluster.tp_overlap))
    total = seconds(terms, cluster, "tp_comm")
    if total <= 0:
        return terms
    one = {"ar": {}, "ag": {}}  # one all-reduce, one all-gather (or reduce-scatter) of X, in seconds
    collective(one["ar"], link, 2 * ring * activation, steps_per_call[0], 1)
    collective(one["ag"], link, ring * activation, steps_per_call[1], 1)
    ar, ag = (seconds(one[k], cluster, "tp_comm") for k in ("ar", "ag"))
    hidden = _tp_hidden(shape, cluster, layout, ar, ag, layers, moe_layers)
    return _scaled(terms, charged(max(0.0, total - hidden) / total, cluster))


def _tp_hidden(shape, cluster, layout, ar: float, ag: float, layers: int, moe_layers: float) -> float:
    """Seconds of one micro-batch's TP collectives the compute beside them hides (overlap.py):
    per region, backward's dX collective behind the deferred dW GEMMs, and under SP the
    re-gather behind dX; with scope "all" the forward collectives behind the region's GEMMs
    too, but one chunk in tp."""
    scope = cluster.tp_overlap_scope
    if scope == "none":
        return 0.0
    windows = region_gemm_seconds(shape.cfg, layout.mbs * (shape.seq_len // layout.cp), layout.tp, cluster)
    hidden = 0.0
    for region, count in (("attention", layers), ("mlp", layers - moe_layers)):
        entry, forward = windows[region]
        if layout.sp:  # backward: the reduce-scatter behind dW, the re-gather behind dX
            per = min(ag, entry) * 2
            if scope == "all":  # forward: the all-gather and the reduce-scatter, each behind its GEMM
                per += min(2 * ag * (1 - 1 / layout.tp), forward)
        else:
            per = min(ar, entry)
            if scope == "all":
                per += min(ar * (1 - 1 / layout.tp), forward)
        hidden += count * per
    return hidden


def _by_cost(counts: Collectives) -> tuple[int, int, int]:
    """(all-reduces, all-gathers and reduce-scatters, latency-only gathers of routing counts)."""
    return counts.all_reduce, counts.all_gather + counts.reduce_scatter, counts.counts


def ep_comm_terms(shape: ModelShape, cluster: Cluster, layout: Layout, act: int, moe_layers: float) -> Terms:
    """Expert-parallel all-to-alls of one micro-batch over `moe_layers` MoE blocks."""
    terms: Terms = {}
    if layout.ep == 1 or not moe_layers:
        return terms
    a2a = ep_all_to_all(shape, cluster, layout, act)
    full = int(layout.recompute == "full")
    all_to_alls = 4 + 2 * full
    exchanges = all_to_alls + 1 + full  # and the counts, once per forward
    link = ep_group_link(cluster, layout.tp, layout.ep, layout.cp)
    collective(
        terms,
        link,
        moe_layers * all_to_alls * a2a["bytes"],
        moe_layers * exchanges * a2a["steps"],
        moe_layers * exchanges,
    )
    return terms


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
        "steps": latency_steps(ep, link, ep - 1),
        "link": link,
    }


def pp_comm_terms(
    shape: ModelShape, cluster: Cluster, layout: Layout, microbatches: int, act: int, paired: bool = False
) -> Terms:
    """The slowest rank's own point-to-point transfers in a step: an end rank sends and receives
    once per micro-batch and chunk boundary it owns, a middle rank (p >= 3 has one on the
    critical path) both ways. `paired`: each send moves at once with a receive, over the link's
    other direction (a blocking exchange batches the two), so the link carries half the
    transfers' time."""
    m, v, t = microbatches, layout.vpp, layout.tp
    terms: Terms = {}
    if layout.pp == 1:
        return terms
    transfers = 4 * m * v if layout.pp >= 3 else 2 * m * (2 * v - 1)
    whole = _activation_bytes(shape, layout, act)
    split = layout.sp or cluster.pp_scatter_gather
    # Sends and receives are posted ahead and wait for no group: no rendezvous to pay.
    on_link = transfers / 2 if paired else transfers
    collective(terms, pp_link(cluster), on_link * whole / (t if split else 1), on_link, 0)
    if cluster.pp_scatter_gather and not layout.sp and t > 1:
        # Half the transfers are receives, each gathered whole again over the TP ranks.
        link, gathers = tp_link(cluster, t), transfers / 2
        collective(terms, link, gathers * (t - 1) / t * whole, gathers * latency_steps(t, link, t - 1), gathers)
    return terms


def gradient_sync_terms(
    cluster: Cluster,
    layout: Layout,
    dense: float,
    expert: float,
    microbatches: int,
    act: int,
    windows: DpWindows | None = None,
) -> Terms:
    """One step's gradient synchronisation of a rank holding `dense` and `expert` parameters:
    the dense ones over dp x cp replicas, the experts' over expert_dp. Exposed: what a fixed
    dp_overlap leaves, or (modelled, with the compute `windows` beside it) what outlasts them."""
    kp = act  # working parameters in the run's dtype
    kg = 4 if cluster.grad_reduce == "fp32" else 2  # gradients: fp32 main grads (the default) or 16-bit
    link = dp_link(cluster, layout)
    parts: dict[str, Terms] = {}
    held = 0.0  # parameters synchronised: one bucket's share of the time is never hidden
    for numel, replicas in ((dense, layout.dp * layout.cp), (expert, expert_dp(layout))):
        if replicas > 1 and numel:
            held += numel
            for kind, (nbytes, steps, calls) in gradient_sync(
                numel, replicas, layout.zero, microbatches, link, kp, kg
            ).items():
                collective(parts.setdefault(kind, {}), link, nbytes, steps, calls)
    terms: Terms = {}
    if windows is None or not modelled(cluster, cluster.dp_overlap):
        for part in parts.values():
            for name, coef in _scaled(part, fixed_exposed(cluster.dp_overlap)).items():
                terms[name] = terms.get(name, 0.0) + coef
        return terms
    for kind, part in parts.items():
        for name, coef in _scaled(
            part, charged(_dp_exposed(kind, part, cluster, min(1.0, BUCKET_PARAMS * 4 / kg / held), windows), cluster)
        ).items():
            terms[name] = terms.get(name, 0.0) + coef
    return terms


@dataclass(frozen=True)
class DpWindows:
    """The compute a data-parallel transfer can run beside, seconds on the rank (cost.py)."""

    backward: float
    """The last micro-batch's backward (and, on the last of several pipeline stages, the
    backward passes the earlier stages still run): where the gradient buckets reduce."""
    forward: float
    """One micro-batch's forward: where ZeRO-1/2's parameter gathers can hide (param_gather forward)."""
    step: float
    """The rank's compute over the whole step: ZeRO-3's gathers run one block ahead of it."""
    blocks: int
    """Layers on the rank: the first block's gather of each pass is exposed (ZeRO-3)."""
    shared: float
    """Other traffic on the dp link during the backward window (pipeline sends, cp, ep)."""
    chunks: int = 1
    """Model chunks per pipeline rank (interleaved): each chunk's buckets start after its own
    last backward, which comes `stages` micro-batch chunks before the next chunk's."""
    stages: int = 1


def _dp_exposed(kind: str, part: Terms, cluster: Cluster, bucket_share: float, w: DpWindows) -> float:
    """Exposed share of one kind of the step's dp traffic (overlap.py): the reduction behind
    the backward window less the link's other traffic, the last bucket exposed; ZeRO-1/2's
    gather after the step, or behind the first forward but its first bucket; ZeRO-3's per
    block, one block ahead, the first block's exposed."""
    total = seconds(part, cluster, "dp_comm")
    if kind == "reduce" and w.chunks > 1 and total > 0:
        # Interleaved: chunk k from the end (k = 0 finishes last) has its own last backward and
        # the k * stages chunk backwards of the cool-down after it to hide behind; only the last
        # chunk's last bucket has nothing after it.
        per, window = total / w.chunks, max(0.0, w.backward - w.shared) / w.chunks
        last = max(min(bucket_share * total, per), per - window)
        exposed = last + sum(max(0.0, per - window * (1 + k * w.stages)) for k in range(1, w.chunks))
        return min(1.0, exposed / total)
    if kind == "reduce":
        return exposed_share(total, max(0.0, w.backward - w.shared), bucket_share * total)
    if kind == "gather":
        if cluster.param_gather != "forward":
            return 1.0
        return exposed_share(total, w.forward, bucket_share * total)
    # ZeRO 3 on two lanes (params.py): the gathers run ahead of the compute on their own
    # communicator, the first block of each pass exposed; the reduce-scatters, on the other,
    # behind backward, the last block's exposed. Neither waits behind the other's queue; a
    # deeper prefetch (zero3_prefetch) buys memory for jitter this model does not have.
    if kind == "block_gathers":
        return exposed_share(total, w.step, total / max(1, w.blocks))
    return exposed_share(total, max(0.0, w.backward - w.shared), total / max(1, w.blocks))


def gradient_sync(
    numel: float, n: int, zero: int, m: int, link: str, kp: int, kg: int
) -> dict[str, tuple[float, float, float]]:
    """{kind: (bytes, latency steps, collective calls)} one rank pays to synchronise `numel`
    parameters over `n` replicas (the buckets' calls counted as one: they overlap each other):
    "reduce" the gradients' all-reduce or reduce-scatter, "gather" ZeRO-1/2's parameter
    all-gather after the step, "block_gathers" and "block_reduce" ZeRO-3's per-block gathers (twice
    per micro-batch) and reduce-scatters, on their two lanes."""
    ring = (n - 1) / n
    if zero == 0:
        return {"reduce": (2 * ring * numel * kg, latency_steps(n, link, 2 * (n - 1)), 1)}
    if zero in (1, 2):
        steps = latency_steps(n, link, n - 1)
        return {"reduce": (ring * numel * kg, steps, 1), "gather": (ring * numel * kp, steps, 1)}
    steps = latency_steps(n, link, n - 1)
    return {
        "block_gathers": (ring * numel * 2 * m * kp, 2 * m * steps, 2 * m),
        "block_reduce": (ring * numel * kg, steps, 1),
    }
