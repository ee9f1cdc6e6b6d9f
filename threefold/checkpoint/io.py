"""Saving and loading sharded checkpoints (collective over all ranks).

Save: every rank writes its tensors into `step_N.tmp/`, fsynced, and reports sizes and
checksums; rank 0 writes the manifest, renames the directory to `step_N` and only then points
`latest` at it. A crash at any moment leaves the previous checkpoint and `latest` intact.
Load: intersect each local slice with the shards on disk (files memory-mapped, read with
weights_only=True), so any layout loads any checkpoint of the same model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from threefold.checkpoint.manifest import (
    LATEST,
    MANIFEST,
    CheckpointError,
    Manifest,
    Shard,
    TensorEntry,
    fsync_dir,
    list_checkpoints,
    sha256_of,
    step_dir_name,
    verify,
    write_atomic,
)
from threefold.checkpoint.state import LocalTensor
from threefold.distributed import comm


def snapshot(tensors: list[LocalTensor], copy: bool) -> list[tuple[LocalTensor, torch.Tensor]]:
    """This rank's tensors to write, on the host. `copy=True` clones them (an async save must
    not see the next optimizer step); a synchronous save writes CPU tensors in place."""
    out = []
    for t in tensors:
        if t.write:
            host = t.tensor.detach().to("cpu", copy=copy)
            out.append((t, host.contiguous()))
    return out


def save(
    root: str | Path,
    step: int,
    tensors: list[LocalTensor],
    config: dict,
    layout: dict,
    extra: dict | None = None,
    keep: int = 0,
) -> Path | None:
    """Write a checkpoint of `step` (collective over the job's default group); returns its
    directory on rank 0."""
    return write(root, step, snapshot(tensors, copy=False), config, layout, extra, keep)


def write(
    root: str | Path,
    step: int,
    shards: list[tuple[LocalTensor, torch.Tensor]],
    config: dict,
    layout: dict,
    extra: dict | None = None,
    keep: int = 0,
    group: comm.Group | None = None,
) -> Path | None:
    """Write, verify and publish a snapshot: collective over `group` (None = the job's default
    group); returns the published directory on rank 0."""
    group = group or comm.job_group()
    root, rank = Path(root), group.rank
    final, tmp = root / step_dir_name(step), root / (step_dir_name(step) + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that crashed
        tmp.mkdir(parents=True)
    comm.barrier(group)
    file = f"rank{rank:05d}.pt"
    # A rank may hold several rectangles of one tensor (ZeRO cuts anywhere): key by name and offsets.
    key = {id(t): f"{t.name}@{','.join(map(str, t.offsets))}" for t, _ in shards}
    mine = {key[id(t)]: host for t, host in shards}
    path = tmp / file
    with open(path, "wb") as f:
        torch.save(mine, f)
        f.flush()
        os.fsync(f.fileno())
    report = {
        "file": file,
        "bytes": path.stat().st_size,
        "sha256": sha256_of(path),
        "tensors": [
            (
                t.name,
                key[id(t)],
                list(t.global_shape),
                str(host.dtype).replace("torch.", ""),
                list(t.offsets),
                list(t.lengths),
            )
            for t, host in shards
        ],
    }
    reports = comm.all_gather_objects(report, group)
    if rank == 0:
        entries: dict[str, TensorEntry] = {}
        for r in reports:
            for name, file_key, shape, dtype, offsets, lengths in r["tensors"]:
                entry = entries.setdefault(name, TensorEntry(shape, dtype))
                entry.shards.append(Shard(r["file"], file_key, offsets, lengths))
        files = {r["file"]: {"bytes": r["bytes"], "sha256": r["sha256"]} for r in reports}
        manifest = Manifest(step, config, layout, entries, files, extra or {})
        write_atomic(tmp / MANIFEST, manifest.to_json())
        if final.exists():  # an older save of the same step (e.g. after a rollback)
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        write_atomic(root / LATEST, final.name + "\n")
        _prune(root, keep)
    comm.barrier(group)
    return final if rank == 0 else None


def _prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints (0 = all); the one `latest` names always stays."""
    if keep <= 0:
        return
    latest = (root / LATEST).read_text().strip()
    for old in list_checkpoints(root)[keep:]:
        if old.name != latest:
            shutil.rmtree(old, ignore_errors=True)


def find_resumable(root: str | Path, warn=print) -> tuple[Path, Manifest] | None:
    """The newest complete, verified checkpoint under `root` (a corrupted one is reported and
    skipped), or None when there is none."""
    root = Path(root)
    for directory in list_checkpoints(root):
        try:
            manifest = Manifest.read(directory)
            verify(directory, manifest)
            return directory, manifest
        except CheckpointError as err:
            warn(f"threefold: skipping checkpoint {directory.name}: {err}")
    return None


def open_checkpoint(path: str | Path) -> tuple[Path, Manifest]:
    """A named checkpoint directory (or a root whose newest checkpoint is taken), verified."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if (path / MANIFEST).exists():
        manifest = Manifest.read(path)
        verify(path, manifest)
        return path, manifest
    found = find_resumable(path)
    if found is None:
        raise CheckpointError(f"{path}: neither a checkpoint nor a directory holding one")
    return found


def load_into(tensors: list[LocalTensor], directory: Path, manifest: Manifest) -> None:
    """Fill every local slice from the overlapping shards on disk."""
    cache: dict[str, dict] = {}
    for t in tensors:
        entry = manifest.tensors.get(t.name)
        if entry is None:
            raise CheckpointError(f"{directory}: has no tensor {t.name!r} (a checkpoint of another model?)")
        if tuple(entry.shape) != tuple(t.global_shape):
            raise CheckpointError(
                f"{directory}: {t.name} has shape {tuple(entry.shape)}, this model needs {tuple(t.global_shape)}"
            )
        filled = 0
        for shard in entry.shards:
            lo = [max(a, b) for a, b in zip(shard.offsets, t.offsets)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(shard.offsets, shard.lengths, t.offsets, t.lengths)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            if shard.file not in cache:
                path = directory / shard.file
                cache[shard.file] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            src = cache[shard.file][shard.key][tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, shard.offsets))]
            dst = t.tensor[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, t.offsets))]
            with torch.no_grad():
                dst.copy_(src)
            filled += src.numel()
        if filled != t.tensor.numel():
            raise CheckpointError(f"{directory}: shards of {t.name} cover {filled} of {t.tensor.numel()} elements")


def save_whole(
    root: str | Path, step: int, tensors: dict[str, torch.Tensor], config: dict, layout: dict, extra: dict | None = None
) -> Path:
    """Whole (unsharded) tensors as a one-file checkpoint written by this process alone, through
    the same write and atomic publish as a training save: an imported model is then an ordinary
    checkpoint that any layout loads by slicing."""
    whole = [LocalTensor(name, t, tuple(t.shape), (0,) * t.dim(), True) for name, t in tensors.items()]
    return write(root, step, snapshot(whole, copy=False), config, layout, extra, group=comm.Group("self", [0], None))
