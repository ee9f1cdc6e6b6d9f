"""The machine a plan is for: device profile, node shape, links, and the efficiency parameters.

A `Cluster` is built from a named hardware profile (`PROFILES`, planner/profiles.py), then a user TOML profile
(`--cluster.profile FILE`, a `[cluster]` table of the same keys), then `--cluster.KEY VALUE`
overrides, each later one winning. The efficiency parameters (compute_efficiency, bandwidths,
latencies, overheads) are priors: `threefold plan --calibrate RUN_DIR...` fits them to measured
runs and `--save-profile FILE` writes the result as a profile for the next plan.

Units: bandwidths in GB/s (10^9 bytes per second, one direction, per device, as the "bus
bandwidth" nccl-tests reports), latencies in microseconds, memory in GiB.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from threefold.config import knob, read_toml_file
from threefold.errors import ConfigError
from threefold.observe.host import available_cores, total_ram_bytes
from threefold.planner.profiles import ALIASES, PROFILES

GiB = float(1 << 30)


@dataclass
class Cluster:
    """Devices, how they are connected, and how fast the implementation runs on them."""

    profile: str = knob("", "TOML file with a [cluster] table of these keys ('' = the device's built-in profile)")
    device: str = knob("h100", "Hardware profile: a100-40gb, a100-80gb, h100, h200, cpu")
    devices_per_node: int = knob(0, "Devices per node, the fast-link domain (0 = the profile's: 8 GPUs, or cpu cores)")
    nodes: int = knob(1, "Number of nodes")
    peak_tflops: float = knob(0.0, "Dense peak TFLOP/s per device in the training dtype (0 = table; cpu: measured)")
    memory_gib: float = knob(0.0, "Device memory in GiB (0 = the profile's; cpu: host RAM / devices_per_node)")
    reserved_gib: float = knob(0.0, "Memory the model cannot use: runtime context, comm buffers, fragmentation")
    mem_bw_gbps: float = knob(
        0.0, "GB/s the optimizer phase streams at (the datasheet's memory bandwidth, or the sweep's fused AdamW)"
    )
    intra_bw_gbps: float = knob(0.0, "Per-device bus bandwidth reached inside a node, GB/s one way (NVLink; cpu: gloo)")
    inter_bw_gbps: float = knob(0.0, "Per-device bus bandwidth reached between nodes, GB/s one way (its share of NICs)")
    intra_latency_us: float = knob(0.0, "Latency of one ring step inside a node, microseconds")
    inter_latency_us: float = knob(0.0, "Latency of one ring step between nodes, microseconds")
    spine_bw_gbps: float = knob(
        0.0,
        "Per-device bandwidth of a group whose links cross leaf switches, GB/s "
        "(0 = inter_bw_gbps; a --topology placement sets it from its leaves' uplink share)",
    )
    spine_latency_us: float = knob(-1.0, "Latency of one ring step across leaf switches (-1 = inter_latency_us)")
    collective_overhead_us: float = knob(
        -1.0,
        "Fixed cost of one collective call: launch and the group's rendezvous (cpu: a scheduling round) (-1 = profile)",
    )
    compute_efficiency: float = knob(0.0, "Fraction of peak the model's large matmuls reach (0 = the profile's prior)")
    gemm_half_dim: float = knob(
        -1.0,
        "A GEMM's smallest dimension at which it reaches half of compute_efficiency (-1 = profile; 0 = no penalty)",
    )
    elementwise_bw_gbps: float = knob(
        0.0, "Memory bandwidth element-wise work reaches (norms, activations, softmax, residuals), GB/s (0 = profile)"
    )
    reduction_bw_gbps: float = knob(
        0.0,
        "Memory bandwidth normalisation, reduction and mixed-dtype kernels reach (norms, bias-gradient sums, the "
        "loss, gradient accumulation), GB/s (0 = profile)",
    )
    layer_overhead_us: float = knob(
        -1.0,
        "Host time per layer and micro-batch, fwd + bwd: launches, Python (-1 = profile); on GPUs only what "
        "outlasts the layer's device time is exposed",
    )
    step_overhead_s: float = knob(-1.0, "Fixed time per step outside the model: data, logging, sync (-1 = profile)")
    sm_count: int = knob(-1, "Streaming multiprocessors: GEMM wave quantization (-1 = profile; 0 = none, cpu)")
    attention_efficiency: float = knob(
        -1.0,
        "Fraction of peak the fused attention kernel reaches at head dim 128, long sequences "
        "(-1 = profile; 0 = a GEMM like the others, cpu)",
    )
    attention_half_seq: float = knob(-1.0, "Sequence length at which attention runs at half that rate (-1 = profile)")
    attention_scores: str = knob(
        "causal",
        "Unfused attention (attention_efficiency 0): causal = QK^T, softmax and PV over the causal half "
        "(threefold's SDPA); square = over all s x s scores, the mask applied in the softmax (Megatron-LM's "
        "baddbmm and scaled masked softmax before flash attention)",
    )
    attention_dropout: bool = knob(
        False,
        "Unfused attention (attention_efficiency 0): dropout on the probabilities, a pass that writes the dropped "
        "ones and a 1-byte mask forward and reads them back backward (Megatron-LM's --attention-dropout, 0.1 by "
        "default); a fused kernel drops on chip",
    )
    overlap: str = knob(
        "",
        "modelled = each transfer hides what the compute beside it covers, on its own link (GPUs); "
        "none = every transfer exposed but dp_overlap/tp_overlap's share (cpu: gloo shares the cores) ('' = profile)",
    )
    overlap_slowdown: float = knob(
        -1.0,
        "Share of each hidden second of a transfer the compute beside it loses (modelled overlap; -1 = profile)",
    )
    tp_overlap_scope: str = knob(
        "backward",
        "TP collectives behind compute: backward = dX's collective behind dW and SP's re-gather behind dX "
        "(the engine, Megatron-Core); all = forward ones pipelined with their GEMMs too (userbuffers, async TP); none",
    )
    param_gather: str = knob(
        "after_step",
        "ZeRO-1/2 parameter all-gather: after_step = in full after the optimizer step (the engine); "
        "forward = each bucket's behind the next forward (Megatron's overlap_param_gather)",
    )
    grad_reduce: str = knob(
        "fp32",
        "Bytes the data-parallel gradient reduction moves: fp32 = fp32 main gradients (train.grad_reduce_dtype auto, "
        "Megatron's main grads); 16bit = bf16/fp16 (train.grad_reduce_dtype bf16 or fp16; Megatron-LM without "
        "--accumulate-allreduce-grads-in-fp32)",
    )
    grad_accumulation: str = knob(
        "separate",
        "Each micro-batch's weight gradients: separate = added into the fp32 buffers after the GEMM (threefold's "
        "engine); fused = accumulated by the weight-gradient GEMM itself (Megatron-LM's gradient accumulation fusion)",
    )
    dp_overlap: float = knob(
        -1.0, "Fixed fraction of DP/ZeRO communication hidden (-1 = by cluster.overlap: modelled, or 0 under none)"
    )
    tp_overlap: float = knob(
        -1.0, "Fixed fraction of TP/SP communication hidden (-1 = by cluster.overlap: modelled, or 0 under none)"
    )
    pp_overlap: float = knob(
        -1.0,
        "Fixed fraction of pipeline sends and receives hidden (-1 = by cluster.overlap: modelled, or 0 under none; "
        "0 = blocking: Megatron-LM before its overlap_p2p_comm option of 2023 waited on each batch_isend_irecv and "
        "synchronized the device; a fixed share's exchanges move each send at once with a receive)",
    )
    pp_scatter_gather: bool = knob(
        False,
        "Without SP, each TP rank sends 1/tp of a pipeline activation and the receivers all-gather it over the TP "
        "link (Megatron-LM's scatter/gather optimization, on by default: Narayanan et al. 2021 §4.1)",
    )
    allow_tp_across_nodes: bool = knob(False, "Let a tensor-parallel group span nodes (over the inter-node link)")
    cp_min_seq: int = knob(
        8192, "Search context parallelism (cp > 1) for sequences at least this long (0 = never; pin with --parallel.cp)"
    )
    host_cores: int = knob(0, "cpu: cores the node's processes share; fewer than processes slows each (0 = no sharing)")
    core_share_exponent: float = knob(
        0.0,
        "cpu: with more processes than cores each runs at (cores / processes) "
        "** this of a core; above 1: switches and cache contention (0 = profile)",
    )
    validation: dict = field(
        default_factory=dict,
        repr=False,
        compare=False,
        metadata={
            "doc": "Error band of each predicted category, from a calibrated profile's [validation] table",
            "table": True,
        },
    )
    categories: dict = field(
        default_factory=dict,
        repr=False,
        compare=False,
        metadata={
            "doc": "Per measured category: its own fitted parameters and log_sigma, a profile's [categories.NAME]",
            "table": True,
        },
    )

    links: dict = field(
        default_factory=dict,
        repr=False,
        compare=False,
        metadata={
            "doc": "Per group dimension, the link its placement gives it (intra, inter, spine): planner/placement.py",
            "table": True,
        },
    )

    @property
    def world(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def peak_flops(self) -> float:
        """Peak FLOP/s one device gets, after sharing the host's cores (cpu)."""
        return self.peak_tflops * 1e12 * self.core_share

    @property
    def core_share(self) -> float:
        """The share of a core each process gets: 1 unless more processes than cores (cpu)."""
        if self.host_cores > 0 and self.devices_per_node > self.host_cores:
            return (self.host_cores / self.devices_per_node) ** (self.core_share_exponent or 1.0)
        return 1.0

    @property
    def usable_bytes(self) -> float:
        return (self.memory_gib - self.reserved_gib) * GiB

    @property
    def keeps_attention_scores(self) -> bool:
        """Whether the attention keeps its s x s probabilities for backward: only the unfused
        square kernel does (Megatron-LM's baddbmm and masked softmax); threefold's SDPA, fused on
        GPUs and flash on CPU, keeps q, k, v, its output and the log-sum-exp."""
        return self.attention_scores == "square"

    def label(self) -> str:
        return f"{self.nodes} x {self.devices_per_node} {self.device}"


