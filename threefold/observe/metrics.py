"""Run records on disk: metrics.jsonl (one JSON object per step) and run.json (what ran where).

Only the rank that logs opens files (enabled=False makes every call a no-op), so the other
ranks never touch the log directory.
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy
import torch

from threefold.atomic import atomic_write
from threefold.observe.host import cpu_model, total_ram_bytes


def _jsonable(value):
    """json.dumps fallback: tensors and numpy scalars via .item(), paths and dtypes as text."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if isinstance(value, (Path, torch.dtype, torch.device)):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _finite(value):
    # NaN/inf are not JSON (json.dumps would write the bare tokens NaN/Infinity): null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _dumps(obj, **kwargs) -> str:
    # Round-trip through the fallback first so tensor scalars are floats before _finite.
    plain = json.loads(json.dumps(obj, default=_jsonable))
    return json.dumps(_finite(plain), allow_nan=False, **kwargs)


class MetricsWriter:
    """Appends one JSON object per line to <log_dir>/metrics.jsonl, flushed per line so a
    crash loses at most the line being written. Floats are written as-is, None and
    non-finite floats (NaN, inf) as null."""

    def __init__(self, log_dir: str | Path, enabled: bool, append: bool = True, tensorboard: bool = False):
        """`append=False` starts the file afresh (a new run); a resumed run appends.
        `tensorboard`: also write each line's numbers as TensorBoard scalars (observe.tensorboard)."""
        self.enabled = enabled
        self.path = Path(log_dir) / "metrics.jsonl"
        self._file = None
        self._board = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a" if append else "w", encoding="utf-8")
            if tensorboard:
                from threefold.observe.tensorboard import ScalarBoard

                self._board = ScalarBoard(self.path.parent)

    def write(self, record: dict) -> None:
        if self._file is None:
            return
        line = _dumps(record)
        self._file.write(line + "\n")
        self._file.flush()
        if self._board is not None:
            self._board.write(json.loads(line))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._board is not None:
            self._board.close()
            self._board = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def hardware_info(device: torch.device | str) -> dict:
    """Host CPU model, logical cores and RAM; device type, name and count (+ memory on cuda)."""
    device = torch.device(device)
    info = {
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "ram_bytes": total_ram_bytes(),
        "torch_threads": torch.get_num_threads(),
        "device_type": device.type,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            device_name=props.name, device_count=torch.cuda.device_count(), device_memory_bytes=props.total_memory
        )
    else:
        info.update(device_name=info["cpu_model"] if device.type == "cpu" else device.type, device_count=1)
    return info


def _versions() -> dict:
    from threefold.version import __version__ as version

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "threefold": version,
    }


def write_run_json(
    log_dir: str | Path,
    config_dict: dict,
    layout: dict,
    extra: dict | None = None,
    device: torch.device | str | None = None,
    fingerprint: dict | None = None,
) -> Path:
    """Write <log_dir>/run.json: resolved config, versions, layout, hardware, start time.

    `device` is the device the run trains on (the training loop passes its own); without one
    the hardware section describes the host CPU. `fingerprint`: this rank's stack
    (preflight/fingerprint.py), when the preflight ran.
    Written to a temp file and renamed, so a reader never sees a partial file.
    """
    if device is None:
        device = torch.device("cpu")
    doc = {
        "config": config_dict,
        "versions": _versions(),
        "layout": layout,
        "hardware": hardware_info(device),
        "start_time": datetime.now(UTC).isoformat(timespec="seconds"),
        "extra": extra or {},
    }
    if fingerprint is not None:
        doc["fingerprint"] = fingerprint
    path = Path(log_dir) / "run.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, _dumps(doc, indent=2) + "\n")
    return path


def peak_memory_bytes(device: torch.device | str) -> int:
    """Peak memory in bytes. cuda: torch's peak allocated on that device (tensors only,
    not the caching allocator's reserve). cpu: the whole process's peak resident set size
    (ru_maxrss), which includes Python, torch and data, not just tensors."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is KiB on Linux but bytes on macOS.
    return int(rss if sys.platform == "darwin" else rss * 1024)
