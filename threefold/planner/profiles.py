"""The built-in hardware profiles: datasheet numbers and cited priors for each device, and the
names users may give them. planner/cluster.py fills a Cluster's unset knobs from these."""

from __future__ import annotations

from typing import Any

# Datasheet numbers, and priors for the efficiency parameters (calibrate them: docs/planner.md).
# Each GPU figure below cites where it comes from (docs/planner.md, "GPU profiles").
# Bandwidths are what NCCL reaches, not the line rate: NVLink 4 moves 450 GB/s each way, NCCL's
# ring collectives about 370 GB/s of it (NVIDIA's NCCL maintainers, nccl-tests#212, NCCL#1442;
# all-reduce with NVLink SHARP reaches ~480: Azure ND H100 v5 nccl-tests, 478.87 GB/s at 8 GB);
# NVLink 3 (A100) 300 -> ~235. One NIC per GPU: 400 Gb/s NDR gives ~48 GB/s (nccl-tests#319:
# "around 48GB/s from each CX7 NIC"), 200 Gb/s HDR ~23.
# Measured on one H200 by bench/gpu.py's sweep (2026-12-04, torch 2.11.0+cu130; docs/benchmarks.md),
# and carried to the other GPUs as shares of their own bandwidths where they are rates:
#   fused AdamW streams 28 bytes an element at 3,460 GB/s, 0.72 of the 4,800 datasheet (mem_bw_gbps);
#   a LayerNorm forward + backward, a bias gradient's sum, fp32 gradient accumulation and the chunked
#   loss at a median 2,670 GB/s over the bytes the planner counts, 0.63 of a copy's 4,220
#   (reduction_bw_gbps);
#   the host's launches and Python per eager layer pass (forward + backward) of threefold's model,
#   2,550 us, exposed only where a layer's device time is shorter (layer_overhead_us).
ADAM_SHARE, REDUCTION_SHARE = 0.72, 0.63
_GPU_COMMON = dict(
    reserved_gib=3.0,
    intra_latency_us=5.0,
    inter_latency_us=10.0,
    collective_overhead_us=10.0,
    layer_overhead_us=2550.0,
    step_overhead_s=0.01,
    overlap="modelled",
    # Compute beside an overlapped collective runs 18.9% slower on average (arXiv 2507.03114,
    # H100, A100, MI250, MI210; up to 40%): NCCL's kernels take SMs and memory bandwidth.
    overlap_slowdown=0.19,
    devices_per_node=8,
    # Beyond wave quantization (sm_count), a GEMM whose smallest side is 32 runs at half its
    # large-shape rate: too few k steps to fill the tensor-core pipeline, too little reuse per byte.
    gemm_half_dim=32.0,
)
# FlashAttention-2 (PyTorch's SDPA flash kernel) on an H100 SXM5, forward + backward, causal,
# head dim 128: 163, 221, 265, 294, 308, 328 TFLOP/s at 512 .. 16k tokens (the flash-attention
# repository's flash2_h100_fwd_bwd_benchmark.png): ~35% of peak, half of that near 800 tokens.
_HOPPER_ATTENTION = dict(attention_efficiency=0.35, attention_half_seq=800.0)
PROFILES: dict[str, dict[str, Any]] = {
    "a100-40gb": dict(
        _GPU_COMMON,
        peak_name="NVIDIA A100-SXM4-40GB",
        memory_gib=40.0,
        mem_bw_gbps=1555.0 * ADAM_SHARE,
        elementwise_bw_gbps=1400.0,  # ~90% of the datasheet: what element-wise kernels stream
        reduction_bw_gbps=1400.0 * REDUCTION_SHARE,
        intra_bw_gbps=235.0,
        inter_bw_gbps=23.0,
        compute_efficiency=0.7,  # the earlier prior (docs/planner.md: the 2021 A100 table within 13%)
        sm_count=108,
        # FlashAttention-2 on A100, forward + backward: ~60% of peak at long sequences (its paper).
        attention_efficiency=0.6,
        attention_half_seq=800.0,
    ),
    "a100-80gb": dict(
        _GPU_COMMON,
        peak_name="NVIDIA A100-SXM4-80GB",
        memory_gib=80.0,
        mem_bw_gbps=2039.0 * ADAM_SHARE,
        elementwise_bw_gbps=1800.0,  # ~90% of the datasheet: what element-wise kernels stream
        reduction_bw_gbps=1800.0 * REDUCTION_SHARE,
        intra_bw_gbps=235.0,
        inter_bw_gbps=23.0,
        compute_efficiency=0.7,
        sm_count=108,
        attention_efficiency=0.6,
        attention_half_seq=800.0,
    ),
    # Large bf16 GEMMs on an H100 SXM: cuBLAS 797.8 TFLOP/s at 8192^3 (pranjalssh/fast.cu), the
    # best torch.matmul shape 794.5 (80.3%, stas00/ml-engineering's MAMF table); with the 8192^3
    # shape's factors (1.035) the large-shape rate is 0.83. Element-wise: Azure ND H100 v5 STREAM copy 2.90 TB/s.
    "h100": dict(
        _GPU_COMMON,
        **_HOPPER_ATTENTION,
        peak_name="NVIDIA H100 80GB HBM3",
        memory_gib=80.0,
        mem_bw_gbps=3350.0 * ADAM_SHARE,
        elementwise_bw_gbps=2900.0,
        reduction_bw_gbps=2900.0 * REDUCTION_SHARE,
        intra_bw_gbps=370.0,
        inter_bw_gbps=48.0,
        compute_efficiency=0.83,
        sm_count=132,
    ),
    # The same GH100 compute at 700 W with faster memory: an 8192^3 bf16 GEMM at 769-798 TFLOP/s
    # and element-wise work at ~4.3 TB/s, both measured through PyTorch on an H200 (issue 36).
    "h200": dict(
        _GPU_COMMON,
        **_HOPPER_ATTENTION,
        peak_name="NVIDIA H200",
        memory_gib=140.0,
        mem_bw_gbps=3460.0,
        elementwise_bw_gbps=4300.0,
        reduction_bw_gbps=2670.0,
        intra_bw_gbps=370.0,
        inter_bw_gbps=48.0,
        compute_efficiency=0.82,
        sm_count=132,
    ),
    # CPU: the peak is measured (observe.peak, one thread per process), memory is the host's
    # RAM shared by the processes, and gloo over shared memory/loopback is the "link". Latency
    # and call cost are bench/ring_latency.py's on 2 cores with 4 ranks computing 20 ms between
    # calls (medians of three runs; 1.2-1.7 ms per ring step, 2.4-4.6 ms per call): with more
    # ranks than cores a ring step waits for the peer to get a core back, which dwarfs the
    # wire; one process per core pays far less, and calibration refits both. Between CPU nodes
    # (not measured) the same wait is assumed, the scheduler's share dwarfing a LAN hop.
    "cpu": dict(
        peak_name="cpu",
        reserved_gib=0.5,
        # What the optimizer phase streams at on one core: 7.5 GB/s over the 36 bytes an fp32
        # element planner/cost.py counts (norm, update, zero_grad) is the 5 GB/s over 24 bytes the
        # earlier count was calibrated with (the foreach update moves more; calibration refits it).
        mem_bw_gbps=7.5,
        intra_bw_gbps=1.0,
        inter_bw_gbps=0.1,
        intra_latency_us=1400.0,
        inter_latency_us=1400.0,
        collective_overhead_us=3700.0,
        compute_efficiency=0.5,
        gemm_half_dim=16.0,  # one core's blocked matmul saturates early
        # one thread's eager element-wise ops on activations that small micro-batches keep in cache
        elementwise_bw_gbps=20.0,
        reduction_bw_gbps=20.0,  # the same core: norms and sums as the element-wise ops
        layer_overhead_us=1000.0,
        step_overhead_s=0.01,
        sm_count=0,
        attention_efficiency=0.0,
        attention_half_seq=0.0,
        overlap_slowdown=0.0,
        overlap="none",  # gloo's transfers run on the cores the compute needs (docs/planner.md)
        core_share_exponent=1.3,
    ),
}
ALIASES = {
    "a100": "a100-80gb",
    "a100-80g": "a100-80gb",
    "a100-40g": "a100-40gb",
    "h100-sxm": "h100",
    "h100-80gb": "h100",
    "h200-sxm": "h200",
}