_FROM_PROFILE_IF = {
    "devices_per_node": 0,
    "peak_tflops": 0.0,
    "memory_gib": 0.0,
    "reserved_gib": 0.0,
    "mem_bw_gbps": 0.0,
    "intra_bw_gbps": 0.0,
    "inter_bw_gbps": 0.0,
    "intra_latency_us": 0.0,
    "inter_latency_us": 0.0,
    "collective_overhead_us": -1.0,
    "compute_efficiency": 0.0,
    "gemm_half_dim": -1.0,
    "elementwise_bw_gbps": 0.0,
    "reduction_bw_gbps": 0.0,
    "layer_overhead_us": -1.0,
    "step_overhead_s": -1.0,
    "sm_count": -1,
    "attention_efficiency": -1.0,
    "attention_half_seq": -1.0,
    "overlap": "",
    "overlap_slowdown": -1.0,
    "core_share_exponent": 0.0,
}
CHOICES = {
    "overlap": ("modelled", "none"),
    "tp_overlap_scope": ("backward", "all", "none"),
    "param_gather": ("after_step", "forward"),
    "grad_reduce": ("fp32", "16bit"),
    "grad_accumulation": ("separate", "fused"),
    "attention_scores": ("causal", "square"),
}

# The keys of a [cluster] table and of --cluster.KEY (validation is a table of its own).
FIELDS = {f.name: f for f in dataclasses.fields(Cluster) if not f.metadata.get("table")}
_TYPES = typing.get_type_hints(Cluster)


