"""planner/kernel_fit.py: kernel knobs fitted from a sweep's points recover the knobs that made
them, on the planner's own terms (kernels.py)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest

from threefold.planner import build_cluster
from threefold.planner.kernel_fit import (
    AdamPoint,
    AttentionPoint,
    CopyPoint,
    GemmPoint,
    HostPoint,
    ReductionPoint,
    attention_flops_fwd_bwd,
    fit_kernels,
)
from threefold.planner.kernels import attention_factor, shape_factor

TRUE = {"compute_efficiency": 0.74, "gemm_half_dim": 48.0, "attention_efficiency": 0.42, "attention_half_seq": 1300.0}
SHAPES = [(m, n, k) for m in (128, 512, 2048, 8192) for n, k in ((4096, 4096), (1024, 8192), (16384, 4096))]
PROBLEMS = [(seq, hd) for seq in (512, 1024, 4096, 8192) for hd in (64, 128)]


def _noise(i: int) -> float:
    """A fixed +-1.5% wobble, so the fit works on points that do not lie on its curve."""
    return 1.0 + 0.015 * math.sin(3.7 * i)


def _points(base):
    true = dataclasses.replace(base, **TRUE)
    rate = true.peak_flops * true.compute_efficiency
    gemms = [
        GemmPoint(m, n, k, 2.0 * m * n * k * shape_factor(m, n, k, true) / rate * _noise(i))
        for i, (m, n, k) in enumerate(SHAPES)
    ]
    attention = []
    for i, (seq, hd) in enumerate(PROBLEMS):
        heads, batch = 2048 // hd, 16384 // seq
        p = AttentionPoint(batch, heads, seq, hd, 0.0)
        cfg = SimpleNamespace(seq_len=seq, hidden=heads * hd, heads=heads)
        t = attention_flops_fwd_bwd(p) * attention_factor(cfg, true) / rate * _noise(i + 50)
        attention.append(dataclasses.replace(p, seconds=t))
    copies = [CopyPoint(2e9, 2e9 / 4.1e12 * _noise(i + 99)) for i in range(3)]
    adam = [AdamPoint(1 << 27, 28 * (1 << 27) / 3.3e12 * _noise(i + 7)) for i in range(2)]
    kinds = ("norm", "bias_grad", "accumulate", "loss")
    reductions = [ReductionPoint(kind, 4e8, 4e8 / 2.6e12 * _noise(i + 20)) for i, kind in enumerate(kinds)]
    host = [HostPoint(2, 6, 0.008, 0.008 + 4 * 2.5e-3)]
    return gemms, attention, copies, adam, reductions, host


def test_a_sweep_recovers_the_knobs_that_made_it():
    base = build_cluster({"device": "h200"})
    fit = fit_kernels(base, *_points(base))
    knobs = fit.knobs
    assert knobs["gemm_half_dim"] == TRUE["gemm_half_dim"] and knobs["attention_half_seq"] == TRUE["attention_half_seq"]
    assert knobs["compute_efficiency"] == pytest.approx(TRUE["compute_efficiency"], rel=0.02)
    assert knobs["attention_efficiency"] == pytest.approx(TRUE["attention_efficiency"], rel=0.02)
    assert knobs["elementwise_bw_gbps"] == pytest.approx(4100, rel=0.02)
    assert knobs["mem_bw_gbps"] == pytest.approx(3300, rel=0.02)  # fused AdamW's 28 bytes an element
    assert knobs["reduction_bw_gbps"] == pytest.approx(2600, rel=0.02)
    assert knobs["layer_overhead_us"] == pytest.approx(2500)  # 10 ms more for 4 more layers
    assert knobs["peak_tflops"] == base.peak_tflops
    assert all(0 < sigma < 0.02 for sigma in fit.log_sigma.values()), fit.log_sigma
    assert fit.points == {
        "gemm": len(SHAPES),
        "attention": len(PROBLEMS),
        "copy": 3,
        "adam": 2,
        "reduction": 4,
        "host": 1,
    }


def test_gemms_faster_than_the_peak_raise_it_and_a_missing_kind_keeps_the_profile():
    base = build_cluster({"device": "h200"})
    gemms = _points(base)[0]
    fast = [dataclasses.replace(g, seconds=g.seconds * 0.5) for g in gemms]  # 1.48 of peak
    fit = fit_kernels(base, fast, [], [])
    assert fit.knobs["compute_efficiency"] == 1.0
    assert fit.knobs["peak_tflops"] == pytest.approx(base.peak_tflops * 2 * TRUE["compute_efficiency"], rel=0.02)
    assert set(fit.knobs) == {"compute_efficiency", "gemm_half_dim", "peak_tflops"}
    fitted = fit.cluster(base)
    assert fitted.attention_efficiency == base.attention_efficiency and fitted.compute_efficiency == 1.0
