"""One layout's prediction: memory (planner/memory.py) and the step time of planner/cost.py,
turned into what the planner reports (tokens/s, MFU, HFU, bubble, the slowest rank)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from threefold.planner.cluster import Cluster
from threefold.planner.cost import step_terms
from threefold.planner.layout import Layout
from threefold.planner.memory import Memory, device_memory
from threefold.planner.model import ModelShape


@dataclass
class Prediction:
    """Everything the planner says about one layout."""

    layout: Layout
    microbatches: int
    memory: Memory
    usable_bytes: float
    times: dict[str, float]
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_device: float
    mfu: float
    hfu: float
    bubble_fraction: float
    slowest_rank: str
    links: dict[str, str]
    devices_used: int
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per category with time and for "step": predicted x exp(-+2 sigma), seconds (planner/categories.py)."""
    calibrated: bool = False
    """The intervals come from a calibration's residuals; else from SIGMA_PRIOR (a factor of 2 per sigma)."""

    @property
    def tokens_per_s_interval(self) -> tuple[float, float]:
        lo, hi = self.intervals["step"]
        return self.tokens_per_s * self.step_time_s / hi, self.tokens_per_s * self.step_time_s / lo

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_bytes

    def as_dict(self) -> dict:
        out = self.layout.as_dict()
        out.update(
            microbatches=self.microbatches,
            memory_bytes_per_device=self.memory.total,
            memory=self.memory.as_dict(),
            usable_bytes_per_device=self.usable_bytes,
            fits=self.fits,
            step_time_s=self.step_time_s,
            tokens_per_s=self.tokens_per_s,
            model_tflops_per_device=self.model_tflops_per_device,
            mfu=self.mfu,
            hfu=self.hfu,
            bubble_fraction=self.bubble_fraction,
            time_split_s=dict(self.times),
            time_split_fraction={k: v / self.step_time_s for k, v in self.times.items()},
            slowest_pipeline_rank=self.slowest_rank,
            links=dict(self.links),
            devices_used=self.devices_used,
            step_time_interval_s=list(self.intervals["step"]),
            tokens_per_s_interval=list(self.tokens_per_s_interval),
            time_split_interval_s={k: list(v) for k, v in self.intervals.items() if k != "step"},
            intervals_calibrated=self.calibrated,
        )
        return out


def predict(
    shape: ModelShape,
    cluster: Cluster,
    layout: Layout,
    global_batch: int,
    dtype: str = "bf16",
    memory: Memory | None = None,
) -> Prediction:
    """Memory and step time of `layout` (assumed structurally valid: see layout.structural_reason)."""
    memory = memory or device_memory(shape, layout, global_batch, dtype, cluster.keeps_attention_scores)
    terms = step_terms(shape, cluster, layout, global_batch, dtype)
    times = terms.times(cluster)
    step = sum(times.values())
    tokens = global_batch * shape.seq_len
    world = layout.world
    model_flops = shape.model_flops_per_token * tokens
    peak = cluster.peak_tflops * 1e12
    intervals, calibrated = prediction_intervals(cluster, times, step)
    return Prediction(
        layout=layout,
        microbatches=layout.microbatches(global_batch),
        memory=memory,
        usable_bytes=cluster.usable_bytes,
        times=times,
        step_time_s=step,
        tokens_per_s=tokens / step,
        model_tflops_per_device=model_flops / step / world / 1e12,
        mfu=model_flops / (step * world * peak),
        hfu=shape.hardware_flops_per_step(global_batch, layout.recompute) / (step * world * peak),
        bubble_fraction=times["bubble"] / step,
        slowest_rank=terms.slowest_rank,
        links=terms.links,
        devices_used=world,
        intervals=intervals,
        calibrated=calibrated,
    )


def prediction_intervals(cluster: Cluster, times: dict[str, float], step: float):
    """({category or "step": (lo, hi) seconds}, calibrated): each category's band's log_sigma
    from the cluster's calibration, SIGMA_PRIOR where it has none."""
    from threefold.planner.categories import SIGMA_PRIOR, interval
    from threefold.planner.validation import BAND_OF

    def sigma(band: str) -> float:
        return cluster.categories.get(band, {}).get("log_sigma", SIGMA_PRIOR)

    out = {c: interval(t, sigma(BAND_OF.get(c, c))) for c, t in times.items() if t > 0}
    out["step"] = interval(step, sigma("step"))
    return out, "log_sigma" in cluster.categories.get("step", {})