def _coerce(key: str, raw: Any) -> Any:
    kind = _TYPES[key]
    try:
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw)
        if kind is float:
            return float(raw)
        return str(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"cluster.{key}", f"{raw!r} is not a valid {kind.__name__}") from None


def _check_key(key: str, where: str) -> None:
    if key not in FIELDS:
        import difflib

        close = difflib.get_close_matches(key, list(FIELDS), n=1)
        hint = f"did you mean 'cluster.{close[0]}'?" if close else "valid: " + ", ".join(FIELDS)
        raise ConfigError(f"{where}{key}", "unknown cluster key", hint)


def read_profile(path: str) -> dict[str, Any]:
    """The [cluster] table of a profile TOML file, keys checked."""
    data = read_toml_file(path, "cluster.profile")
    table = data.get("cluster")
    if not isinstance(table, dict):
        raise ConfigError("cluster.profile", f"{path} has no [cluster] table", "write the keys under [cluster]")
    for key in table:
        _check_key(key, f"{path}: cluster.")
        if key == "profile":
            raise ConfigError(f"{path}: cluster.profile", "a profile cannot name another profile")
    return table


def read_validation(path: str) -> dict:
    """The error bands a calibrated profile carries ({} when it has none)."""
    from threefold.planner.validation import read_table

    table = read_toml_file(path, "cluster.profile").get("validation")
    return read_table(table, path) if table is not None else {}


