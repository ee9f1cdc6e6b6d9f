"""A node's memory replicas: one-file checkpoints in shared memory (distributed/host_memory.py).

    <node dir>/q00003-0/          rank 3's state at one step (slot 0; slot 1 holds the one before)
        rank00000.pt              the state: torch.save of {"name@offsets": tensor}, overwritten in place
        shards.jsonl files.idx    the checkpoint format's tables (manifest.py), for this one file
        manifest.json             step, config, layout, extra; written last, removed first

Each directory is a checkpoint of the same format as a save to storage (manifest.py: checksums,
a manifest with step and layout), so it verifies and loads through the same code (io.load_into,
manifest.verify) and into another layout by the same slicing. Its layout is the compact one of
`replica_layout` plus the producing rank and its twins (the ranks holding the same state).

The data file is written once per run in torch.save's format and then mapped MAP_SHARED: a
snapshot copies the tensors into the mapping, so the pages of the file are the host buffers
(on CUDA they are registered as pinned memory, or copied through a pinned staging buffer where
registration is refused), with no second copy and no allocation per snapshot. Two slots per
rank alternate: the one being written has no manifest, the other still holds a whole, verified
replica. A reader takes a slot only when its manifest is there and its checksum matches.
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from threefold.checkpoint.io import report_shards
from threefold.checkpoint.manifest import (
    FILES,
    MANIFEST,
    OWNED,
    OWNED_INDEX,
    SHARDS,
    CheckpointError,
    Manifest,
    build,
    file_name,
    sha256_of,
    shard_key,
    write_tables,
)
from threefold.checkpoint.state import LocalTensor

DATA = file_name(0)
SLOT = re.compile(r"q(\d{5})-([01])")


def slot_name(producer: int, slot: int) -> str:
    return f"q{producer:05d}-{slot}"


@dataclass
class Replica:
    """A published replica in this node's store (its manifest read, its data not yet verified)."""

    producer: int
    step: int
    directory: Path
    manifest: Manifest

    @property
    def twins(self) -> list[int]:
        return self.manifest.layout.get("twins", [self.producer])


def replica_layout(grid_layout, rank: int, twins: list[int]) -> dict:
    """A replica's layout: the sizes and order (O(1), not the O(world) group lists of a storage
    checkpoint's manifest), the rank that produced it and its twins."""
    keys = ("tp", "cp", "ep", "dp", "pp", "order")
    out = {k: getattr(grid_layout, k) for k in keys}
    out.update(world_size=grid_layout.world_size, rank=rank, twins=list(twins))
    return out


def same_layout(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("world_size", "tp", "cp", "ep", "dp", "pp", "order"))


class NodeStore:
    """This node's directory of replicas; `create` makes it (its parents too) once, later writes
    never recreate it, so a store wiped while a writer runs stays wiped."""

    def __init__(self, directory: Path, create: bool = True):
        self.dir = Path(directory)
        if create:
            self.dir.mkdir(parents=True, exist_ok=True)

    def slot(self, producer: int, slot: int) -> Path:
        return self.dir / slot_name(producer, slot)

    def published(self, directory: Path) -> Replica | None:
        """The replica in `directory` if its manifest is there and readable."""
        match = SLOT.fullmatch(directory.name)
        if match is None or not (directory / MANIFEST).is_file():
            return None
        try:
            manifest = Manifest.read(directory, whole=False)
        except CheckpointError:
            return None
        return Replica(int(match.group(1)), manifest.step, directory, manifest)

    def replicas(self) -> list[Replica]:
        """Every published replica on this node, newest step first."""
        if not self.dir.is_dir():
            return []
        found = [r for d in self.dir.iterdir() if (r := self.published(d)) is not None]
        return sorted(found, key=lambda r: (-r.step, r.producer))

    def free_slot(self, producer: int) -> Path:
        """The slot of `producer` to overwrite: an empty one, else the one with the older step."""
        steps = []
        for i in (0, 1):
            found = self.published(self.slot(producer, i))
            steps.append(-1 if found is None else found.step)
        return self.slot(producer, 0 if steps[0] <= steps[1] else 1)

    def wipe(self) -> None:
        """Remove the whole node directory (a clean end of the run, or a drill's lost RAM)."""
        for _ in range(3):  # a writer thread may be creating a file while the tree goes
            shutil.rmtree(self.dir, ignore_errors=True)
            if not self.dir.exists():
                return


