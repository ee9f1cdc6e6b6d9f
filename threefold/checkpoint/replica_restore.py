"""A restart from memory replicas: which step every rank can load, and from where (collective).

    found = restore(replicas, state, wanted, storage_root)   # (directory, manifest) or None

1. One MAX all-reduce of three numbers: whether any rank restarts (or resumes), the world size
   of the replicas on any node, and the newest storage checkpoint's step (rank 0 lists the
   directory names; it opens nothing).
2. One MAX all-reduce over the replicas' ranks: the newest step each one's state is held at on
   some node. The step s is the oldest of those; when some rank's state is held nowhere, or
   storage holds a newer step, the answer is None (storage: checkpoint/resume.py).
3. One MAX all-reduce over the replicas' ranks: a rank holding each one's state at step s,
   and whether the replicas' layout differs from the run's.
4. Same layout: each rank loads its own state, from its node or, when the node lost it (a
   replacement node, a worker moved to another node), from the holder: one MAX all-reduce of
   who needs a copy, then the copies point to point (sizes, then files). Another layout (a
   shrunk or re-planned job): every holder's replica reports are all-gathered once, each rank
   builds the checkpoint they form together (manifest.py's format, each tensor's shards as the
   storage save would write them) and fetches the files its slices overlap, then loads through
   the same slicing as a storage checkpoint (io.load_into).
5. Every rank verifies the files it loads (size and sha256, as for storage) and one all-reduce
   says whether all did; if one did not, every rank goes to storage.

Steps 2-4 send O(world) numbers per rank once per restart (16,384 ranks: 128 KB); snapshots
themselves cost no rank anything that grows with the world.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from threefold.checkpoint.io import files_read_by
from threefold.checkpoint.manifest import (
    FILES,
    FORMAT,
    MANIFEST,
    OWNED,
    OWNED_INDEX,
    SHARDS,
    CheckpointError,
    Manifest,
    Shard,
    TensorEntry,
    file_name,
    list_checkpoints,
    step_dir_name,
    verify,
)
from threefold.checkpoint.replica_store import DATA, Replica, invalidate, map_bytes, same_layout
from threefold.distributed import comm
from threefold.distributed.runtime import patient

TABLES = (SHARDS, OWNED, OWNED_INDEX, FILES, MANIFEST)
"""A replica's tables, sent with its data file (the manifest, which indexes and checksums the
others, last: every table it names must come with it)."""


def restore(replicas, state, wanted: bool, storage_root: str, warn=print) -> tuple[Path, Manifest] | None:
    """The replica set every rank loads from, fetched and verified: (directory, manifest) of
    this rank's part, or None (nothing to restore, or storage must be read)."""
    world = replicas.grid.world
    with patient(world):
        return _restore(replicas, state, world, wanted, storage_root, warn)


def _numbers(values: list[int], world, device) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64, device=device)
    return comm.all_reduce_max(t, world).tolist()


def _storage_step(root: str) -> int:
    """The newest storage checkpoint's step from its directory name (-1: none); opens nothing."""
    found = list_checkpoints(Path(root)) if root else []
    return int(found[0].name.removeprefix("step_")) if found else -1


def _restore(replicas, state, world, wanted, storage_root, warn):
    device = world.device or torch.device("cpu")
    rank, store = world.rank, replicas.store
    mine = store.replicas()
    old_world = max((r.manifest.layout.get("world_size", 0) for r in mine), default=0)
    storage = _storage_step(storage_root) if rank == 0 else -1
    anyone, old_world, storage = _numbers([int(wanted), old_world, storage], world, device)
    replicas.wanted_anywhere = bool(anyone)
    if not anyone or not old_world:
        return None
    mine = [r for r in mine if r.manifest.layout.get("world_size") == old_world]
    newest = [0] * old_world
    for r in mine:
        for q in r.twins:
            newest[q] = max(newest[q], r.step + 1)
    newest = _numbers(newest, world, device)
    if min(newest) == 0:
        lost = [q for q, n in enumerate(newest) if n == 0]
        warn(f"threefold: memory replicas: no copy of rank {lost[0]}'s state on any node; reading storage")
        return None
    step = min(newest) - 1
    if storage > step:
        warn(f"threefold: memory replicas hold step {step}, storage step {storage}: reading storage")
        return None
    at_step = [r for r in mine if r.step == step]
    current = replicas.layout
    differs = any(not same_layout(r.manifest.layout, current) for r in at_step)
    holder = [0] * old_world + [int(differs)]
    for r in at_step:
        for q in r.twins:
            holder[q] = rank + 1
    holder = _numbers(holder, world, device)
    if min(holder[:old_world]) == 0:
        warn(f"threefold: memory replicas: no node holds every rank's state at step {step}; reading storage")
        return None
    if holder[old_world] or old_world != world.size:
        found = _resharded(replicas, state, world, device, step, at_step, holder[:old_world])
    else:
        found = _same_layout(replicas, world, device, step, at_step, holder)
    error = None
    try:
        directory, manifest, files = found
        verify(directory, manifest, files)
    except (CheckpointError, OSError) as err:
        error = str(err)
    failed = _numbers([rank + 1 if error else 0], world, device)[0]
    if failed:
        # The failing rank says why; the others (the logger among them) say which rank failed.
        why = f" ({error})" if failed == rank + 1 else ""
        warn(f"threefold: rank {failed - 1}'s memory replicas of step {step} do not verify{why}; reading storage")
        return None
    return found[0], found[1]


def _covering(replicas: list[Replica], q: int) -> Replica | None:
    return next((r for r in replicas if q in r.twins), None)


