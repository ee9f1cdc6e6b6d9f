"""bench/gpu.py's performance phases: threefold train in bf16 on the largest model up to ~1.3B the
device holds, its memory next to `threefold memory`'s, and the plain PyTorch recipe on the same
model and batches. Each phase fills its part of one `perf` dict; what needs two parts (the
ratio) is added once both are there, so a failed contestant leaves the other's figures."""

from __future__ import annotations

import gc
import statistics
import tempfile
import time

from gpu_checks import guarded, make_cfg, train_metrics

GIB = 2**30


def pick_model(memory_bytes: int, tiny: bool = False) -> tuple[str, dict]:
    """(label, config overrides) of the largest model up to ~1.3B whose bf16 training with fp32
    master weights and AdamW (~16 bytes per parameter) plus activations fits in the device."""
    from gpu_checks import TINY

    if tiny:
        return "tiny", dict(TINY)
    gpt13 = {"model.preset": "gpt-1.3b", "model.seq_len": 2048}
    if memory_bytes >= 60 * GIB:
        return "gpt-1.3b", {**gpt13, "train.global_batch": 8, "train.micro_batch": 4}
    if memory_bytes >= 32 * GIB:
        return "gpt-1.3b", {**gpt13, "train.global_batch": 4, "train.micro_batch": 1}
    mid = {
        "model.preset": "gpt-1.3b",
        "model.hidden": 1024,
        "model.heads": 16,
        "model.kv_heads": 16,
        "model.ffn_hidden": 4096,
        "model.layers": 24,
        "model.seq_len": 1024,
    }
    if memory_bytes >= 12 * GIB:
        return "gpt-350m", {**mid, "train.global_batch": 8, "train.micro_batch": 4}
    return "gpt-350m", {**mid, "train.global_batch": 4, "train.micro_batch": 1}


def plain_optimizer_flags(device_type: str) -> dict:
    """The fastest AdamW implementation torch offers on the device."""
    return {"fused": True} if device_type == "cuda" else {"foreach": True}


def plain_cross_entropy(logits, targets):
    """The usual recipe's loss: every logit upcast at once (threefold's loss chunks the tokens)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="sum")


def plain_loop(overrides: dict, device: str, steps: int, cache_dir: str, compiled: bool = True) -> list[float]:
    """The usual PyTorch recipe on the same model and batches: the model torch.compile'd whole
    (`compiled`), fp32 parameters, autocast bf16, AdamW (fused on CUDA, foreach on CPU), foreach
    clipping; step times with the device synchronized."""
    import torch

    from threefold.data import GlobalBatchSampler, load_tokens
    from threefold.model.meta import plain_model
    from threefold.training.optim import param_groups

    cfg = make_cfg(overrides, device, "bf16", steps, "", cache_dir)
    m, t = cfg.model, cfg.train
    dev = torch.device(device)
    model = plain_model(m, t.seed, dev)  # tied like build_model's (gpt presets)
    model.loss_fn = plain_cross_entropy
    run = torch.compile(model) if compiled else model
    fused = plain_optimizer_flags(dev.type)
    opt = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, **fused)
    tokens = load_tokens(cfg.data.path, cfg.data.vocab, cfg.data.dtype, cfg.data.cache_dir).tokens
    sampler = GlobalBatchSampler(len(tokens), m.seq_len, t.global_batch, t.seed)
    n_tokens, times = t.global_batch * m.seq_len, []
    for step in range(steps):
        t0 = time.perf_counter()
        for x, y in sampler.microbatches(tokens, step, 0, 1, t.micro_batch):
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = run(x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)) / n_tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # synchronizes, as threefold's step does when it reads the loss
        times.append(time.perf_counter() - t0)
    del model, run, opt
    return times


def memory_figures(overrides: dict, device: str, cache_dir: str, peak_bytes: float | None, **extra) -> dict:
    """`threefold memory` for the same configuration (one eager step, in this process): its
    measured and predicted totals (parameters, gradients, optimizer state, activations) next to
    the training run's peak allocated bytes, which also hold transient buffers (gradient
    buckets, the logits' gradient, workspaces); None where the training run failed."""
    import torch

    from threefold.distributed.runtime import shutdown_distributed
    from threefold.training.worker import run_worker

    threads = torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory() as log_dir:
            cfg = make_cfg(overrides, device, "bf16", 1, log_dir, cache_dir, **extra)
            row = run_worker(cfg.to_dict(), True)[0]
    finally:
        shutdown_distributed()
        torch.set_num_threads(threads)
    measured = sum(v for v in row["measured"].values() if v is not None)
    predicted = sum(v for v in row["predicted"].values() if v is not None)
    return {
        "train_peak_bytes": peak_bytes,
        "memory_measured_bytes": measured,
        "memory_predicted_bytes": predicted,
        "peak_over_predicted": peak_bytes / predicted if predicted and peak_bytes else None,
    }