def device_name(raw: str) -> str:
    name = ALIASES.get(raw.lower(), raw.lower())
    if name not in PROFILES:
        raise ConfigError(
            "cluster.device",
            f"unknown device {raw!r}",
            "valid: " + ", ".join(PROFILES) + ", or --cluster.profile FILE with your own numbers",
        )
    return name


def build_cluster(overrides: dict[str, Any] | list[tuple[str, Any]] = (), cache_dir: str = "") -> Cluster:
    """Profile <- TOML profile file <- overrides (keys without the 'cluster.' prefix)."""
    pairs = list(overrides.items()) if isinstance(overrides, dict) else list(overrides)
    for key, _ in pairs:
        _check_key(key, "cluster.")
    given = {k: _coerce(k, v) for k, v in pairs}
    from_file = read_profile(given["profile"]) if given.get("profile") else {}
    values: dict[str, Any] = {k: _coerce(k, v) for k, v in from_file.items()}
    values.update(given)
    cluster = Cluster(**values)
    if given.get("profile"):
        cluster.validation = read_validation(given["profile"])
        from threefold.planner.categories import read_categories

        cluster.categories = read_categories(given["profile"], FIELDS)
    cluster.device = device_name(cluster.device)
    _fill_from_profile(cluster, cache_dir)
    check_cluster(cluster)
    return cluster


def _fill_from_profile(c: Cluster, cache_dir: str) -> None:
    prof = PROFILES[c.device]
    for key, unset in _FROM_PROFILE_IF.items():
        if getattr(c, key) == unset and key in prof:
            setattr(c, key, prof[key])
    c.spine_bw_gbps = c.spine_bw_gbps or c.inter_bw_gbps
    c.spine_latency_us = c.inter_latency_us if c.spine_latency_us < 0 else c.spine_latency_us
    if c.device == "cpu":
        cores = available_cores()
        if c.devices_per_node == 0:
            c.devices_per_node = cores
        if c.host_cores == 0:
            c.host_cores = cores
        if c.memory_gib == 0.0:
            c.memory_gib = float(total_ram_bytes() or 16 * GiB) / GiB / c.devices_per_node
        if c.peak_tflops == 0.0:
            c.peak_tflops = measured_cpu_peak(cache_dir) / 1e12
    elif c.peak_tflops == 0.0:
        c.peak_tflops = gpu_peak(prof["peak_name"]) / 1e12


