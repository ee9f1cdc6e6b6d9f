"""bench/gpu.py's breakdown phase: where one device's training step goes, kernel class by kernel
class, next to the planner's price of the same classes (threefold/planner/breakdown.py).

For each configuration (CUDA: gpt-1.3b at 2048 tokens with micro-batches of 4, compiled and
eager, of 1, and with full recompute; gpt-1.3b at 8192 tokens; a llama-7b-shaped model cut to 4
layers at 4096 tokens. CPU --tiny: the tiny model twice, for the plumbing), threefold train runs
STEPS steps in this process. Measured: the median step time over steps 3-6 (1-2 dropped:
allocation, compilation), threefold's own optimizer span over steps 6-10, and a torch.profiler
window of CUDA kernels over about 3 later steps (so its callbacks stay out of the timed steps),
the device drained where it opens and closes: each class's share of the window's time, as
milliseconds of the median step, each kernel put in one class by its name:

  attention    flash / fmha / cuDNN SDPA kernels
  gemm         cuBLAS, CUTLASS and nvjet matrix kernels
  optimizer    multi_tensor_apply kernels: the foreach norm, fused AdamW, the master copied down
               (zero_grad's fill counts as element-wise)
  memcpy       copies and memsets (the batches to the device)
  elementwise  everything else: norms, activations, residuals, the loss, embedding, Triton kernels
  idle         the step time less all kernel time: the device waiting for the host

Predicted: the planner's classes (threefold/planner/breakdown.py) on the sweep's fitted profile,
or on the device's built-in profile when the sweep did not run.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from gpu_checks import TINY, guarded, train_metrics

STEPS = 12
TIMED = slice(2, 6)  # steps 3-6
# Kernels over about 3 steps after them, as shares of the window's time; the run goes 2 steps
# past the window, so the schedule closes it.
PROFILED = dict(wait=6, warmup=1, active=3)
# Spans reported over steps 6-10 (whole report windows clear of the warm-up); no traced step,
# whose per-layer timing would stand in the profiled window.
LOGGING = {"log.interval": 5, "log.trace_steps": ""}
GPT13 = {"model.preset": "gpt-1.3b", "model.seq_len": 2048, "train.global_batch": 8, "train.micro_batch": 4}
CUDA_CONFIGS = [
    ("gpt-1.3b mbs 4 compiled", {**GPT13, "train.compile": "true"}),
    ("gpt-1.3b mbs 4", GPT13),
    ("gpt-1.3b mbs 1", {**GPT13, "train.global_batch": 4, "train.micro_batch": 1}),
    ("gpt-1.3b mbs 4 recompute full", {**GPT13, "train.recompute": "full"}),
    ("gpt-1.3b seq 8192", {**GPT13, "model.seq_len": 8192, "train.global_batch": 2, "train.micro_batch": 1}),
    (
        "llama-7b 4 layers seq 4096",
        {
            "model.preset": "llama-7b",
            "model.layers": 4,
            "model.seq_len": 4096,
            "train.global_batch": 2,
            "train.micro_batch": 1,
        },
    ),
]
CPU_CONFIGS = [("tiny", TINY), ("tiny mbs 1", {**TINY, "train.global_batch": 4, "train.micro_batch": 1})]
CLASS_NAMES = (
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "splitk")),
    ("optimizer", ("multi_tensor_apply", "adam")),
    ("memcpy", ("memcpy", "memset")),
)
MEASURED = ("gemm", "attention", "elementwise", "optimizer", "memcpy", "idle")
PREDICTED_AS = {"idle": "overhead", "memcpy": None}  # the planner's class for a measured one


def kernel_class(name: str) -> str:
    lower = name.lower()
    for cls, marks in CLASS_NAMES:
        if any(mark in lower for mark in marks):
            return cls
    return "elementwise"


def classify(events, window_s: float) -> tuple[dict[str, float], list[tuple[str, str, float, float]]]:
    """({class: share of the window's time its kernels ran}, the 30 costliest kernels as
    (class, name, share, launches per second)) of the profiler's CUDA events (kineto's: name(),
    duration_ns()); classes["kernels"] counts the kernels launched per second."""
    classes: dict[str, float] = {"kernels": len(events) / window_s}
    by_name: dict[str, list[float]] = {}
    for e in events:
        share, cls = e.duration_ns() / 1e9 / window_s, kernel_class(e.name())
        classes[cls] = classes.get(cls, 0.0) + share
        tally = by_name.setdefault(e.name(), [0.0, 0.0])
        tally[0] += share
        tally[1] += 1 / window_s
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:30]
    return classes, [(kernel_class(name), name[:160], s, n) for name, (s, n) in top]


class Profiled:
    """A torch.profiler window of CUDA kernels over PROFILED's active schedule steps, advanced by
    the training loop's on_step_end callback; the kernels are summarised when the window closes."""

    def __init__(self, device: str):
        import torch

        from threefold.training.callbacks import Callbacks

        self.kernels: dict[str, float] = {}
        self.top: list[tuple[str, str, float, float]] = []
        self.prof = None
        self.calls, self.marks, self.window_s = 0, [], 0.0
        if device == "cuda":
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # kineto's start/stop lines off
            self.prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA],
                schedule=torch.profiler.schedule(**PROFILED, repeat=1),
                on_trace_ready=self._summarise,
            )
        self.callbacks = Callbacks(on_step_end=self._step_end)

    def _step_end(self, step: int, trainer) -> None:
        """Advance the profiler's schedule. The device is drained where the recorded window
        opens and closes, and the host clock between the two is the window's length: the loop
        reads a step after queueing the next, and a report step at once, so a window of
        `active` schedule steps may hold another number of training steps (one held 2 for 3);
        the kernels' shares of the window's time do not depend on it."""
        import torch

        if self.prof is None:
            return
        self.calls += 1
        if self.calls in (PROFILED["wait"] + PROFILED["warmup"], sum(PROFILED.values())):
            torch.cuda.synchronize()
            self.marks.append(time.perf_counter())
        self.prof.step()

    def _summarise(self, prof) -> None:
        import torch

        if len(self.marks) != 2:  # stopped by the run's end, not by the schedule
            raise RuntimeError(f"the profiled window closed after {self.calls} steps, before its end")
        cuda = torch._C._autograd.DeviceType.CUDA
        events = [e for e in prof.profiler.kineto_results.events() if e.device_type() == cuda]
        self.window_s = self.marks[1] - self.marks[0]
        self.kernels, self.top = classify(events, self.window_s)

    def __enter__(self):
        if self.prof is not None:
            self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.prof is not None:
            self.prof.__exit__(*exc)


