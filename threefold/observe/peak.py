"""Dense peak FLOP/s of one device in the training dtype: MFU's denominator.

CUDA parts come from a table of datasheet numbers, dense (no 2:4 sparsity), tensor-core
rates with fp32 accumulation. A part or dtype the table does not know gives None and one
warning: an MFU against a guessed peak is worse than no MFU. A CPU has no datasheet we can
trust (clocks, AVX-512/AMX, thread count), so its peak is measured once by a matmul
micro-benchmark and cached on disk.
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from pathlib import Path

import torch

from threefold.atomic import atomic_write
from threefold.observe.host import cpu_model

T = 1e12
# (regex on torch.cuda.get_device_name(), {dtype key: dense FLOP/s}); first match wins,
# so specific variants come before their family. An empty dict marks a part we know we
# do not know (e.g. NVL variants), so it is not caught by a broader family pattern.
_CUDA_PEAKS: list[tuple[str, dict[str, float]]] = [
    # A100 datasheet: all SXM/PCIe, 40/80 GB variants share the tensor-core rates.
    (r"A100", {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T}),
    # H100 datasheet. "NVIDIA H100 80GB HBM3" is the SXM5 part.
    (r"H100 NVL", {"bf16": 835 * T, "fp16": 835 * T}),
    (r"H100 PCIe", {"bf16": 756 * T, "fp16": 756 * T, "tf32": 378 * T, "fp32": 51 * T}),
    (r"H100.*(SXM|HBM3)", {"bf16": 989 * T, "fp16": 989 * T, "tf32": 494.7 * T, "fp32": 67 * T}),
    # H200 (SXM) has the H100 SXM compute with more memory; the NVL part is clocked lower.
    (r"H200 NVL", {}),
    (r"H200", {"bf16": 989 * T, "fp16": 989 * T, "tf32": 494.7 * T, "fp32": 67 * T}),
    # H800 (SXM): H100 SXM tensor-core rates (export variant cuts NVLink and FP64).
    (r"H800 PCIe", {}),
    (r"H800", {"bf16": 989 * T, "fp16": 989 * T, "tf32": 494.7 * T}),
    # A10 datasheet. The AWS A10G is a different SKU with no NVIDIA datasheet: unknown.
    (r"\bA10\b", {"bf16": 125 * T, "fp16": 125 * T, "tf32": 62.5 * T, "fp32": 31.2 * T}),
    (r"\bL4\b", {"bf16": 121 * T, "fp16": 121 * T, "tf32": 60 * T, "fp32": 30.3 * T}),
    (r"L40S", {"bf16": 362 * T, "fp16": 362 * T, "tf32": 183 * T, "fp32": 91.6 * T}),
    # V100 has fp16 tensor cores only: bf16 runs without them, so no bf16 peak.
    (r"V100S", {"fp16": 130 * T, "fp32": 16.4 * T}),
    (r"V100-PCIE", {"fp16": 112 * T, "fp32": 14 * T}),
    (r"V100-SXM2", {"fp16": 125 * T, "fp32": 15.7 * T}),
    # Ada whitepaper: 165.2 with fp32 accumulate (torch's); 330 is fp16-accumulate.
    (r"RTX 4090", {"bf16": 165.2 * T, "fp16": 165.2 * T, "tf32": 82.6 * T, "fp32": 82.6 * T}),
]

_DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_warned: set[tuple[str, str]] = set()


def _warn_once(name: str, dtype: torch.dtype, why: str) -> None:
    key = (name, str(dtype))
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"no dense peak FLOP/s for {name!r} in {dtype} ({why}); MFU will be null", stacklevel=3)


def _fp32_matmul_key() -> str:
    # With TF32 allowed, fp32 matmuls run on tensor cores: the TF32 rate is the honest peak.
    if torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def cuda_peak_flops(name: str, dtype: torch.dtype) -> float | None:
    """Table lookup by device name; None (and one warning) when the part or dtype is unknown."""
    key = _DTYPE_KEYS.get(dtype)
    if key == "fp32":
        key = _fp32_matmul_key()
    for pattern, peaks in _CUDA_PEAKS:
        if re.search(pattern, name):
            if key in peaks:
                return peaks[key]
            _warn_once(name, dtype, "dtype not in the peak table for this part")
            return None
    _warn_once(name, dtype, "device not in the peak table")
    return None


def _measure_cpu_peak(dtype: torch.dtype, budget_s: float = 0.35) -> float:
    """Best FLOP/s of square matmuls in `dtype` within `budget_s`, in the current thread count.

    Starts at 128 and doubles the size (up to 1024) while the next size is predicted to take
    under ~40 ms at the best rate so far: bf16/fp16 CPU matmuls can be 50x slower than fp32.
    Re-deciding after every run lets a slow start (a thread pool waking up, a busy
    neighbour) recover instead of pinning the benchmark to a tiny, overhead-bound size.
    """

    def rate(n: int) -> float:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        t0 = time.perf_counter()
        torch.mm(a, b)
        return 2 * n**3 / max(time.perf_counter() - t0, 1e-9)

    start, best, n = time.perf_counter(), 0.0, 128
    with torch.no_grad():
        rate(n)  # warm up the kernels and the thread pool
        while True:
            best = max(best, rate(n))
            if time.perf_counter() - start > budget_s:
                return best
            if n < 1024 and 2 * (2 * n) ** 3 / best < 0.04:
                n *= 2


def _cache_path(cache_dir: str) -> Path:
    root = cache_dir or os.environ.get("THREEFOLD_CACHE") or "~/.cache/threefold"
    return Path(root).expanduser() / "cpu_peak_flops.json"


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, data: dict) -> None:
    # Replaced atomically: concurrent ranks never see half a file.
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(data, indent=1, sort_keys=True))


def cpu_peak_flops(dtype: torch.dtype, threads: int | None = None, cache_dir: str = "") -> float:
    """Measured CPU matmul FLOP/s, cached per (cpu model, torch version, dtype, threads)."""
    threads = threads or torch.get_num_threads()
    key = f"{cpu_model()}|torch {torch.__version__}|{dtype}|threads {threads}"
    path = _cache_path(cache_dir)
    cached = _read_cache(path)
    if isinstance(cached.get(key), (int, float)) and cached[key] > 0:
        return float(cached[key])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        peak = _measure_cpu_peak(dtype)
    finally:
        torch.set_num_threads(before)
    if dtype != torch.float32:
        # CPU bf16/fp16 kernels often convert to fp32 inside, and small-size probes of them
        # under-read the rate; a peak below the fp32 one would inflate MFU past 100%.
        peak = max(peak, cpu_peak_flops(torch.float32, threads, cache_dir))
    try:
        cached = _read_cache(path)  # another rank may have written meanwhile
        cached[key] = peak
        _write_cache(path, cached)
    except OSError as err:
        warnings.warn(f"could not cache the CPU peak in {path}: {err}", stacklevel=2)
    return peak


def device_peak_flops(
    device: torch.device | str, dtype: torch.dtype, threads: int | None = None, cache_dir: str = ""
) -> float | None:
    """Dense peak FLOP/s of `device` in `dtype`, or None when it is not known.

    cuda: datasheet table by device name. cpu: measured once with `threads` torch threads
    (default: the current count) and cached in cache_dir ("" -> $THREEFOLD_CACHE or
    ~/.cache/threefold). Anything else: None with a warning.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return cuda_peak_flops(torch.cuda.get_device_name(device), dtype)
    if device.type == "cpu":
        return cpu_peak_flops(dtype, threads, cache_dir)
    _warn_once(device.type, dtype, "no peak source for this device type")
    return None


def mfu(model_flops_per_s_per_device: float, peak: float | None) -> float | None:
    """Model FLOPs utilization: achieved model FLOP/s of one device / its dense peak."""
    if peak is None or peak <= 0:
        return None
    return model_flops_per_s_per_device / peak