def gpu_peak(name: str, dtype: str = "bf16") -> float:
    """Dense peak from observe.peak's datasheet table, the one the metrics' MFU uses."""
    import torch

    from threefold.observe.peak import cuda_peak_flops

    peak = cuda_peak_flops(name, {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
    if peak is None:
        raise ConfigError("cluster.peak_tflops", f"no {dtype} peak for {name} in the peak table", "set it explicitly")
    return peak


def measured_cpu_peak(cache_dir: str = "", threads: int = 1) -> float:
    """fp32 matmul FLOP/s of one thread, measured once and cached by observe.peak."""
    import torch

    from threefold.observe.peak import cpu_peak_flops

    return cpu_peak_flops(torch.float32, threads=threads, cache_dir=cache_dir)


def check_cluster(c: Cluster) -> None:
    """One line naming the first key that makes the cluster impossible."""
    if c.nodes < 1:
        raise ConfigError("cluster.nodes", f"must be >= 1, got {c.nodes}")
    if c.devices_per_node < 1:
        raise ConfigError("cluster.devices_per_node", f"must be >= 1, got {c.devices_per_node}")
    positive = ("peak_tflops", "memory_gib", "mem_bw_gbps", "elementwise_bw_gbps", "reduction_bw_gbps")
    for key in (*positive, "intra_bw_gbps", "inter_bw_gbps"):
        if getattr(c, key) <= 0:
            raise ConfigError(f"cluster.{key}", f"must be > 0, got {getattr(c, key)}")
    if not 0 < c.compute_efficiency <= 1:
        raise ConfigError("cluster.compute_efficiency", f"{c.compute_efficiency} is outside (0, 1]")
    if c.core_share_exponent < 0:
        raise ConfigError("cluster.core_share_exponent", f"must be >= 0, got {c.core_share_exponent}")
    for key in ("dp_overlap", "tp_overlap", "pp_overlap"):
        if not (0 <= getattr(c, key) <= 1 or getattr(c, key) == -1):
            raise ConfigError(f"cluster.{key}", f"{getattr(c, key)} is outside [0, 1]", "or -1: by cluster.overlap")
    for key, valid in CHOICES.items():
        if getattr(c, key) not in valid:
            raise ConfigError(f"cluster.{key}", f"{getattr(c, key)!r} is not one of {', '.join(valid)}")
    if not 0 <= c.overlap_slowdown <= 1:
        raise ConfigError("cluster.overlap_slowdown", f"{c.overlap_slowdown} is outside [0, 1]")
    if not 0 <= c.attention_efficiency <= 1:
        raise ConfigError("cluster.attention_efficiency", f"{c.attention_efficiency} is outside [0, 1]")
    if c.attention_scores == "square" and c.attention_efficiency > 0:
        raise ConfigError(
            "cluster.attention_scores",
            f"'square' is the unfused kernel's, but attention_efficiency is {c.attention_efficiency} (a fused "
            "kernel); set attention_efficiency = 0 or attention_scores = 'causal'",
        )
    for key in (
        "reserved_gib",
        "gemm_half_dim",
        "intra_latency_us",
        "inter_latency_us",
        "collective_overhead_us",
        "layer_overhead_us",
        "step_overhead_s",
        "cp_min_seq",
        "sm_count",
        "attention_half_seq",
    ):
        if getattr(c, key) < 0:
            raise ConfigError(f"cluster.{key}", f"must be >= 0, got {getattr(c, key)}")
    if c.reserved_gib >= c.memory_gib:
        raise ConfigError(
            "cluster.reserved_gib",
            f"{c.reserved_gib} GiB leaves nothing of {c.memory_gib} GiB",
            "set it below memory_gib",
        )


def describe() -> str:
    lines = ["[cluster]"]
    for f in FIELDS.values():
        lines.append(f"  cluster.{f.name} = {f.default!r}  # {f.metadata.get('doc', '')}")
    lines.append("profiles: " + ", ".join(PROFILES))
    return "\n".join(lines)


def profile_toml(c: Cluster, comment: str = "", bands: dict | None = None) -> str:
    """A [cluster] table that rebuilds `c` (for --save-profile after calibration), and the
    calibration's error bands per category as a [validation] table."""
    from threefold.planner.emit import toml_value
    from threefold.planner.validation import toml_lines

    lines = [f"# {line}" for line in comment.splitlines()] + ["[cluster]"]
    for name in FIELDS:
        if name == "profile":
            continue
        lines.append(f"{name} = {toml_value(getattr(c, name))}")
    for name, values in c.categories.items():
        lines += ["", f"[categories.{name}]"] + [f"{k} = {toml_value(float(v))}" for k, v in values.items()]
    return "\n".join(lines + toml_lines(bands or {})) + "\n"


def split_cluster_args(argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """(argv without them, the --cluster.KEY VALUE pairs): taken out before argparse, which
    would read a pair's value as a positional argument (report, tune)."""
    rest, pairs, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--cluster."):
            key, eq, value = arg[len("--cluster.") :].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(arg[2:], "missing value", "e.g. --cluster.profile calibrated.toml")
                value, i = argv[i + 1], i + 1
            pairs.append((key, value))
        else:
            rest.append(arg)
        i += 1
    return rest, pairs
