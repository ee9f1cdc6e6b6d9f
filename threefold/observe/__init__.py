"""Recording a run as it goes: spans, the device peak and MFU, metrics and run records, traces,
goodput, and the live band check. (What a FLOP count is: threefold.model.flops; reading a
finished run back: threefold.analysis.)

Names are imported on first use, so that a torch-free reader of one module (the planner reads
observe/host.py) does not import torch through this package.
"""

from importlib import import_module

_EXPORTS = {
    "MetricsWriter": "threefold.observe.metrics",
    "hardware_info": "threefold.observe.metrics",
    "peak_memory_bytes": "threefold.observe.metrics",
    "write_run_json": "threefold.observe.metrics",
    "device_peak_flops": "threefold.observe.peak",
    "mfu": "threefold.observe.peak",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'threefold.observe' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