class RunPredictor:
    """The planner's view of a measured run (its run.json), for `threefold report`'s prescriptions:
    the predicted tokens/s of the run's config against that of a changed config, whether a
    change fits in memory, and a group's calibrated link."""

    def __init__(self, info: dict, cluster_pairs: list[tuple[str, object]] = ()):
        """`info` is the run's run.json; `cluster_pairs` are --cluster.KEY values (a calibrated
        --cluster.profile among them), which win over what run.json recorded."""
        from threefold.planner.calibrate import _config_from
        from threefold.planner.cluster import PROFILES, build_cluster
        from threefold.planner.model import model_shape

        self.cfg = _config_from(info.get("config", {}))
        hardware, extra = info.get("hardware", {}), info.get("extra", {})
        p, t = self.cfg.parallel, self.cfg.train
        self.base = Layout(
            tp=p.tp, pp=p.pp, dp=max(1, p.dp), vpp=p.vpp, mbs=t.micro_batch,
            schedule=p.schedule if p.pp > 1 else "1f1b", zero=p.zero, sp=p.sp, recompute=t.recompute, ep=p.ep,
            cp=p.cp, cp_impl=p.cp_impl, zero3_prefetch=p.zero3_prefetch,
        )  # fmt: skip
        named = {k for k, _ in cluster_pairs}
        pairs = list(cluster_pairs)
        overlap = info.get("config", {}).get("parallel", {}).get("overlap_param_gather")
        if overlap is not None and "param_gather" not in named:  # a run from before the key: the cluster's
            from threefold.planner.overlap import param_gather

            pairs.append(("param_gather", param_gather(overlap)))
        cpu = hardware.get("device_type", "cpu") == "cpu"
        if "device" not in named and "profile" not in named:
            gpu = next((k for k, v in PROFILES.items() if v["peak_name"] == hardware.get("device_name")), "h100")
            pairs.append(("device", "cpu" if cpu else gpu))
        world = self.base.world
        if cpu:  # the run's processes on one host, sharing the cores it recorded
            pairs += [(k, v) for k, v in (("devices_per_node", world), ("nodes", 1)) if k not in named]
            if hardware.get("logical_cores") and "host_cores" not in named:
                pairs.append(("host_cores", int(hardware["logical_cores"])))
        peak = extra.get("peak_flops_per_device")
        if isinstance(peak, (int, float)) and peak > 0 and "peak_tflops" not in named:
            pairs.append(("peak_tflops", peak / 1e12))
        self.cluster = build_cluster(pairs, cache_dir=self.cfg.data.cache_dir)
        if not cpu and "nodes" not in named:
            self.cluster.nodes = max(1, -(-world // self.cluster.devices_per_node))
        text = str(extra.get("dtype", t.dtype))
        self.dtype = "bf16" if ("bfloat16" in text or text == "bf16") and not cpu else "fp32"
        self.shape = model_shape(self.cfg.model)
        self.shares_cores = self.cluster.core_share < 1.0
        """More processes than cores (cpu): a rank that waits gives its core to the others."""
        self.comm_on_compute_cores = cpu and 0 < self.cluster.host_cores <= world
        """No core to spare (cpu): the collectives' threads run on the cores compute uses, so
        overlap hides a collective's wait but not its work."""
        self.global_batch = t.global_batch
        self._base = self.predict({})

    def layout(self, changes: dict) -> Layout | None:
        """The run's layout with config `changes` ({"parallel.microbatches": 16, ...}); None when
        the planner cannot run it (a structural rule says no)."""
        from threefold.planner.layout import structural_reason

        fields = dict(self.base.__dict__)
        for key, value in changes.items():
            name = key.split(".", 1)[1]
            if name == "microbatches":
                fields["mbs"] = max(1, self.global_batch // (fields["dp"] * int(value)))
            elif name == "micro_batch":
                fields["mbs"] = int(value)
            elif name in fields:
                fields[name] = value
        layout = Layout(**fields)
        # The run and its neighbours are predicted as they would run, including what the search
        # prunes (fewer micro-batches than stages: the pathology a report has to price).
        why = structural_reason(
            self.cfg.model, layout, self.global_batch, self.cluster.devices_per_node,
            self.cluster.allow_tp_across_nodes, self.cluster.world, prune=False,
        )  # fmt: skip
        return None if why else layout

    def predict(self, changes: dict) -> Prediction | None:
        layout = self.layout(changes)
        return None if layout is None else predict(self.shape, self.cluster, layout, self.global_batch, self.dtype)

    def gain(self, changes: dict) -> float | None:
        """Predicted tokens/s of the changed config over the run's, minus 1 (None: not runnable)."""
        pred = self.predict(changes)
        if pred is None or self._base is None:
            return None
        return pred.tokens_per_s / self._base.tokens_per_s - 1

    def gain_interval(self, changes: dict) -> tuple[float, float] | None:
        """(low, high) of gain(changes): the two step times' intervals taken as independent, so
        the ratio's log sigma is sqrt(2) times the step's (None: not runnable)."""
        from threefold.planner.categories import SIGMA_PRIOR, K

        pred = self.predict(changes)
        if pred is None or self._base is None:
            return None
        ratio = pred.tokens_per_s / self._base.tokens_per_s
        spread = K * math.sqrt(2) * self.cluster.categories.get("step", {}).get("log_sigma", SIGMA_PRIOR)
        return ratio * math.exp(-spread) - 1, ratio * math.exp(spread) - 1

    def memory(self, changes: dict) -> tuple[float, float] | None:
        """(bytes per device, usable bytes) of the changed config; None when not runnable."""
        pred = self.predict(changes)
        return None if pred is None else (pred.memory.total, pred.usable_bytes)

    def link(self, group: str) -> tuple[float, float]:
        """(bytes/s, fixed seconds per collective call) of `group`'s link: the calibrated bus
        bandwidth, and the call's overhead plus a ring's latency steps over that group."""
        c, base = self.cluster, self._base
        link = base.links.get(group, "intra") if base is not None else "intra"
        n = {"dp": self.base.dp * self.base.cp, "tp": self.base.tp, "ep": self.base.ep, "cp": self.base.cp, "pp": 2}
        n = n.get(group, 2)
        latency = getattr(c, f"{link}_latency_us") * 1e-6 * 2 * max(0, n - 1)
        return getattr(c, f"{link}_bw_gbps") * 1e9, c.collective_overhead_us * 1e-6 + latency
