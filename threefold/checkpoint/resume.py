"""Which checkpoint a job resumes from: chosen once, verified where it is read, the same on every rank.

    found = choose(state, grid.world, root=cfg.checkpoint.dir)     # newest that verifies, or None
    found = choose(state, grid.world, path=cfg.checkpoint.resume)  # that one, or an error everywhere

The group's first rank lists the candidates and reads the small manifest (and checks the shard
and file tables: O(world) bytes, once per resume); one broadcast gives every rank the directory
and the manifest. Each rank then reads the owned lines of the files its slices come from (or,
resharding, the shard lines of the tensors it holds) and hashes only those files. One all-reduce
tells whether any rank failed, and the first failing rank's message is broadcast, so every rank
skips the same checkpoint (with `root`) or raises the same error line: no rank decides alone,
so ranks cannot start at different steps.
"""

from __future__ import annotations

from pathlib import Path

import torch

from threefold.checkpoint.io import files_read_by
from threefold.checkpoint.manifest import MANIFEST, CheckpointError, Manifest, list_checkpoints, verify, verify_index
from threefold.checkpoint.state import LocalTensor
from threefold.distributed import comm
from threefold.distributed.runtime import patient


def choose(
    tensors: list[LocalTensor],
    group: comm.Group,
    root: str | Path | None = None,
    path: str | Path | None = None,
    warn=print,
    at_most: int | None = None,
) -> tuple[Path, Manifest] | None:
    """The checkpoint to load `tensors` (this rank's slices) from; collective over `group` (the
    world, on the run's device). `root`: its newest checkpoint that verifies on every rank, or
    None (`at_most`: of step at most that). `path`: that checkpoint directory, or the newest under
    that root; CheckpointError on every rank when it is not there or does not verify. `warn`
    reports skipped checkpoints. The ranks wait for each other under the group's long deadline
    (distributed/runtime.py): rank 0 lists and reads the candidates, each rank hashes its files."""
    with patient(group):
        return _choose(tensors, group, root, path, warn, at_most)


def _choose(
    tensors: list[LocalTensor], group: comm.Group, root, path, warn, at_most: int | None
) -> tuple[Path, Manifest] | None:
    skipped: set[str] = set()
    while True:
        pick = None
        if group.rank == 0:
            try:
                pick = _pick(Path(path or root), path is not None, skipped, warn, at_most)
            except (CheckpointError, OSError) as err:
                pick = ("error", str(err))
        pick = comm.broadcast_object(pick, group)
        if pick[0] == "error":
            raise CheckpointError(pick[1])
        if pick[0] == "none":
            return None
        _, directory, manifest, may_skip = pick
        directory = Path(directory)
        error, fatal = _agree(_check_mine(tensors, directory, manifest), group)
        if error is None:
            return directory, manifest
        if fatal or not may_skip:
            raise CheckpointError(error)
        warn(f"threefold: skipping checkpoint {directory.name}: {error}")
        skipped.add(directory.name)


def _pick(target: Path, named: bool, skipped: set[str], warn, at_most: int | None = None) -> tuple:
    """Rank 0: ("ok", directory, manifest without tables, may skip), ("none",) or ("error", line)."""
    if named:
        if not target.exists():
            return ("error", f"{target}: no such checkpoint directory")
        if (target / MANIFEST).exists():
            manifest = Manifest.read(target, whole=False)
            verify_index(target, manifest)
            return ("ok", str(target), manifest, False)
    for directory in list_checkpoints(target):
        if directory.name in skipped:
            continue
        try:
            manifest = Manifest.read(directory, whole=False)
            if at_most is not None and manifest.step > at_most:
                continue
            verify_index(directory, manifest)
            return ("ok", str(directory), manifest, True)
        except CheckpointError as err:
            warn(f"threefold: skipping checkpoint {directory.name}: {err}")
    if named:
        return ("error", f"{target}: neither a checkpoint nor a directory holding one")
    return ("none",)


def _check_mine(tensors: list[LocalTensor], directory: Path, manifest: Manifest) -> tuple[str, bool] | None:
    """This rank's verdict: None, or (error line, fatal). A checkpoint of another model is fatal
    (an older one will not fit either); a missing or corrupted file is not."""
    try:
        manifest.read_for(directory, tensors)
    except CheckpointError as err:
        return str(err), False
    try:
        files = files_read_by(tensors, directory, manifest)
    except CheckpointError as err:
        return str(err), True
    try:
        verify(directory, manifest, files)
    except CheckpointError as err:
        return str(err), False
    except OSError as err:
        return f"{directory}: {err}", False
    return None


def _agree(mine: tuple[str, bool] | None, group: comm.Group) -> tuple[str | None, bool]:
    """The first failing rank's verdict on every rank: an all-reduce of one number, then (only
    when some rank failed) one broadcast from that rank."""
    device = group.device or torch.device("cpu")
    first = torch.tensor([group.size - group.rank if mine else 0], dtype=torch.int64, device=device)
    first = int(comm.all_reduce_max(first, group).item())
    if first == 0:
        return None, False
    return comm.broadcast_object(mine, group, src=group.size - first)