def _same_layout(replicas, world, device, step, at_step, holder):
    """Each rank's own state: from its node, else copied from a node that holds it."""
    rank = world.rank
    local = _covering(at_step, rank)
    need = [0] * world.size
    need[rank] = int(local is None)
    need = _numbers(need, world, device)
    pairs = [(holder[r] - 1, r, r) for r in range(world.size) if need[r]]
    received = _transfer(replicas, world, device, pairs, at_step)
    directory = local.directory if local is not None else received[rank]
    manifest = Manifest.read(directory)
    return directory, manifest, None


def _resharded(replicas, state, world, device, step, at_step, holder):
    """Another layout: the checkpoint all replicas form, and the files this rank's slices need."""
    rank = world.rank
    mine = {}
    for q, h in enumerate(holder):
        if h == rank + 1:
            r = _covering(at_step, q)
            cls = min(r.twins)
            if cls not in mine:
                mine[cls] = _tables(r.directory)
    reports = {}
    for part in comm.all_gather_objects(mine, world):
        reports.update(part)
    manifest = _combined(step, reports)
    directory = replicas.store.dir / step_dir_name(step)
    directory.mkdir(exist_ok=True)
    needed = sorted(files_read_by(state, directory, manifest))
    missing = []
    for name in needed:
        cls = int(name.removeprefix("rank").removesuffix(".pt"))
        r = _covering(at_step, cls)
        if r is None:
            missing.append(cls)
        else:
            _link(directory / name, r.directory / DATA)
    pairs = []
    for needer, wants in enumerate(comm.all_gather_objects(missing, world)):
        pairs += [(holder[cls] - 1, needer, cls) for cls in wants]
    for cls, path in _transfer(replicas, world, device, pairs, at_step).items():
        _link(directory / file_name(cls), path / DATA)
    return directory, manifest, needed


def _link(path: Path, target: Path) -> None:
    path.unlink(missing_ok=True)
    os.symlink(target, path)


def _tables(directory: Path) -> dict:
    return {name: (directory / name).read_text() for name in TABLES}


def _combined(step: int, tables_of: dict[int, dict]) -> Manifest:
    """The checkpoint the replicas form: each class's file as rank{class}.pt, each tensor's
    shards those the storage save writes (the class's `canonical` keys): no two overlap."""
    tensors: dict[str, TensorEntry] = {}
    files, first = {}, None
    for cls in sorted(tables_of):
        tables = tables_of[cls]
        head = json.loads(tables[MANIFEST])
        first = first or head
        canonical = set(head["extra"].get("canonical", []))
        size, sha = tables[FILES].split()
        files[file_name(cls)] = {"bytes": int(size), "sha256": sha}
        for name, entry in head["tensors"].items():
            offset, length = entry["at"]
            rows = json.loads(tables[SHARDS].encode()[offset : offset + length])
            target = tensors.setdefault(name, TensorEntry(entry["shape"], entry["dtype"], []))
            for _, offsets, lengths in rows:
                key = f"{name}@{','.join(map(str, offsets))}"
                if key in canonical:
                    target.shards.append(Shard(file_name(cls), key, offsets, lengths))
    extra = {k: v for k, v in first["extra"].items() if k != "canonical"}
    manifest = Manifest(step, first["config"], first["layout"], tensors, files, extra, FORMAT, 0)
    manifest.count = max(tables_of) + 1
    return manifest


def _transfer(replicas, world, device, pairs, at_step) -> dict[int, Path]:
    """Copies of replicas between ranks: `pairs` (holder, needer, rank whose state) the same on
    every rank. Sizes go first, then the three tables and the file; a needer keeps what it
    receives in its node's store (a replica from then on). Returns {state's rank: directory}."""
    rank, store = world.rank, replicas.store
    out_msgs, out_ops, in_heads = [], [], {}
    for holder, needer, q in pairs:
        if holder == rank:
            r = _covering(at_step, q)
            text = json.dumps(_tables(r.directory)).encode()
            size = (r.directory / DATA).stat().st_size
            out_msgs.append((needer, text, r.directory / DATA, size))
            out_ops.append(("send", torch.tensor([len(text), size], dtype=torch.int64, device=device), needer))
        if needer == rank:
            in_heads[(holder, q)] = torch.zeros(2, dtype=torch.int64, device=device)
    ops = out_ops + [("recv", t, holder) for (holder, _), t in in_heads.items()]
    comm.wait_all(comm.batch_send_recv(ops, world), world)
    ops, received = [], {}
    for needer, text, path, size in out_msgs:
        ops.append(("send", torch.frombuffer(bytearray(text), dtype=torch.uint8).to(device), needer))
        ops.append(("send", map_bytes(path, size, False).to(device), needer))
    for (holder, q), head in in_heads.items():
        length, size = (int(v) for v in head.tolist())
        received[(holder, q)] = (
            torch.empty(length, dtype=torch.uint8, device=device),
            torch.empty(size, dtype=torch.uint8, device=device),
        )
        ops += [("recv", t, holder) for t in received[(holder, q)]]
    comm.wait_all(comm.batch_send_recv(ops, world), world)
    out = {}
    for (_, q), (text, data) in received.items():
        target = store.free_slot(q)
        invalidate(target)
        target.mkdir(parents=True, exist_ok=True)
        mapped = map_bytes(target / DATA, data.numel(), True)
        mapped.copy_(data.cpu())
        tables = json.loads(bytes(text.cpu().numpy()))
        for name in TABLES:  # the manifest last: a replica from here on
            (target / name).write_text(tables[name])
        out[q] = target
    return out
