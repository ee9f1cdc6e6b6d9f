"""How much of each transfer the compute beside it hides (cluster.overlap = modelled, the GPU
profiles): the engine's overlap, term by term. On a GPU a collective runs on its own engine
(NCCL's kernels beside the compute stream), so only what outlasts the compute it runs beside
costs step time. Each term hides at most that compute's time, on its own link; a transfer
that shares its link with another in the same window waits for it (two on one NIC take the
sum of their times). What a term can never hide (the last bucket, the first block) stays
exposed. The shares are evaluated at the cluster's values and scale the term's bytes, steps
and calls, which keeps the cost linear around them for calibration (as cp_cost.py does).

`ASSUMPTIONS` says, per category, what the model assumes and where that comes from;
`threefold plan` prints it. `cluster.overlap = none` (cpu: gloo's transfers take the cores the
compute needs) leaves every transfer exposed but a fixed `dp_overlap` / `tp_overlap` /
`pp_overlap` share; a fixed share also overrides the model on a GPU (pp_overlap 0: Megatron-LM's
blocking sends before 2023).
"""

from __future__ import annotations

BUCKET_PARAMS = (
    25 * (1 << 20) / 4
)  # parallel.bucket_mb 25 MiB of fp32 gradients: one bucket's parameters (twice that in 16 bits)

ASSUMPTIONS = {
    "tp_comm": {
        "backward": "forward collectives exposed; backward dX all-reduce (SP: reduce-scatter) behind the "
        "deferred dW GEMMs, SP's re-gather behind dX (the engine's parallel.tp_comm_overlap, Megatron-Core's "
        "async grad reduce)",
        "all": "forward collectives pipelined with their GEMMs too, one chunk in tp exposed (Transformer Engine "
        "userbuffers, torch async TP); backward as the engine",
        "none": "every TP collective exposed",
    },
    "dp_comm": {
        "after_step": "gradient buckets reduce behind the last micro-batch's backward (the engine's "
        "grad_reduce overlap, Megatron's overlap_grad_reduce), the last bucket exposed, sharing the link with "
        "pipeline/cp/ep traffic; ZeRO-1/2's parameter all-gather exposed after the optimizer step "
        "(parallel.overlap_param_gather false); ZeRO-3 on two lanes: its gathers ahead of compute, the first "
        "block of each pass exposed, its reduce-scatters behind backward, the last block exposed",
        "forward": "gradient buckets as the engine; ZeRO-1/2's parameter all-gather behind the next step's "
        "first forward, the first bucket exposed (the engine's parallel.overlap_param_gather, Megatron's "
        "overlap_param_gather); ZeRO-3 on two lanes as after_step",
    },
    "pp_comm": "sends and receives posted ahead: each hides behind one chunk's forward of a micro-batch, "
    "the 2 (p - 1) of the fill and drain on the critical path exposed",
    "cp_comm": "ring: each key/value block in flight behind one block of attention, backward's "
    "accumulators with it (planner/cp_cost.py); a2a: exposed",
    "ep_comm": "all-to-alls exposed: nothing of the same micro-batch can run beside dispatch and combine",
    "overhead": "the host queues each layer's kernels ahead of the device: only host time per layer pass "
    "(layer_overhead_us) beyond the pass's device time is exposed (one H200, bench/gpu.py's breakdown)",
}
SLOWDOWN = (
    "each hidden second of a transfer costs overlap_slowdown of a second of the compute beside it "
    "(NCCL's kernels take SMs and memory bandwidth: 18.9% on average, arXiv 2507.03114)"
)


def param_gather(overlap: bool) -> str:
    """cluster.param_gather of a run's parallel.overlap_param_gather (the engine's default: on)."""
    return "forward" if overlap else "after_step"


def exposed_share(transfer_s: float, window_s: float, tail_s: float = 0.0) -> float:
    """Share of a transfer of `transfer_s` left exposed when it can run behind `window_s` of
    compute and its last `tail_s` can never hide."""
    if transfer_s <= 0:
        return 0.0
    return min(1.0, max(min(tail_s, transfer_s), transfer_s - window_s) / transfer_s)


def charged(share: float, cluster) -> float:
    """The share of a transfer's time the step pays once the compute it hides behind runs
    slower beside it (`overlap_slowdown` of each hidden second: NCCL's kernels take SMs and
    memory bandwidth from the GEMMs they overlap)."""
    return share + cluster.overlap_slowdown * (1.0 - share)


def modelled(cluster, fixed: float) -> bool:
    """Whether a term's overlap is modelled: cluster.overlap says so and no fixed share is set."""
    return cluster.overlap == "modelled" and fixed < 0


def fixed_exposed(fixed: float) -> float:
    """The exposed share a fixed dp_overlap / tp_overlap / pp_overlap leaves (-1: none hidden)."""
    return 1.0 - max(0.0, fixed)


def overlap_lines(cluster) -> list[str]:
    """One line per category: what the plan's cost model assumes of its overlap."""
    if cluster.overlap != "modelled":
        lines = [f"overlap: none modelled (cluster.overlap = {cluster.overlap!r}): every transfer exposed"]
        for key in ("tp_overlap", "dp_overlap", "pp_overlap"):
            if getattr(cluster, key) > 0:
                lines.append(f"  {key} {getattr(cluster, key):.0%} hidden (a fixed share)")
        return lines
    lines = ["overlap (cluster.overlap = 'modelled'), per category:"]
    tp = ASSUMPTIONS["tp_comm"][cluster.tp_overlap_scope]
    lines.append(
        f"  tp_comm  {tp}" if cluster.tp_overlap < 0 else f"  tp_comm  {cluster.tp_overlap:.0%} hidden (fixed)"
    )
    dp = ASSUMPTIONS["dp_comm"][cluster.param_gather]
    lines.append(
        f"  dp_comm  {dp}" if cluster.dp_overlap < 0 else f"  dp_comm  {cluster.dp_overlap:.0%} hidden (fixed)"
    )
    pp = ASSUMPTIONS["pp_comm"]
    lines.append(
        f"  pp_comm  {pp}" if cluster.pp_overlap < 0 else f"  pp_comm  {cluster.pp_overlap:.0%} hidden (fixed)"
    )
    lines += [f"  {c}  {ASSUMPTIONS[c]}" for c in ("cp_comm", "ep_comm", "overhead")]
    lines.append(f"  tp, dp, pp: {SLOWDOWN}; here {cluster.overlap_slowdown:.0%}")
    return lines
