"""Observation: FLOPs and parameter counts, device peak and MFU, metrics and run records."""

from threefold.observe.flops import (
    active_params,
    forward_flops_per_token,
    hardware_flops_per_token,
    megatron_flops_per_iteration,
    total_params,
    train_flops_per_token,
)
from threefold.observe.metrics import (
    MetricsWriter,
    hardware_info,
    peak_memory_bytes,
    write_run_json,
)
from threefold.observe.peak import device_peak_flops, mfu

__all__ = [
    "MetricsWriter",
    "active_params",
    "device_peak_flops",
    "forward_flops_per_token",
    "hardware_flops_per_token",
    "hardware_info",
    "megatron_flops_per_iteration",
    "mfu",
    "peak_memory_bytes",
    "total_params",
    "train_flops_per_token",
    "write_run_json",
]
