"""Saving and loading sharded checkpoints.

Save (collective): every rank writes its tensors into `step_N.tmp/rankR.pt`, fsynced, and sends
a report of a few hundred bytes (size, sha256, its shards) to rank 0 alone (gather, not
all-gather); rank 0 writes the tables and the manifest, renames the directory to `step_N`, only
then points `latest` at it, and tells every rank the outcome (one broadcast, which is also the
barrier); it prunes old checkpoints after that, while the others go on. A crash at any moment
leaves the previous checkpoint and `latest` intact.
Load: intersect each local slice with the shards on disk (files memory-mapped, read with
weights_only=True), so any layout loads any checkpoint of the same model. The training resume
(resume.py) picks the checkpoint on rank 0 and broadcasts it; `find_resumable` and
`open_checkpoint` are the one-process versions for tools, which verify every file.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from threefold.atomic import atomic_write, fsync_dir
from threefold.checkpoint.manifest import (
    LATEST,
    MANIFEST,
    CheckpointError,
    Manifest,
    TensorEntry,
    build,
    file_name,
    list_checkpoints,
    sha256_of,
    shard_key,
    step_dir_name,
    verify,
    write_tables,
)
from threefold.checkpoint.state import LocalTensor
from threefold.distributed import comm


def snapshot(tensors: list[LocalTensor]) -> list[tuple[LocalTensor, torch.Tensor]]:
    """This rank's tensors to write, on the host, for a synchronous save: CPU tensors in place
    (nothing changes them before the write ends), others copied down."""
    return [(t, t.tensor.detach().to("cpu").contiguous()) for t in tensors if t.write]


class HostSnapshot:
    """Host copies of this rank's tensors for an asynchronous save, which must not see the next
    optimizer step. The buffers are allocated at the first save and kept while the tensors keep
    their shapes, dtypes and devices (one allocation per run, not a clone of the state per save).
    Where a tensor lives on an accelerator its buffer is pinned, so every copy is enqueued
    non-blocking on the current stream behind the step that produced the values, and one sync
    per device ends the snapshot; on CPU a buffer is plain memory and the copy a memcpy.
    take() overwrites the buffers: the write of the previous snapshot must have finished
    (Checkpointer.save waits for it first)."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []
        self._layout: list[tuple] = []

    def take(self, tensors: list[LocalTensor]) -> list[tuple[LocalTensor, torch.Tensor]]:
        writes = [t for t in tensors if t.write]
        layout = [(tuple(t.tensor.shape), t.tensor.dtype, t.tensor.device) for t in writes]
        if layout != self._layout:
            self.buffers = [
                torch.empty(shape, dtype=dtype, device="cpu", pin_memory=device.type != "cpu")
                for shape, dtype, device in layout
            ]
            self._layout = layout
        with torch.no_grad():
            for buffer, t in zip(self.buffers, writes):
                buffer.copy_(t.tensor, non_blocking=True)
        for device in {device for _, _, device in layout if device.type != "cpu"}:
            torch.accelerator.synchronize(device)
        return list(zip(writes, self.buffers))


def save(
    root: str | Path,
    step: int,
    tensors: list[LocalTensor],
    config: dict,
    layout: dict,
    extra: dict | None = None,
    keep: int = 0,
    group: comm.Group | None = None,
) -> Path | None:
    """Write a checkpoint of `step` (collective over `group`, None = the job's default group);
    returns its directory on rank 0."""
    return write(root, step, snapshot(tensors), config, layout, extra, keep, group)


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
    report = write_shards(root, step, shards, group.rank)
    return publish(root, step, report, config, layout, extra, keep, group)


def write_shards(root: str | Path, step: int, shards: list[tuple[LocalTensor, torch.Tensor]], rank: int) -> dict:
    """This rank's file of `step` (fsynced) and its report for rank 0; no communication, so an
    asynchronous save runs it in a background thread. A failure becomes {"error": ...}: the
    metadata round then fails on every rank instead of leaving the others waiting."""
    try:
        tmp = Path(root) / (step_dir_name(step) + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)  # every rank: no barrier before writing
        path = tmp / file_name(rank)
        with open(path, "wb") as f:
            torch.save({shard_key(t.name, t.offsets): host for t, host in shards}, f)
            f.flush()
            os.fsync(f.fileno())
        return {"bytes": path.stat().st_size, "sha256": sha256_of(path), "shards": report_shards(shards)}
    except (OSError, RuntimeError) as err:
        return {"error": f"rank {rank}: {err}"}


