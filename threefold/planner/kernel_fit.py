"""A device's kernel rates fitted from a measured sweep: the [cluster] knobs of planner/kernels.py.

`bench/gpu.py` (its sweep phase, bench/kernel_sweep.py) times a few dozen GEMMs, causal fused
attention forward + backward at several sequence lengths and head dims, and a large copy, on
one device. This module turns those points into the cluster's knobs, each with the spread of
its residuals:

- **GEMMs**: `compute_efficiency`, `gemm_half_dim` and `peak_tflops` (the profile's, unless the
  GEMMs beat it). The planner's time for an (m, n, k) GEMM
  is 2 m n k x shape_factor(m, n, k) / (peak x compute_efficiency), shape_factor carrying the
  profile's `sm_count` waves; for each gemm_half_dim on a grid, the efficiency that best fits in
  log space is the geometric mean of predicted-at-peak over measured, and the grid point with the
  least squared log residual wins.
- **Attention**: `attention_efficiency` and `attention_half_seq`, the same way, with the planner's
  causal attention FLOPs (3 x the forward's 2 s^2 h / 2: backward twice the forward) and its head
  dim factor.
- **Element-wise**: `elementwise_bw_gbps`, the median of bytes read and written over seconds.
- **Normalisation and reductions**: `reduction_bw_gbps`, the median rate of a LayerNorm forward
  + backward, a bias gradient's sum, the fp32 gradient accumulation and the chunked loss, each
  over the bytes the planner counts for it.
- **Host time per layer pass**: `layer_overhead_us`, from a small eager model at two depths
  (CUDA; what the device waits through when a layer's kernels are shorter than their launches).
- **The optimizer's update**: `mem_bw_gbps`, the bandwidth torch's fused AdamW streams its
  state at (it reads parameters, gradients and both moments and writes three of them back: 28
  bytes an element in fp32), which planner/cost.py charges the update's bytes at.

The knobs come out on the planner's own terms, so `threefold plan --cluster.profile FILE` predicts
with what the device did rather than with a datasheet.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from types import SimpleNamespace

from threefold.planner.cluster import Cluster
from threefold.planner.kernels import ADAM_BYTES_PER_ELEMENT, attention_factor, shape_factor

HALF_DIM_GRID = (0.0, 8.0, 16.0, 24.0, 32.0, 48.0, 64.0, 96.0, 128.0, 192.0, 256.0)
HALF_SEQ_GRID = (0.0, 100.0, 200.0, 300.0, 400.0, 600.0, 800.0, 1000.0, 1300.0, 1600.0, 2000.0, 3000.0, 4000.0)


@dataclass(frozen=True)
class GemmPoint:
    m: int
    n: int
    k: int
    seconds: float


@dataclass(frozen=True)
class AttentionPoint:
    """Causal attention forward + backward of `batch` x `heads` heads of `head_dim` over `seq` tokens."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    seconds: float


@dataclass(frozen=True)
class CopyPoint:
    bytes_moved: float
    """Bytes read plus bytes written."""
    seconds: float


@dataclass(frozen=True)
class AdamPoint:
    """torch's fused AdamW over `numel` fp32 elements of parameters, gradients and moments."""

    numel: int
    seconds: float

    @property
    def bytes_moved(self) -> float:
        return ADAM_BYTES_PER_ELEMENT * self.numel


@dataclass(frozen=True)
class ReductionPoint:
    """A normalisation, reduction or mixed-dtype kernel ("norm", "bias_grad", "accumulate",
    "loss") with the bytes planner/kernels.py counts for it."""

    kind: str
    bytes_moved: float
    seconds: float


@dataclass(frozen=True)
class HostPoint:
    """Seconds per forward + backward of a small eager model at two layer counts: the host's
    time per layer pass is the difference over the layers between them."""

    layers_a: int
    layers_b: int
    seconds_a: float
    seconds_b: float

    @property
    def per_layer_us(self) -> float:
        return (self.seconds_b - self.seconds_a) / (self.layers_b - self.layers_a) * 1e6


@dataclass(frozen=True)
class LaunchPoint:
    """One tiny kernel: back to back on the device's queue, and the host's launch call alone.
    Recorded with the sweep (what a layer's many small kernels cost when the host cannot run
    ahead); no knob is fitted to it."""

    stream_s: float
    host_s: float


@dataclass(frozen=True)
class KernelFit:
    knobs: dict[str, float]
    """The fitted [cluster] keys."""
    log_sigma: dict[str, float]
    """Per kind ("gemm", "attention", "copy"): the residuals' RMS in log space."""
    points: dict[str, int]

    def cluster(self, base: Cluster) -> Cluster:
        return dataclasses.replace(base, **self.knobs)


