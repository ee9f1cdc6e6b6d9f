"""The checkpoint format: one directory per step, one tensor file per rank, one JSON manifest.

    <root>/step_00000100/
        rank00000.pt ...      tensors this rank owns (torch.save; loaded with weights_only=True)
        manifest.json         every logical tensor: global shape, dtype, and each shard's file,
                              key and slice; every file's size and sha256; step and config
    <root>/latest             name of the newest complete checkpoint, replaced atomically

A shard is described in global coordinates (offsets and lengths per dimension, as Megatron's
ShardedTensor does), so loading into another layout is a matter of intersecting slices.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from threefold.errors import UserError

FORMAT = "threefold-checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, corrupted or does not fit the model."""


@dataclass
class Shard:
    file: str
    key: str
    offsets: list[int]
    lengths: list[int]


@dataclass
class TensorEntry:
    shape: list[int]
    dtype: str
    shards: list[Shard] = field(default_factory=list)


@dataclass
class Manifest:
    step: int
    config: dict
    layout: dict
    tensors: dict[str, TensorEntry]
    files: dict[str, dict]
    extra: dict = field(default_factory=dict)
    format: str = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(
                f"{directory}: no {MANIFEST} (not a threefold checkpoint, or an unfinished save)"
            ) from None
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{path}: unreadable manifest ({err})") from None
        if data.get("format") != FORMAT:
            raise CheckpointError(f"{path}: format {data.get('format')!r} is not {FORMAT!r}")
        tensors = {
            name: TensorEntry(e["shape"], e["dtype"], [Shard(**s) for s in e["shards"]])
            for name, e in data["tensors"].items()
        }
        return cls(data["step"], data["config"], data["layout"], tensors, data["files"], data.get("extra", {}))


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(directory: Path, manifest: Manifest) -> None:
    """Every file the manifest names exists with its recorded size and checksum."""
    for name, meta in manifest.files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{directory}: shard file {name} is missing")
        if path.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"{path}: {path.stat().st_size} bytes, manifest says {meta['bytes']}")
        if sha256_of(path) != meta["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch (file corrupted)")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Published checkpoint directories (never *.tmp ones), newest first."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and not p.name.endswith(".tmp")]
    return sorted(dirs, key=lambda p: p.name, reverse=True)