def report_shards(shards: list[tuple[LocalTensor, torch.Tensor]]) -> list[tuple]:
    """(name, global shape, dtype, offsets, lengths) of every tensor a rank wrote."""
    return [
        (t.name, tuple(t.global_shape), str(host.dtype).replace("torch.", ""), tuple(t.offsets), tuple(t.lengths))
        for t, host in shards
    ]


def publish(
    root: str | Path,
    step: int,
    report: dict,
    config: dict,
    layout: dict,
    extra: dict | None,
    keep: int,
    group: comm.Group,
) -> Path | None:
    """The metadata round of a save, collective over `group` (on the caller's thread: object
    collectives on NCCL use the current device): every report to rank 0 (O(world) bytes there,
    O(1) on the others), rank 0 publishes, one broadcast of the outcome; a failure on any rank
    raises the same CheckpointError on every rank. Rank 0 prunes after the broadcast."""
    root = Path(root)
    final = root / step_dir_name(step)
    reports = comm.gather_objects(report, group)
    outcome = None
    if group.rank == 0:
        failed = [r["error"] for r in reports if "error" in r]
        try:
            outcome = failed[0] if failed else _publish(root, final, step, reports, config, layout, extra or {})
        except (OSError, CheckpointError) as err:
            outcome = f"rank 0: {err}"
    outcome = comm.broadcast_object(outcome, group)
    if outcome is not None:
        raise CheckpointError(f"{final}: not saved: {outcome}")
    if group.rank == 0:
        _prune(root, keep)
        return final
    return None


def _publish(root: Path, final: Path, step: int, reports, config, layout, extra) -> None:
    """Rank 0: tables and manifest into the temporary directory, rename, then `latest`."""
    tmp = final.with_name(final.name + ".tmp")
    manifest, shards, files = build(step, config, layout, extra, reports)
    expected = {file_name(n) for n in range(len(reports))}
    for leftover in tmp.iterdir():  # of a save that crashed, e.g. with more ranks
        if leftover.name not in expected:
            leftover.unlink()
    write_tables(tmp, manifest, shards, files)
    if final.exists():  # an older save of the same step (e.g. after a rollback)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    atomic_write(root / LATEST, final.name + "\n")


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


def check_fit(t: LocalTensor, entry: TensorEntry | None, directory: Path) -> None:
    """The checkpoint has the tensor `t` is a slice of, with its global shape."""
    if entry is None:
        raise CheckpointError(f"{directory}: has no tensor {t.name!r} (a checkpoint of another model?)")
    if tuple(entry.shape) != tuple(t.global_shape):
        raise CheckpointError(
            f"{directory}: {t.name} has shape {tuple(entry.shape)}, this model needs {tuple(t.global_shape)}"
        )


def _overlap(shard, t: LocalTensor) -> tuple[list[int], list[int]] | None:
    """The global box where a shard and a local slice meet (None when they do not)."""
    lo = [max(a, b) for a, b in zip(shard.offsets, t.offsets)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(shard.offsets, shard.lengths, t.offsets, t.lengths)]
    return None if any(h <= low for low, h in zip(lo, hi)) else (lo, hi)


def files_read_by(tensors: list[LocalTensor], directory: Path, manifest: Manifest) -> set[str]:
    """The shard files the slices `tensors` are loaded from (reads their shard lines only)."""
    manifest.read_shards(directory, [t.name for t in tensors])
    files = set()
    for t in tensors:
        entry = manifest.tensors.get(t.name)
        check_fit(t, entry, directory)
        files.update(s.file for s in entry.shards if _overlap(s, t) is not None)
    return files


def load_into(tensors: list[LocalTensor], directory: Path, manifest: Manifest) -> None:
    """Fill every local slice from the overlapping shards on disk."""
    manifest.read_shards(directory, [t.name for t in tensors])
    cache: dict[str, dict] = {}
    for t in tensors:
        entry = manifest.tensors.get(t.name)
        check_fit(t, entry, directory)
        filled = 0
        for shard in entry.shards:
            box = _overlap(shard, t)
            if box is None:
                continue
            lo, hi = box
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
    return write(root, step, snapshot(whole), config, layout, extra, group=comm.Group("self", [0], None))