def _best_on_grid(grid, predicted_at_peak) -> tuple[float, float, float]:
    """(grid value, efficiency, log RMS) minimising the log residuals: predicted_at_peak(value)
    is the list of (seconds at 100% of peak, measured seconds) pairs."""
    best = None
    for value in grid:
        pairs = predicted_at_peak(value)
        logs = [math.log(at_peak / measured) for at_peak, measured in pairs]
        log_eff = statistics.fmean(logs)
        rms = math.sqrt(statistics.fmean([(x - log_eff) ** 2 for x in logs]))
        if best is None or rms < best[2] - 1e-12:
            best = (value, math.exp(log_eff), rms)
    return best


def fit_gemms(points: list[GemmPoint], base: Cluster) -> tuple[float, float, float]:
    """(compute_efficiency, gemm_half_dim, log RMS) of the GEMM points on `base`'s peak and SMs."""

    def at_peak(half_dim: float):
        shaped = dataclasses.replace(base, gemm_half_dim=half_dim)
        return [
            (2.0 * p.m * p.n * p.k * shape_factor(p.m, p.n, p.k, shaped) / base.peak_flops, p.seconds) for p in points
        ]

    half_dim, efficiency, rms = _best_on_grid(HALF_DIM_GRID, at_peak)
    return efficiency, half_dim, rms


def attention_flops_fwd_bwd(p: AttentionPoint) -> float:
    """The planner's count (kernels.attention_flops): causal QK^T and PV, backward twice forward."""
    return 3.0 * p.batch * p.seq * 2.0 * p.seq * p.heads * p.head_dim


def fit_attention(points: list[AttentionPoint], base: Cluster) -> tuple[float, float, float]:
    """(attention_efficiency, attention_half_seq, log RMS): the fused kernel's rate at head dim
    128 and long sequences, and the sequence length at which it halves."""

    def at_peak(half_seq: float):
        pairs = []
        for p in points:
            cfg = SimpleNamespace(seq_len=p.seq, hidden=p.heads * p.head_dim, heads=p.heads)
            # At attention_efficiency == compute_efficiency the factor is the shape part alone.
            probe = dataclasses.replace(base, attention_efficiency=base.compute_efficiency, attention_half_seq=half_seq)
            shape = attention_factor(cfg, probe)
            pairs.append((attention_flops_fwd_bwd(p) * shape / base.peak_flops, p.seconds))
        return pairs

    half_seq, efficiency, rms = _best_on_grid(HALF_SEQ_GRID, at_peak)
    return efficiency, half_seq, rms


def fit_copies(points: list[CopyPoint] | list[AdamPoint] | list[ReductionPoint]) -> tuple[float, float]:
    """(GB/s, log RMS around the median) of points that move `bytes_moved` each."""
    rates = [p.bytes_moved / p.seconds for p in points]
    median = statistics.median(rates)
    return median / 1e9, math.sqrt(statistics.fmean([math.log(r / median) ** 2 for r in rates]))


def fit_kernels(
    base: Cluster,
    gemms: list[GemmPoint],
    attention: list[AttentionPoint],
    copies: list[CopyPoint],
    adam: list[AdamPoint] = (),
    reductions: list[ReductionPoint] = (),
    host: list[HostPoint] = (),
) -> KernelFit:
    """Every knob the points can set; a kind without points keeps the profile's value."""
    knobs: dict[str, float] = {}
    sigma: dict[str, float] = {}
    if gemms:
        efficiency, knobs["gemm_half_dim"], sigma["gemm"] = fit_gemms(gemms, base)
        # GEMMs that beat the profile's peak (cpu: itself a measurement, maybe on a busier host)
        # make the peak what they reached.
        knobs["peak_tflops"] = base.peak_tflops * max(1.0, efficiency)
        knobs["compute_efficiency"] = min(1.0, efficiency)
    if attention:
        shaped = dataclasses.replace(base, **knobs)
        knobs["attention_efficiency"], knobs["attention_half_seq"], sigma["attention"] = fit_attention(
            attention, shaped
        )
    if copies:
        knobs["elementwise_bw_gbps"], sigma["copy"] = fit_copies(copies)
    if adam:
        knobs["mem_bw_gbps"], sigma["adam"] = fit_copies(adam)
    if reductions:
        knobs["reduction_bw_gbps"], sigma["reduction"] = fit_copies(reductions)
    if host:
        knobs["layer_overhead_us"] = max(0.0, statistics.median(p.per_layer_us for p in host))
    counts = {"gemm": len(gemms), "attention": len(attention), "copy": len(copies), "adam": len(adam)}
    counts |= {"reduction": len(reductions), "host": len(host)}
    return KernelFit(knobs, sigma, counts)
