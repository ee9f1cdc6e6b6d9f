"""bench/gpu.py's sweep phase: time GEMMs, fused causal attention, a copy and the fused AdamW
kernel on one device, fit the planner's kernel knobs to them (threefold/planner/kernel_fit.py)
and write a [cluster] profile that `threefold plan --cluster.profile FILE` takes.

CUDA, bf16: 24 GEMMs, m from 256 to 16384 tokens against the n x k shapes of a layer's
projections and their tensor-parallel shards (n from 128 to 16384, k 4096 to 16384); SDPA causal
forward + backward at 512 to 8192 tokens and head dims 64 and 128 (8 problems of 16,384 tokens,
width 2048); a 1 GiB device-to-device copy; torch's fused AdamW over 2^27 fp32 elements (the
optimizer step's kernel); and the launch cost of an empty-sized kernel, on the device and on
the host. Each point is the least over 3-5 timed rounds of the mean of back-to-back calls
(enough to run ~2 ms between two CUDA events): a single call between two events also times the
host's launch latency, which a training step hides by queueing ahead (a 4096 x 128 x 4096 GEMM
read 33 us that way on an H200). The GPU's clocks are brought up first with ~0.3 s of large
GEMMs (the idle SM clock reads 345 MHz).
~20 s on an H200. CPU (--tiny, tests): fp32 GEMMs of 32 to 256, a 64 MiB copy, AdamW over 2^20
elements, no attention (the cpu profile prices attention as a GEMM; its calibrated knobs stay
the profile's).
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


BLOCK_S = 2e-3  # back-to-back calls between two events: long enough that one launch's latency is noise
ADAM_NUMEL = {"cuda": 1 << 27, "cpu": 1 << 20}  # fp32 elements of each of the four AdamW tensors
LAUNCHES = 500  # tiny kernels timed back to back for the launch cost


def _elapsed(device, fn, calls: int) -> float:
    """Seconds of `calls` back-to-back calls: CUDA events around them, or the host clock."""
    import torch

    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - t0


def _timer(device):
    """seconds(fn): after `warmup` calls, the least over `repeats` rounds of the mean time of
    back-to-back calls, as many as run about BLOCK_S."""

    def seconds(fn, repeats: int = 5, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        one = _elapsed(device, fn, 1)
        calls = max(1, min(1000, int(BLOCK_S / max(one, 1e-7))))
        return min(_elapsed(device, fn, calls) / calls for _ in range(repeats))

    return seconds


def _warm_clocks(device, seconds_wanted: float = 0.3) -> None:
    """Large GEMMs until the SM clock is up (an idle H200 reads 345 MHz, 1980 under load)."""
    import torch

    if device.type != "cuda":
        return
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds_wanted:
        for _ in range(20):
            torch.mm(a, a)
        torch.cuda.synchronize(device)


def measure(device_name: str) -> dict[str, list]:
    """{"gemm": [GemmPoint], "attention": [AttentionPoint], "copy": [CopyPoint], "adam":
    [AdamPoint], "launch": [LaunchPoint]} on the device."""
    import torch

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    seconds = _timer(device)
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)  # a cpu "device" is one core (the profile's peak is one thread's)
    try:
        _warm_clocks(device)
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


def _adam_seconds(seconds, device, numel: int) -> float:
    """torch's fused AdamW (the engine's update on CUDA) over fp32 parameters, gradients and
    moments of `numel` elements: it reads four and writes three (28 bytes an element)."""
    import torch

    p, g, m = (torch.randn(numel, device=device) for _ in range(3))
    v = torch.rand(numel, device=device)
    step = torch.ones((), device=device)

    def update():
        torch._fused_adamw_(
            [p], [g], [m], [v], [], [step], lr=1e-5, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8,
            amsgrad=False, maximize=False,
        )  # fmt: skip

    return seconds(update, repeats=3)


REDUCTION_TOKENS, REDUCTION_WIDTH, LOSS_VOCAB = {"cuda": 16384, "cpu": 256}, {"cuda": 2048, "cpu": 256}, 50304


def _reduction_points(device, dtype, seconds) -> list:
    """Normalisation and reduction kernels as a layer and its loss run them, each with the bytes
    the planner counts for it (planner/kernels.py): a LayerNorm forward + backward (one norm's 3 x
    2h elements a token), a bias gradient's sum over the tokens (the output gradient read),
    a micro-batch's bf16 gradients added into fp32 buffers (10 bytes an element) and threefold's
    chunked cross-entropy forward + backward (LOSS_BYTES_PER_LOGIT a logit)."""
    import torch
    import torch.nn.functional as F

    from threefold.model.loss import chunked_cross_entropy_sum
    from threefold.planner.kernel_fit import ReductionPoint
    from threefold.planner.kernels import BACKWARD_TRAFFIC, LOSS_BYTES_PER_LOGIT

    tokens, h = REDUCTION_TOKENS[device.type], REDUCTION_WIDTH[device.type]
    act = torch.finfo(dtype).bits // 8
    x = torch.randn(tokens, h, device=device, dtype=dtype, requires_grad=True)
    w = torch.ones(h, device=device, dtype=dtype, requires_grad=True)
    b = torch.zeros(h, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, h, device=device, dtype=dtype)

    def norm():
        out = F.layer_norm(x, (h,), w, b)
        torch.autograd.grad(out, (x, w, b), dy)

    wide = torch.randn(tokens, 4 * h, device=device, dtype=dtype)
    grads = torch.randn(tokens * h, device=device, dtype=dtype)
    buffer = torch.zeros(tokens * h, device=device, dtype=torch.float32)
    logits = torch.randn(tokens // 4, LOSS_VOCAB, device=device, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, LOSS_VOCAB, (tokens // 4,), device=device)

    def loss():
        torch.autograd.grad(chunked_cross_entropy_sum(logits, targets), logits)

    return [
        ReductionPoint("norm", (1 + BACKWARD_TRAFFIC) * 2 * h * act * tokens, seconds(norm, repeats=3)),
        ReductionPoint("bias_grad", wide.numel() * act, seconds(lambda: wide.sum(0), repeats=3)),
        ReductionPoint("accumulate", grads.numel() * (act + 8.0), seconds(lambda: buffer.add_(grads), repeats=3)),
        ReductionPoint("loss", logits.numel() * LOSS_BYTES_PER_LOGIT, seconds(loss, repeats=3)),
    ]


def _host_point(device):
    """The host's time per layer pass (forward + backward) of threefold's model in eager PyTorch:
    a small model (width 256, 128 tokens: the device's part is negligible, the host's launches
    and Python are what takes the time) at 2 and 6 layers, the difference per layer. CUDA only:
    on cpu the host is the device."""
    import torch

    from threefold.config import build_config
    from threefold.model.meta import plain_model
    from threefold.planner.kernel_fit import HostPoint

    if device.type != "cuda":
        return []
    took = {}
    for layers in (2, 6):
        keys = {"model.preset": "tiny", "model.layers": layers, "model.hidden": 256, "model.heads": 4}
        keys |= {"model.kv_heads": 4, "model.ffn_hidden": 1024, "model.seq_len": 128}
        cfg = build_config(None, [(k, str(v)) for k, v in keys.items()]).model
        model = plain_model(cfg, 0, device)
        tokens = torch.randint(0, cfg.vocab, (1, cfg.seq_len + 1), device=device)

        def step(model=model, tokens=tokens):
            model(tokens[:, :-1], tokens[:, 1:]).backward()

        for _ in range(3):
            step()
        torch.cuda.synchronize(device)
        t0, calls = time.perf_counter(), 30
        for _ in range(calls):
            step()
        torch.cuda.synchronize(device)
        took[layers] = (time.perf_counter() - t0) / calls
        del model
    return [HostPoint(2, 6, took[2], took[6])]


def _launch_point(device, seconds):
    """What one tiny kernel costs: back to back on the device's queue (the larger of the host's
    launch interval and the device's per-kernel floor), and the host's call alone."""
    import torch

    from threefold.planner.kernel_fit import LaunchPoint

    x = torch.zeros(1, device=device)
    stream = seconds(lambda: x.add_(1.0))
    t0 = time.perf_counter()
    for _ in range(LAUNCHES):
        x.add_(1.0)
    host = (time.perf_counter() - t0) / LAUNCHES
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return LaunchPoint(stream_s=stream, host_s=host)


def _measure(device, dtype, seconds) -> dict[str, list]:
    import torch

    from threefold.planner.kernel_fit import AdamPoint, AttentionPoint, CopyPoint, GemmPoint

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
    numel = ADAM_NUMEL[device.type]
    adam = [AdamPoint(numel, _adam_seconds(seconds, device, numel))]
    return {
        "gemm": gemms,
        "attention": attention,
        "copy": copies,
        "adam": adam,
        "reduction": _reduction_points(device, dtype, seconds),
        "host": _host_point(device),
        "launch": [_launch_point(device, seconds)],
    }


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
    fit = fit_kernels(
        base, points["gemm"], points["attention"], points["copy"], points["adam"], points["reduction"], points["host"]
    )
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
