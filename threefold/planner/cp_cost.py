"""The cp_comm term of the step-time model: context-parallel attention's traffic per layer and
micro-batch, and how much of it the attention compute hides.

Bytes are those `context_parallel_attention` records (context_parallel.analytic_bytes, with the
TP-local head counts): one forward, one backward, and one more forward when recomputation
reruns the attention core (selective reruns exactly that core, full reruns the layer).

ring  every exchange is one point-to-point step to the ring neighbour (posted before the block
      it hides behind). Forward: cp - 1 key/value blocks, each in flight while one block of
      attention computes (1/cp of the rank's attention forward). Backward: the next key/value
      block and the previous block's fp32 dk/dv accumulator travel together while a block's
      backward computes (twice its forward), cp - 1 times, and the last accumulator's trip back
      to its owner is exposed. Exposed = sum over steps of max(0, transfer - compute).
a2a   (Ulysses) two all-to-alls per forward (q, k, v in; the output back) and their conjugates
      backward, each rank sending (cp - 1)/cp of its input; nothing runs beside them, so all of
      it is exposed.

The max() is evaluated at the cluster's values and the transfer terms scaled by the exposed
fraction, which keeps the terms linear around those values (as cost.py does for the last
pipeline stage's DP window), so calibration can fit the link from span_cp_comm_s.

Link: the cp ranks are consecutive after tp (order tp-cp-ep-dp-pp), so a cp group spans tp * cp
neighbouring ranks: the intra-node link while that fits a node, else the inter-node one.
"""

from __future__ import annotations

from threefold.model.flops import attention_flops_per_token_per_layer
from threefold.planner.kernels import attention_factor

Terms = dict


def cp_link(cluster, t: int, cp: int) -> str:
    """The link of a cp group of `cp` ranks strided by `t` (tp-cp-... order)."""
    if "cp" in cluster.links:
        return cluster.links["cp"]
    return "intra" if t * cp <= cluster.devices_per_node or cluster.nodes == 1 else "inter"


def cp_bytes(shape, layout, act: int):
    """analytic_bytes of one attention call for this layout's TP-local heads (CpBytes)."""
    from threefold.distributed.context_parallel import analytic_bytes  # torch: only when cp is used

    cfg, t = shape.cfg, layout.tp
    heads, kv = cfg.heads // t, max(1, cfg.kv_heads // t)  # kv heads below tp are replicated
    return analytic_bytes(layout.cp_impl, layout.mbs, heads, kv, shape.seq_len, cfg.head_dim, layout.cp, act)


def attention_forward_s(shape, cluster, layout) -> float:
    """Seconds of this rank's causal attention core forward for one layer and micro-batch: the
    load-balanced split gives every rank 1/cp of the whole sequence's attention FLOPs."""
    tokens = layout.mbs * shape.seq_len / layout.cp
    flops = attention_flops_per_token_per_layer(shape.cfg, shape.seq_len) * tokens / layout.tp
    # A fused kernel's own rate where the profile has one (planner/kernels.py); cpu: the GEMM rate.
    factor = attention_factor(shape.cfg, cluster) if cluster.attention_efficiency > 0 else 1.0
    return flops * factor / (cluster.peak_flops * cluster.compute_efficiency)


def cp_traffic(shape, cluster, layout, act: int, latency_steps) -> dict[str, float]:
    """One layer and micro-batch of cp traffic on one rank: bytes on the link, latency steps,
    calls, and the exposed fraction of their time (at the cluster's values). `latency_steps`
    is comm_cost.latency_steps (ring steps inside a node, trees across)."""
    cp = layout.cp
    link = cp_link(cluster, layout.tp, cp)
    sent = cp_bytes(shape, layout, act)
    forwards = 1 + (layout.recompute != "none")
    if layout.cp_impl == "a2a":
        n = 2 * forwards + 2
        share = (cp - 1) / cp  # of each all-to-all's input leaves the rank
        volume = share * (forwards * sent.forward + sent.backward)
        return {"link": link, "bytes": volume, "steps": n * latency_steps(cp, link, cp - 1), "calls": n, "exposed": 1.0}
    kv = sent.forward / (cp - 1)  # one key/value block
    dkv = (sent.backward - sent.forward) / cp  # one fp32 gradient accumulator
    per_byte = 1.0 / (getattr(cluster, f"{link}_bw_gbps") * 1e9)
    fixed = getattr(cluster, f"{link}_latency_us") * 1e-6 + cluster.collective_overhead_us * 1e-6

    def took(nbytes: float) -> float:
        return nbytes * per_byte + fixed

    block = attention_forward_s(shape, cluster, layout) / cp
    forward_exposed = (cp - 1) * max(0.0, took(kv) - block)
    backward_exposed = (cp - 1) * max(0.0, took(kv) + took(dkv) - 2 * block) + took(dkv)
    exchanges = forwards * (cp - 1) + (cp - 1) + cp
    alone = forwards * (cp - 1) * took(kv) + (cp - 1) * took(kv) + cp * took(dkv)
    return {
        "link": link,
        "bytes": forwards * sent.forward + sent.backward,
        "steps": exchanges,
        "calls": exchanges,
        "exposed": (forwards * forward_exposed + backward_exposed) / alone,
    }


def cp_comm_terms(shape, cluster, layout, act: int, latency_steps) -> Terms:
    """cp_comm terms of ONE layer and ONE micro-batch ({} without cp): the traffic's exposed part."""
    if layout.cp == 1:
        return {}
    x = cp_traffic(shape, cluster, layout, act, latency_steps)
    k, link = x["exposed"], x["link"]
    terms = {
        f"{link}_bw_gbps": k * x["bytes"],
        f"{link}_latency_us": k * x["steps"],
        "collective_overhead_us": k * x["calls"],
    }
    return {name: coef for name, coef in terms.items() if coef}
