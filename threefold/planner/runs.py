"""Measured runs as the planner reads them: a run directory (run.json, metrics.jsonl, spans.jsonl)
reduced to its layout, median step time, median seconds per measured category on the slowest
rank, and each measurement's step-to-step spread (calibrate.py fits to these)."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from threefold.config import Config
from threefold.errors import ConfigError
from threefold.planner.layout import Layout

# Measured part of a step -> (span categories of spans.jsonl it sums, predicted categories it is).
SPANS = {
    "span_work_s": (
        ("forward", "backward", "weight_grad", "recompute", "pp_bubble", "sync", "data_wait", "other"),
        ("compute", "recompute", "overhead", "bubble"),
    ),
    "span_tp_comm_s": (("tp_comm",), ("tp_comm",)),
    "span_cp_comm_s": (("cp_comm",), ("cp_comm",)),
    "span_ep_comm_s": (("ep_a2a",), ("ep_comm",)),
    "span_pp_comm_s": (("pp_p2p",), ("pp_comm",)),
    "span_dp_comm_s": (("dp_exposed",), ("dp_comm",)),
    "span_optimizer_s": (("optimizer",), ("optimizer",)),
}
SPAN_WORK = ("forward", "backward", "weight_grad", "recompute")


@dataclass
class Run:
    """One measured run, reduced to what the planner predicts."""

    path: str
    cfg: Config
    layout: Layout
    dtype: str
    step_time_s: float
    """Median step time after the warm-up steps."""
    categories: dict[str, float]
    """Median measured seconds per MEASURED key the run recorded (and is > 0)."""
    steps_used: int
    peak_flops: float | None
    """Per-device peak the run measured (CPU) or looked up, from run.json."""
    host_cores: int | None
    device_type: str
    noise: dict[str, float] = dataclasses.field(default_factory=dict)
    """Per measured key and "step": the standard deviation of log(seconds) over the steps used,
    the measurement's own spread (an interval narrower than it would be noise-fitted)."""

    @property
    def name(self) -> str:
        return Path(self.path).name or self.path


def _config_from(data: dict) -> Config:
    cfg = Config()
    for section, values in data.items():
        part = getattr(cfg, section, None)
        if part is None or not isinstance(values, dict):
            continue
        names = {f.name for f in dataclasses.fields(part)}
        for key, value in values.items():
            if key in names:
                setattr(part, key, value)
    return cfg


def load_run(path: str, warmup: int | None = None) -> Run:
    """Read a run directory; `warmup` first steps are dropped (default: a fifth, at least 1)."""
    root = Path(path)
    run_json, metrics = root / "run.json", root / "metrics.jsonl"
    if not run_json.is_file() or not metrics.is_file():
        raise ConfigError("--calibrate", f"{path} is not a run directory (needs run.json and metrics.jsonl)")
    try:
        info = json.loads(run_json.read_text(encoding="utf-8"))
        records = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
    except ValueError as err:
        raise ConfigError("--calibrate", f"{path}: unreadable run files ({err})") from None
    cfg = _config_from(info.get("config", {}))
    records = [r for r in records if isinstance(r.get("step_time_s"), (int, float))]
    if len(records) < 2:
        raise ConfigError("--calibrate", f"{path} has {len(records)} timed steps; calibration needs at least 2")
    skip = max(1, len(records) // 5) if warmup is None else warmup
    used = records[skip:] or records[-1:]
    step = statistics.median(r["step_time_s"] for r in used)
    per_step = {"pp_idle_s": [r["pp_idle_s"] for r in used if isinstance(r.get("pp_idle_s"), (int, float))]}
    for key, values in _slowest_rank_spans(root / "spans.jsonl", {r.get("step") for r in used}).items():
        per_step.setdefault(key, []).extend(values)
    cats = {}
    for key, values in per_step.items():
        if values and statistics.median(values) > 0:  # relative residuals need a positive measurement
            cats[key] = statistics.median(values)
    per_step["step"] = [r["step_time_s"] for r in used]
    noise = {key: _log_spread(values) for key, values in per_step.items() if key in cats or key == "step"}
    p, t = cfg.parallel, cfg.train
    layout_info = info.get("layout", {})
    layout = Layout(
        tp=layout_info.get("tp", p.tp),
        pp=layout_info.get("pp", p.pp),
        dp=layout_info.get("dp", p.dp),
        vpp=p.vpp,
        mbs=t.micro_batch,
        schedule=p.schedule if p.pp > 1 else "1f1b",
        zero=p.zero,
        sp=p.sp,
        recompute=t.recompute,
        ep=p.ep,
        cp=layout_info.get("cp", p.cp),
        cp_impl=p.cp_impl,
        zero3_prefetch=p.zero3_prefetch,
    )
    hardware = info.get("hardware", {})
    extra = info.get("extra", {})
    device_type = hardware.get("device_type", "cpu")
    dtype_text = str(extra.get("dtype", t.dtype))
    dtype = (
        "bf16"
        if "bfloat16" in dtype_text or dtype_text == "bf16"
        else ("fp32" if ("float32" in dtype_text or dtype_text == "fp32" or device_type == "cpu") else "bf16")
    )
    peak = extra.get("peak_flops_per_device")
    return Run(
        path=str(path),
        cfg=cfg,
        layout=layout,
        dtype=dtype,
        step_time_s=step,
        categories=cats,
        steps_used=len(used),
        peak_flops=float(peak) if isinstance(peak, (int, float)) else None,
        host_cores=hardware.get("logical_cores"),
        device_type=device_type,
        noise=noise,
    )


def _log_spread(values: list[float]) -> float:
    """Spread of log(value) over the positive values as a standard deviation, from the median
    absolute deviation (1.4826 MAD): a step that waited almost nothing does not dominate it
    the way it would a plain standard deviation (0 with fewer than 2 values)."""
    logs = [math.log(v) for v in values if v > 0]
    if len(logs) < 2:
        return 0.0
    mid = statistics.median(logs)
    return 1.4826 * statistics.median(abs(v - mid) for v in logs)


def _slowest_rank_spans(path: Path, steps: set) -> dict[str, list[float]]:
    """Per SPANS key, the seconds the slowest rank (most compute) spent there, one value per step
    line of spans.jsonl whose steps are all in `steps` ({} without the file)."""
    out: dict[str, list[float]] = {}
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        ranks = rec.get("ranks") or []
        # A line averages the `steps` steps up to its own (one per log.interval): it counts
        # only when every one of them is a step in use (none of the warm-up).
        last, window = rec.get("step"), rec.get("steps", 1)
        if not ranks or not isinstance(last, int) or not all(s in steps for s in range(last - window + 1, last + 1)):
            continue
        slowest = max(ranks, key=lambda r: sum(r["time_s"].get(c, 0.0) for c in SPAN_WORK))["time_s"]
        for key, (spans, _) in SPANS.items():
            out.setdefault(key, []).append(sum(slowest.get(c, 0.0) for c in spans))
    return out
