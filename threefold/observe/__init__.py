"""Recording a run as it goes: spans, the device peak and MFU, metrics and run records, traces,
goodput, and the live band check. (What a FLOP count is: threefold.model.flops; reading a
finished run back: threefold.analysis.)"""

from threefold.observe.metrics import (
    MetricsWriter,
    hardware_info,
    peak_memory_bytes,
    write_run_json,
)
from threefold.observe.peak import device_peak_flops, mfu

__all__ = [
    "MetricsWriter",
    "device_peak_flops",
    "hardware_info",
    "mfu",
    "peak_memory_bytes",
    "write_run_json",
]