def release(device: str) -> None:
    import torch

    gc.collect()  # one contestant's memory goes back before the next allocates its own
    if device == "cuda":
        torch.cuda.empty_cache()


class Performance:
    """The three performance phases over one shared `perf` dict (the JSON's "performance")."""

    def __init__(self, device: str, label: str, overrides: dict, steps: int, cache_dir: str, compiled: bool):
        import torch

        self.device, self.label, self.overrides, self.steps = device, label, overrides, steps
        self.cache_dir, self.compiled = cache_dir, compiled
        self.warm = min(2, steps - 1)
        # On CPU both contestants use the process's threads (the worker would take train.threads = 1).
        self.extra = {"train.threads": torch.get_num_threads()} if device == "cpu" else {}
        self.perf = {
            "model": label,
            "overrides": overrides,
            "steps": steps,
            "warmup": self.warm,
            "compiled": compiled,
            "plain_optimizer": ", ".join(f"{k}={v}" for k, v in plain_optimizer_flags(device).items()),
        }
        self.peak_bytes = None
        self.profile = ""
        """The sweep's fitted [cluster] profile, once it is written (bench/kernel_sweep.py)."""

    def _scale(self) -> None:
        """Tokens, FLOPs and the device's peak, which both contestants' MFU need (once)."""
        if "flops_per_step" in self.perf:
            return
        import torch

        from threefold.model.flops import train_flops_per_token
        from threefold.observe import device_peak_flops

        cfg = make_cfg(self.overrides, self.device, "bf16", self.steps, "", self.cache_dir)
        tokens = cfg.train.global_batch * cfg.model.seq_len
        self.perf["tokens_per_step"] = tokens
        self.perf["flops_per_step"] = train_flops_per_token(cfg.model, cfg.model.seq_len) * tokens
        self.perf["peak_flops"] = device_peak_flops(torch.device(self.device), torch.bfloat16, cache_dir=self.cache_dir)

    def _record(self, who: str, seconds: float) -> float:
        self._scale()
        p = self.perf
        p[f"{who}_step_s"] = seconds
        p[f"{who}_mfu"] = p["flops_per_step"] / seconds / p["peak_flops"] if p["peak_flops"] else None
        if "threefold_step_s" in p and "plain_step_s" in p:
            p["ratio"] = p["threefold_step_s"] / p["plain_step_s"]
        return seconds

    def threefold(self, emit) -> None:
        import torch

        torch._dynamo.reset()  # compiled as if first: no dynamic shapes marked by the tiny compile check

        def measure() -> float:
            compile_flag = {"train.compile": str(self.compiled).lower()}
            with tempfile.TemporaryDirectory() as log_dir:
                metrics = train_metrics(
                    self.overrides,
                    self.device,
                    "bf16",
                    self.steps,
                    self.cache_dir,
                    log_dir,
                    **compile_flag,
                    **self.extra,
                )
                self.peak_bytes = max(r.get("peak_mem_bytes", 0) for r in metrics)
                self.perf["final_loss"] = metrics[-1]["loss"]
                seconds = self._record("threefold", statistics.median(r["step_time_s"] for r in metrics[self.warm :]))
                self.perf["planner"] = self._planner_comparison(log_dir)
            return seconds

        emit(guarded("perf_threefold", f"performance threefold ({self.label}), step s", None, measure))
        release(self.device)

    def _planner_comparison(self, log_dir: str) -> dict:
        """The planner's prediction of this run, category by category, next to what its spans
        measured: on the sweep's fitted profile when the sweep ran, else the device's profile."""
        import torch
        from kernel_sweep import profile_for

        from threefold.planner import build_cluster
        from threefold.planner.calibrate import compare_run
        from threefold.planner.runs import load_run

        name = torch.cuda.get_device_name(0) if self.device == "cuda" else "cpu"
        base = build_cluster({"profile": self.profile} if self.profile else {"device": profile_for(name)})
        rows = compare_run(load_run(log_dir, warmup=self.warm), base)
        out = {key: {"measured_s": m, "predicted_s": p, "error": p / m - 1} for key, (m, p) in rows.items()}
        return {"profile": self.profile or f"built-in {base.device}", "categories": out}

    def memory(self, emit) -> None:
        def measure() -> float:
            figures = memory_figures(self.overrides, self.device, self.cache_dir, self.peak_bytes, **self.extra)
            self.perf["memory"] = figures
            return figures["memory_predicted_bytes"]

        emit(guarded("perf_memory", f"threefold memory ({self.label}), predicted bytes", None, measure))
        release(self.device)

    def plain(self, emit) -> None:
        import torch

        torch._dynamo.reset()  # the same fresh start threefold's compile had

        def measure() -> float:
            times = plain_loop(self.overrides, self.device, self.steps, self.cache_dir, self.compiled)
            return self._record("plain", statistics.median(times[self.warm :]))

        emit(guarded("perf_plain", f"performance plain PyTorch ({self.label}), step s", None, measure))
        release(self.device)