def one_config(label: str, overrides: dict, device: str, cache_dir: str, profile: str) -> dict:
    """One configuration's measured and predicted classes (module docstring)."""
    import torch

    from threefold.planner import build_cluster
    from threefold.planner.breakdown import predicted_classes
    from threefold.planner.model import model_shape
    from threefold.planner.runs import load_run

    torch._dynamo.reset()
    extra = {"train.threads": torch.get_num_threads()} if device == "cpu" else {}
    with tempfile.TemporaryDirectory() as log_dir, Profiled(device) as prof:
        config = {**overrides, **LOGGING}
        metrics = train_metrics(config, device, "bf16", STEPS, cache_dir, log_dir, prof.callbacks, **extra)
        run = load_run(log_dir, warmup=TIMED.start)
    step = statistics.median(r["step_time_s"] for r in metrics[TIMED])
    base = build_cluster({"profile": profile} if profile else {"device": _device_profile(device)})
    base.devices_per_node, base.nodes = 1, 1
    shape = model_shape(run.cfg.model)
    predicted = predicted_classes(shape, base, run.layout, run.cfg.train.global_batch, run.dtype)
    # The window's shares, as seconds of the timed steps' median step.
    shares = dict(prof.kernels)
    rate = shares.pop("kernels", None)
    measured = {cls: share * step for cls, share in shares.items()}
    if measured:
        measured["idle"] = max(0.0, step - sum(measured.values()))
        measured["kernels_per_step"] = rate * step
    top = [(cls, name, share * step, per_s * step) for cls, name, share, per_s in prof.top]
    return {
        "label": label,
        "overrides": overrides,
        "step_s": step,
        "optimizer_span_s": run.categories.get("span_optimizer_s"),
        "kernels": measured,
        "top_kernels": top,
        "window_s": prof.window_s,
        "predicted": predicted,
    }


def _device_profile(device: str) -> str:
    import torch
    from kernel_sweep import profile_for

    return profile_for(torch.cuda.get_device_name(0) if device == "cuda" else "cpu")


def breakdown(device: str, cache_dir: str, profile: str, emit) -> list[dict]:
    """Every configuration, one row each (its step time); a failed one is its row's FAIL."""
    from gpu_perf import release

    out = []
    for label, overrides in CUDA_CONFIGS if device == "cuda" else CPU_CONFIGS:
        done = {}

        def measure(label=label, overrides=overrides, done=done) -> float:
            done.update(one_config(label, overrides, device, cache_dir, profile))
            return done["step_s"]

        emit(guarded("breakdown", f"breakdown {label}, step s", None, measure))
        release(device)
        if done:
            out.append(done)
    return out


def breakdown_lines(rows: list[dict]) -> list[str]:
    """The table: per configuration, each class measured (kernel time per step) and predicted."""
    if not rows:
        return []
    lines = [
        "",
        "Where the step goes, per configuration (ms per step; measured: CUDA kernel time by class, "
        "idle = step - kernels; predicted: the planner's classes):",
        "",
        "| configuration | class | measured ms | predicted ms | predicted / measured - 1 |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        pred, kern = row["predicted"], row["kernels"]
        pairs = [("step", row["step_s"], pred["step"]), ("optimizer span", row["optimizer_span_s"], pred["optimizer"])]
        for cls in MEASURED:
            key = PREDICTED_AS.get(cls, cls)
            pairs.append((cls, kern.get(cls, 0.0) if kern else None, pred[key] if key else None))
        for cls, measured, predicted in pairs:
            m = "-" if measured is None else f"{measured * 1e3:.1f}"
            p = "-" if predicted is None else f"{predicted * 1e3:.1f}"
            err = f"{predicted / measured - 1:+.1%}" if measured and predicted is not None else "-"
            lines.append(f"| {row['label']} | {cls} | {m} | {p} | {err} |")
    return lines
