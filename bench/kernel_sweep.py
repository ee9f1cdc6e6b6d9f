"""bench/gpu.py's sweep phase: time GEMMs, fused causal attention and a copy on one device, fit
the planner's kernel knobs to them (threefold/planner/kernel_fit.py) and write a [cluster]
profile that `threefold plan --cluster.profile FILE` takes.

CUDA, bf16: 24 GEMMs, m from 256 to 16384 tokens against the n x k shapes of a layer's
projections and their tensor-parallel shards (n from 128 to 16384, k 4096 to 16384), each the
best of 5 timed runs after 2 warm-ups on CUDA events; SDPA causal forward + backward at 512 to
8192 tokens and head dims 64 and 128 (8 problems of 16,384 tokens, width 2048), best of 3;
a 1 GiB device-to-device copy, best of 3.
~20 s on an H200. CPU (--tiny, tests): fp32 GEMMs of 32 to 256 and a 64 MiB copy, no attention
(the cpu profile prices attention as a GEMM; its calibrated knobs stay the profile's).
"""

from __future__ import annotations

import time
from pathlib import Path

CUDA_GEMMS = [(m, n, k) for m in (256, 1024, 4096, 16384) for n, k in ((4096, 4096), (16384, 4096), (4096, 16384))]
CUDA_GEMMS += [(m, n, k) for m in (512, 2048, 8192) for n, k in ((1024, 4096), (2048, 8192), (8192, 8192))]
CUDA_GEMMS += [(8192, 8192, 8192), (2048, 512, 4096), (4096, 128, 4096)]
CUDA_ATTENTION = [(seq, hd) for seq in (512, 1024, 4096, 8192) for hd in (64, 128)]
CPU_GEMMS = [(m, n, k) for m in (32, 128, 256) for n, k in ((64, 64), (256, 256), (256, 64))]
ATTENTION_TOKENS = 16384  # batch x seq per attention problem: the same work per point
ATTENTION_WIDTH = 2048  # heads x head_dim


def _timer(device):
    """seconds(fn): the best of `repeats` runs after `warmup`, on CUDA events or the host clock."""
    import torch

    def seconds(fn, repeats: int = 5, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        best = float("inf")
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
        return best

    return seconds


def measure(device_name: str) -> dict[str, list]:
    """{"gemm": [GemmPoint], "attention": [AttentionPoint], "copy": [CopyPoint]} on the device."""
    import torch

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    seconds = _timer(device)
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)  # a cpu "device" is one core (the profile's peak is one thread's)
    try:
        return _measure(device, dtype, seconds)
    finally:
        torch.set_num_threads(threads)


def _gemm_seconds(seconds, device, dtype, m: int, n: int, k: int) -> float:
    import torch

    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    return seconds(lambda: torch.mm(a, b))


def _attention_seconds(seconds, device, dtype, batch: int, heads: int, seq: int, hd: int) -> float:
    """Causal SDPA forward and backward (threefold's attention core's call)."""
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.randn(batch, heads, seq, hd, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(batch, heads, seq, hd, device=device, dtype=dtype)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    return seconds(step, repeats=3)


def _measure(device, dtype, seconds) -> dict[str, list]:
    import torch

    from threefold.planner.kernel_fit import AttentionPoint, CopyPoint, GemmPoint

    cuda = device.type == "cuda"
    gemms = [
        GemmPoint(m, n, k, _gemm_seconds(seconds, device, dtype, m, n, k))
        for m, n, k in (CUDA_GEMMS if cuda else CPU_GEMMS)
    ]
    attention = []
    for seq, hd in CUDA_ATTENTION if cuda else []:
        heads, batch = ATTENTION_WIDTH // hd, max(1, ATTENTION_TOKENS // seq)
        took = _attention_seconds(seconds, device, dtype, batch, heads, seq, hd)
        attention.append(AttentionPoint(batch, heads, seq, hd, took))
    nbytes = (1 << 30) if cuda else (64 << 20)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    copies = [CopyPoint(2.0 * nbytes, seconds(lambda: dst.copy_(src), repeats=3))]
    return {"gemm": gemms, "attention": attention, "copy": copies}


def profile_for(device_name: str) -> str:
    """The planner profile whose datasheet the device is (by name; cpu for the host)."""
    from threefold.planner.cluster import PROFILES

    if device_name == "cpu":
        return "cpu"
    for name, prof in PROFILES.items():
        if prof["peak_name"] == device_name:
            return name
    known = ", ".join(f"{p['peak_name']} ({n})" for n, p in PROFILES.items() if n != "cpu")
    raise ValueError(f"no planner profile for {device_name!r} to fit onto (profiles: {known})")


def sweep(device: str, device_name: str, profile_path: Path, emit) -> dict:
    """Measure, fit, write the profile; one row per fitted knob. Returns the fit as JSON-able."""
    from threefold.atomic import atomic_write
    from threefold.planner import build_cluster
    from threefold.planner.cluster import profile_toml
    from threefold.planner.kernel_fit import fit_kernels

    base = build_cluster({"device": profile_for(device_name)})
    points = measure(device)
    fit = fit_kernels(base, points["gemm"], points["attention"], points["copy"])
    for key, value in fit.knobs.items():
        emit({"check": f"sweep fit {key}", "key": f"sweep.{key}", "value": value, "tolerance": None, "ok": True})
    comment = (
        f"Kernel rates of {device_name} measured by bench/gpu.py's sweep (bench/kernel_sweep.py), "
        f"fitted by threefold/planner/kernel_fit.py:\n{', '.join(f'{k} = {v:.4g}' for k, v in fit.knobs.items())}; "
        f"log-space residual RMS {', '.join(f'{k} {v:.3f}' for k, v in fit.log_sigma.items())}.\n"
        "Set nodes and devices_per_node for the cluster: --cluster.nodes N."
    )
    profile_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(profile_path, profile_toml(fit.cluster(base), comment))
    return {
        "profile": str(profile_path),
        "base": base.device,
        "knobs": fit.knobs,
        "log_sigma": fit.log_sigma,
        "points": {kind: [vars(p) for p in pts] for kind, pts in points.items()},
    }
