"""Measured trials kept between tunes, keyed by what decides a trial's speed: the model and the
run's fixed settings, the cluster (devices, host) and the software versions.

    <cache>/<key>/key.json         what the key is made of (to say why an old entry is not reused)
    <cache>/<key>/trials.jsonl     one line per finished trial: name, status, measurement
    <cache>/<key>/runs/<name>/     the trial's run.json, metrics.jsonl, spans.jsonl (recalibration)

A tune with the same key starts warm: cached candidates are not run again, and their runs
calibrate the planner from the first choice. A different torch or threefold version gives a new
key, so old measurements are never mixed into a new software stack's model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import shutil
from pathlib import Path

from threefold.config import Config
from threefold.planner.tune.trials import TrialResult

RUN_FILES = ("run.json", "metrics.jsonl", "spans.jsonl", "trial.toml")


def default_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "threefold" / "tune"


def host_description(cfg: Config) -> dict:
    """The cluster part of the key: device kind and name, processes, host CPU and cores."""
    import torch

    device = cfg.train.device
    on_gpu = device not in ("cpu",) and torch.cuda.is_available()
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "devices_per_node": cfg.parallel.devices_per_node,
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
    }


def key_parts(cfg: Config, world: int, steps: int) -> dict:
    import torch

    from threefold.version import __version__

    model = cfg.to_dict()["model"]
    t = cfg.train
    return {
        "model": model,
        "run": {
            "world": world,
            "global_batch": t.global_batch,
            "dtype": t.dtype,
            "device": t.device,
            "steps": steps,
            "grad_reduce_dtype": t.grad_reduce_dtype,
            "bucket_mb": getattr(cfg.parallel, "bucket_mb", None),
            "compile": getattr(t, "compile", None),
        },
        "cluster": host_description(cfg),
        "versions": {
            "threefold": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    }


def key_of(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


class TuneCache:
    """One key's directory; `root` None: a cache that remembers nothing."""

    def __init__(self, root: Path | None, parts: dict):
        self.parts, self.key = parts, key_of(parts)
        self.dir = None if root is None else Path(root) / self.key
        self.note = ""
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "key.json").write_text(
                json.dumps(parts, indent=1, sort_keys=True, default=str), encoding="utf-8"
            )
            self.note = self._invalidated(Path(root))

    def _invalidated(self, root: Path) -> str:
        """A sentence when an entry for this model and cluster exists under other versions."""
        stale = 0
        for other in root.glob("*/key.json"):
            if other.parent == self.dir:
                continue
            try:
                theirs = json.loads(other.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            same = all(
                theirs.get(k) == json.loads(json.dumps(self.parts[k], default=str)) for k in ("model", "run", "cluster")
            )
            if same and theirs.get("versions") != self.parts["versions"]:
                stale += (
                    sum(1 for _ in (other.parent / "trials.jsonl").open())
                    if (other.parent / "trials.jsonl").is_file()
                    else 0
                )
        if not stale:
            return ""
        v = self.parts["versions"]
        return (
            f"cache: {stale} trial(s) of this model and cluster were measured under other software versions "
            f"and are not reused (now threefold {v['threefold']}, torch {v['torch']})"
        )

    def load(self) -> dict[str, TrialResult]:
        if self.dir is None or not (self.dir / "trials.jsonl").is_file():
            return {}
        out = {}
        for line in (self.dir / "trials.jsonl").read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                result = TrialResult.from_dict(entry["name"], entry)
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line of a tune that was killed
            if result.status == "ok" and not (Path(result.path) / "metrics.jsonl").is_file():
                continue
            out[result.name] = result
        return out

    def add(self, result: TrialResult) -> TrialResult:
        """Keep `result` (its run files copied into the cache); returns it pointing at the copy."""
        if self.dir is None:
            return result
        kept = dataclasses.replace(result, categories=dict(result.categories))
        if result.status == "ok":
            dest = self.dir / "runs" / result.name
            dest.mkdir(parents=True, exist_ok=True)
            for name in RUN_FILES:
                src = Path(result.path) / name
                if src.is_file():
                    shutil.copyfile(src, dest / name)
            kept.path = str(dest)
        with (self.dir / "trials.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps({"name": kept.name, **kept.as_dict()}) + "\n")
        return kept