def invalidate(directory: Path) -> None:
    """Unpublish a slot before overwriting it: the manifest first, then the tables."""
    for name in (MANIFEST, SHARDS, OWNED, OWNED_INDEX, FILES):
        (directory / name).unlink(missing_ok=True)


def publish(directory: Path, step: int, config: dict, layout: dict, extra: dict, report: dict) -> Manifest:
    """The tables and manifest of a slot whose data file is complete (`report`: its size, sha256
    and shards, as a rank reports a storage save): from here on it is a replica."""
    manifest, shards, files = build(step, config, layout, extra, [report])
    write_tables(directory, manifest, shards, files)
    return manifest


def report_of(directory: Path, tensors: list[LocalTensor], buffers: list[torch.Tensor]) -> dict:
    path = directory / DATA
    return {
        "bytes": path.stat().st_size,
        "sha256": sha256_of(path),
        "shards": report_shards(list(zip(tensors, buffers))),
    }


class MappedState:
    """A slot's data file as tensors to copy a rank's state into: written once in torch.save's
    format, then mapped MAP_SHARED, so each copy lands in the file's pages. `pinned`: the
    mapping is registered with CUDA (copies from the device go straight into it)."""

    def __init__(self, directory: Path, tensors: list[LocalTensor]):
        self.directory = directory
        self.layout = [(t.name, tuple(t.offsets), tuple(t.tensor.shape), t.tensor.dtype) for t in tensors]
        directory.mkdir(exist_ok=True)
        path = directory / DATA
        with open(path, "wb") as f:
            torch.save({shard_key(n, o): torch.zeros(s, dtype=d) for n, o, s, d in self.layout}, f)
        with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
            mapped = torch.load(path, mmap=True, weights_only=True)
        self.buffers = [mapped[shard_key(n, o)] for n, o, _, _ in self.layout]
        self.pinned = False

    def fits(self, tensors: list[LocalTensor]) -> bool:
        return self.layout == [(t.name, tuple(t.offsets), tuple(t.tensor.shape), t.tensor.dtype) for t in tensors]

    def pin(self) -> bool:
        """Register the mapping as page-locked memory for CUDA copies; False where refused."""
        if not self.buffers or not torch.cuda.is_available():
            return False
        lo = min(b.data_ptr() for b in self.buffers) // mmap.PAGESIZE * mmap.PAGESIZE
        hi = max(b.data_ptr() + b.numel() * b.element_size() for b in self.buffers)
        try:
            code = torch.cuda.cudart().cudaHostRegister(lo, hi - lo, 0)
        except (RuntimeError, AttributeError):
            return False
        self.pinned = int(code) == 0
        return self.pinned

    def release(self) -> None:
        if self.pinned:
            lo = min(b.data_ptr() for b in self.buffers) // mmap.PAGESIZE * mmap.PAGESIZE
            torch.cuda.cudart().cudaHostUnregister(lo)
            self.pinned = False
        self.buffers = []


def map_bytes(path: Path, size: int, writable: bool) -> torch.Tensor:
    """A file's bytes as a uint8 tensor over its pages (MAP_SHARED when `writable`: what is
    received into it is the file), the file made `size` bytes long first when writable."""
    if writable:
        with open(path, "ab") as f:
            f.truncate(size)
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=writable, size=size, dtype=torch.uint8)


def nbytes_of(tensors: list[LocalTensor]) -> int:
    return sum(t.tensor.numel() * t.tensor.element_size() for t in tensors)


def remove_slot(directory: Path) -> None:
    invalidate(directory)
    shutil.rmtree(directory, ignore_errors=True)


def data_size(directory: Path) -> int:
    try:
        return os.stat(directory / DATA).st_size
    except OSError:
        return 0
