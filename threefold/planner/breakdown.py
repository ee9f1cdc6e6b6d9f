"""A single-device step as the planner prices it, split the way a profile of the device splits
it: GEMMs, the attention core, memory-bound (element-wise) work, the optimizer phase and the
host overhead the device waits through. bench/gpu.py's breakdown phase puts each class next
to the kernel time a profiler measured on the same run.

The split is exact over the planner's own terms (planner/cost.py): a layer's compute FLOPs at
peak carry the FLOP-weighted factor of its GEMMs and attention core (kernels.gemm_factor), so
the attention core's seconds are its FLOPs times its own factor, and the GEMMs are the rest of
the compute_efficiency seconds (the head's GEMM included). Element-wise is every
elementwise_bw_gbps and reduction_bw_gbps term, the optimizer its category, overhead the layer passes' and the
step's fixed host time. Only layouts of one device have no communication to split: the
breakdown is for one-device runs.
"""

from __future__ import annotations

from threefold.planner.cluster import Cluster
from threefold.planner.cost import step_terms
from threefold.planner.kernels import attention_factor, attention_flops, gemm_factor, layer_gemms, shape_factor
from threefold.planner.layout import Layout
from threefold.planner.model import ModelShape
from threefold.planner.units import unit

CLASSES = ("gemm", "attention", "elementwise", "optimizer", "overhead")


def attention_share(cfg, tokens: int, t: int, cluster: Cluster) -> float:
    """The attention core's share of a layer's compute seconds at peak (kernels.gemm_factor's parts)."""
    parts = [fl * shape_factor(*mnk, cluster) for fl, mnk in layer_gemms(cfg, tokens, t)]
    attention = attention_flops(cfg, t) * attention_factor(cfg, cluster)
    return attention / (sum(parts) + attention)


def predicted_classes(shape: ModelShape, cluster: Cluster, layout: Layout, global_batch: int, dtype: str) -> dict:
    """{class: seconds} of one step on one device, and "step", their sum with anything else."""
    if layout.world != 1:
        raise ValueError(f"the breakdown is of one-device runs, got a world of {layout.world}")
    st = step_terms(shape, cluster, layout, global_batch, dtype)
    times = st.times(cluster)
    work = [st.categories.get(c, {}) for c in ("compute", "recompute")]
    flops_s = sum(terms.get("compute_efficiency", 0.0) for terms in work) * unit(cluster, "compute_efficiency")
    elementwise = sum(
        sum(terms.get(name, 0.0) for terms in work) * unit(cluster, name)
        for name in ("elementwise_bw_gbps", "reduction_bw_gbps")
    )
    tokens = layout.mbs * shape.seq_len
    layer_flops = shape.layers * shape.layer_hw_flops[layout.recompute] * tokens * layout.microbatches(global_batch)
    at_peak = layer_flops * gemm_factor(shape.cfg, tokens, 1, cluster) / cluster.peak_flops
    layer_s = at_peak * unit(cluster, "compute_efficiency")
    attention = layer_s * attention_share(shape.cfg, tokens, 1, cluster)
    return {
        "gemm": flops_s - attention,
        "attention": attention,
        "elementwise": elementwise,
        "optimizer": times["optimizer"],
        "overhead": times["overhead"],
        "step": sum(times.values()),
    }
