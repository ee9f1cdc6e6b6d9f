"""In-memory checkpoint replicas: every rank's whole state in host RAM, with a copy on another node.

    replicas = MemoryReplicas.build(cfg, grid, state, device)   # every rank; None when off
    blocked_s = replicas.snapshot(step, extra)   # every checkpoint.memory_interval steps
    found = replicas.restore(state, wanted, storage_root)   # at start-up: replica_restore.py
    replicas.finish()                            # a clean end: the node's copies are removed

A snapshot copies this rank's tensors (all of them, the slices it would not write to storage
too, so the rank reloads from its own copy alone) into a slot of its node's store
(replica_store.py: shared memory that outlives the worker). That copy is what the loop waits for;
a background thread then checksums the file, publishes the slot's manifest and exchanges copies
with the buddies over a two-rank gloo group per pair (torch.distributed, through comm.py, made
with local synchronisation: O(1) per rank), so training goes on meanwhile.

Who keeps a copy of whom (`plan_buddies`): a rank's twins are the ranks that hold the same whole
state (the dp and cp replicas under ZeRO 0 without experts). When twins already sit on two or
more nodes, their own snapshots are the copies and nothing is sent (replication along dp). Else
the lowest twin of the node sends its snapshot to the rank with its local index on the next node
(a ring over nodes), so no node holds both copies of a state. Per rank and snapshot that is one
host copy of its state, one checksum, and at most one state sent and one received (about one
more when nodes are unevenly filled): none of it grows with the world.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from threefold.checkpoint.manifest import CheckpointError, sha256_of, shard_key
from threefold.checkpoint.replica_store import (
    DATA,
    MappedState,
    NodeStore,
    data_size,
    invalidate,
    map_bytes,
    nbytes_of,
    publish,
    remove_slot,
    replica_layout,
    report_of,
)
from threefold.checkpoint.state import LocalTensor
from threefold.distributed import comm
from threefold.distributed.host_memory import collect_dead, node_dir, run_root


@dataclass(frozen=True)
class BuddyPlan:
    """Where this rank's snapshot has its second copy."""

    twins: tuple[int, ...]
    """The ranks holding this rank's whole state, itself included."""
    send_to: int | None
    """The rank on another node that keeps a copy of this rank's snapshot (None: no transfer)."""
    receive_from: tuple[int, ...]
    """The ranks whose snapshots this rank keeps a copy of."""
    note: str
    """Where the second copy is, in words."""


def plan_buddies(rank: int, world: int, per_node: int, twins_of, copies: int = 1) -> BuddyPlan:
    """This rank's part of the replica plan. `twins_of(r)`: the ranks holding rank r's whole
    state (sorted, r included); `per_node`: ranks per node (node of r = r // per_node)."""
    nodes = -(-world // per_node)
    node = lambda r: r // per_node  # noqa: E731

    def size(n: int) -> int:
        return min(per_node, world - n * per_node)

    def sends(r: int) -> bool:
        twins = twins_of(r)
        if copies < 1 or nodes < 2 or len({node(t) for t in twins}) > 1:
            return False
        return r == min(t for t in twins if node(t) == node(r))

    def buddy(r: int) -> int:
        nxt = (node(r) + 1) % nodes
        return nxt * per_node + (r % per_node) % size(nxt)

    twins = tuple(twins_of(rank))
    send_to = buddy(rank) if sends(rank) else None
    previous = (node(rank) - 1) % nodes
    senders = (
        tuple(
            r for r in range(previous * per_node, previous * per_node + size(previous)) if sends(r) and buddy(r) == rank
        )
        if nodes > 1
        else ()
    )
    if copies < 1:
        note = "no copy on another node (checkpoint.replicas 0)"
    elif nodes < 2:
        note = "no copy on another node: the run has one node (a restarted worker still finds its own)"
    elif send_to is not None:
        note = f"copy on rank {send_to} (node {node(send_to)})"
    elif len({node(t) for t in twins}) > 1:
        note = f"dp twins on nodes {sorted({node(t) for t in twins})} hold the same state"
    else:
        note = f"rank {min(t for t in twins if node(t) == node(rank))} sends this node's copy"
    return BuddyPlan(twins, send_to, senders, note)


def twins_for(cfg, layout):
    """twins_of(r) for a run: the dp (and cp) replicas of r under ZeRO 0 without experts, else r."""
    if cfg.parallel.zero == 0 and cfg.model.num_experts == 0:
        return lambda r: layout.group_of(r, ("ep", "dp", "cp"))
    return lambda r: [r]


def store_dir(cfg, env) -> Path:
    """This worker's node store: the run's root, this host and agent, and the node's index among
    the agent's workers. Never the global rank: the store belongs to the machine, and after a
    replacement node joins the rendezvous the survivors may run other ranks."""
    per_node = cfg.parallel.devices_per_node or env.local_world_size
    root = run_root(os.environ.get("TORCHELASTIC_RUN_ID", ""), cfg.log.dir)
    return node_dir(root, env.local_rank // per_node)


def whole_state(state: list[LocalTensor]) -> list[LocalTensor]:
    """Every slice this rank holds, once each (a tied embedding's copy on the last stage may name
    a slice the first stage holds: on one rank only once)."""
    seen, out = set(), []
    for t in state:
        key = (t.name, tuple(t.offsets))
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


class MemoryReplicas:
    def __init__(self, store: NodeStore, state, grid, rank: int, plan: BuddyPlan, config: dict, timeout_s: float):
        self.store, self.grid, self.rank, self.plan, self.config = store, grid, rank, plan, config
        self.tensors = whole_state(state)
        self.layout = replica_layout(grid.layout, rank, list(plan.twins))
        # The slices a storage save writes (dp rank 0's under ZeRO 0): a resharded restore builds
        # its checkpoint from these, so no two of its shards overlap.
        self.canonical = sorted(shard_key(t.name, t.offsets) for t in self.tensors if t.write or t.dp_replica)
        self.mapped: dict[Path, MappedState] = {}
        self.staging: list[torch.Tensor] = []  # pinned buffers where the mapping cannot be registered (CUDA)
        self._thread: threading.Thread | None = None
        self.groups = self._pair_groups(timeout_s)
        self.error: str | None = None
        """The last snapshot's or exchange's failure (the run goes on; the previous copy stays)."""
        self.snapshots = 0
        self.last_step: int | None = None
        self.wanted_anywhere = False
        """Set by restore: some rank restarts or resumes (a replacement node's own workers do not)."""

    @classmethod
    def build(cls, cfg, grid, state, device, env) -> MemoryReplicas | None:
        """The run's replicas (collective among buddy pairs), or None when
        checkpoint.memory_interval is 0."""
        c = cfg.checkpoint
        if not c.memory_interval:
            return None
        collect_dead()
        per_node = cfg.parallel.devices_per_node or env.local_world_size
        plan = plan_buddies(grid.global_rank, grid.world.size, per_node, twins_for(cfg, grid.layout), c.replicas)
        store = NodeStore(store_dir(cfg, env))
        return cls(store, state, grid, grid.global_rank, plan, cfg.to_dict(), cfg.train.timeout_s)

    def _pair_groups(self, timeout_s: float) -> dict[tuple[int, int], comm.Group]:
        """One two-rank gloo group per buddy pair this rank is in, created by the pair alone (in
        one global order: no two pairs wait on each other); host memory travels on gloo beside
        NCCL, and only the background thread uses them."""
        pairs = {tuple(sorted((self.rank, p))) for p in ([self.plan.send_to] if self.plan.send_to is not None else [])}
        pairs |= {tuple(sorted((s, self.rank))) for s in self.plan.receive_from}
        groups = {}
        if not comm.is_initialized():
            return groups
        for pair in sorted(pairs):
            pg = comm.new_group(list(pair), timeout=timedelta(seconds=timeout_s), backend="gloo", local=True)
            groups[pair] = comm.Group(f"replica{pair[0]}-{pair[1]}", list(pair), pg, device=torch.device("cpu"))
        return groups

    @property
    def state_bytes(self) -> int:
        return nbytes_of(self.tensors)

    def ram_bytes(self) -> dict:
        """Host memory this rank's replicas hold, as their files in the node's store: the two slots
        of its own state, the two of each state it keeps a copy of, and a pinned staging copy
        where the mapping could not be registered."""
        slots = lambda q: sum(data_size(self.store.slot(q, i)) for i in (0, 1))  # noqa: E731
        own = slots(self.rank)
        held = sum(slots(s) for s in self.plan.receive_from)
        staging = sum(b.numel() * b.element_size() for b in self.staging)
        return {"own": own, "held": held, "staging": staging, "total": own + held + staging}

    # --- snapshot ---------------------------------------------------------------------------------
    def snapshot(self, step: int, extra: dict) -> float:
        """Snapshot the state after `step` optimizer steps; returns the seconds the caller was
        blocked (the previous exchange still running, and the copy into host memory). A store
        that is gone or full skips this snapshot (`error` says why); the exchange still runs, so
        the buddy is not left waiting."""
        t0 = time.perf_counter()
        self.wait()
        directory = mapped = None
        try:
            directory = self.store.free_slot(self.rank)
            invalidate(directory)
            mapped = self._mapped(directory)
            self._copy(mapped)
        except OSError as err:
            self.error = f"rank {self.rank}: no memory snapshot of step {step}: {err}"
            directory = None
        self._thread = threading.Thread(
            target=self._complete, args=(step, dict(extra), directory, mapped), name="threefold-replica", daemon=True
        )
        self._thread.start()
        return time.perf_counter() - t0

    def _mapped(self, directory: Path) -> MappedState:
        mapped = self.mapped.get(directory)
        if mapped is None or not mapped.fits(self.tensors) or not (directory / DATA).exists():
            if mapped is not None:
                mapped.release()
            mapped = self.mapped[directory] = MappedState(directory, self.tensors)
            on_device = any(t.tensor.device.type == "cuda" for t in self.tensors)
            if on_device and not mapped.pin() and not self.staging:
                self.staging = [torch.empty_like(b, pin_memory=True) for b in mapped.buffers]
        return mapped

    @torch.no_grad()
    def _copy(self, mapped: MappedState) -> None:
        """Device to host: straight into the mapping (pinned), or into the pinned staging buffers
        that the thread copies on; on CPU a memcpy into the mapping."""
        devices = {t.tensor.device for t in self.tensors if t.tensor.device.type != "cpu"}
        targets = mapped.buffers if mapped.pinned or not devices else self.staging
        for buffer, t in zip(targets, self.tensors):
            buffer.copy_(t.tensor, non_blocking=bool(devices))
        for device in devices:
            torch.accelerator.synchronize(device)

    def _complete(self, step: int, extra: dict, directory: Path | None, mapped: MappedState | None) -> None:
        """Background thread: the staged copy into the mapping, checksum, publish; then the
        exchange with the buddies (an empty one when this snapshot failed)."""
        message = b""
        if directory is not None:
            try:
                if self.staging and not mapped.pinned:
                    for buffer, staged in zip(mapped.buffers, self.staging):
                        buffer.copy_(staged)
                report = report_of(directory, self.tensors, mapped.buffers)
                extra = {**extra, "canonical": self.canonical}
                publish(directory, step, self.config, self.layout, extra, report)
                self.snapshots += 1
                self.last_step, self.error = step, None
                message = json.dumps({"step": step, "layout": self.layout, "extra": extra, "report": report}).encode()
            except (OSError, RuntimeError, CheckpointError, ValueError) as err:
                self.error = f"rank {self.rank}: memory snapshot of step {step}: {str(err).splitlines()[0][:200]}"
        if not self.groups:
            return
        try:
            self._exchange(directory, message)
        except (OSError, RuntimeError, CheckpointError, ValueError) as err:
            self.error = f"rank {self.rank}: copy of step {step} with a buddy: {str(err).splitlines()[0][:200]}"

    def _exchange(self, directory: Path | None, message: bytes) -> None:
        """Send this rank's snapshot to its buddy and receive those it keeps: sizes first, then
        each manifest message and the file, received straight into a slot's pages; a received
        file is published once its checksum matches the sender's. Sizes of 0: nothing follows."""
        size = (directory / DATA).stat().st_size if message else 0
        headers = {s: [torch.zeros(2, dtype=torch.int64)] for s in self.plan.receive_from}
        self._batch([torch.tensor([len(message), size], dtype=torch.int64)], headers)
        sends = []
        if message and self.plan.send_to is not None:
            sends = [torch.frombuffer(bytearray(message), dtype=torch.uint8), map_bytes(directory / DATA, size, False)]
        slots, payloads = {}, {}
        for sender, (header,) in headers.items():
            length, data_size = int(header[0]), int(header[1])
            if length == 0:
                continue
            try:
                target = self.store.free_slot(sender)
                invalidate(target)
                target.mkdir(exist_ok=True)
                data = map_bytes(target / DATA, data_size, True)
                slots[sender] = target
            except OSError:  # no room to keep it: receive and drop, the sender must not wait
                data = torch.empty(data_size, dtype=torch.uint8)
            payloads[sender] = [torch.empty(length, dtype=torch.uint8), data]
        self._batch(sends, payloads)
        for sender, (text, data) in payloads.items():
            del data  # unmapped: the file holds what arrived
            target = slots.get(sender)
            if target is None:
                continue
            info = json.loads(bytes(text.numpy()))
            if sha256_of(target / DATA) != info["report"]["sha256"]:
                remove_slot(target)
                raise CheckpointError(f"the copy of rank {sender}'s snapshot arrived corrupted")
            publish(target, info["step"], self.config, info["layout"], info["extra"], info["report"])

    def _batch(self, sends: list[torch.Tensor], recvs: dict[int, list[torch.Tensor]]) -> None:
        """`sends` to the buddy and each kept rank's `recvs` from it, in order, posted together on
        their pair groups, then waited for."""
        by_group: dict[tuple[int, int], list] = {}
        if self.plan.send_to is not None:
            pair = tuple(sorted((self.rank, self.plan.send_to)))
            by_group.setdefault(pair, []).extend(("send", t, pair.index(self.plan.send_to)) for t in sends)
        for sender, buffers in recvs.items():
            pair = tuple(sorted((sender, self.rank)))
            by_group.setdefault(pair, []).extend(("recv", t, pair.index(sender)) for t in buffers)
        posted = []
        for pair, ops in by_group.items():
            ops = [op for op in ops if op[1].numel() > 0]
            if ops:
                posted.append((comm.batch_send_recv(ops, self.groups[pair]), self.groups[pair]))
        for works, group in posted:
            comm.wait_all(works, group)

    def measure(self, step: int, repeats: int = 5) -> dict:
        """`threefold memory`: the host memory the replicas hold and what a snapshot blocks the
        loop for (the median of `repeats`, each after the previous exchange ended), collective
        among buddy pairs like a snapshot."""
        stalls = []
        for _ in range(repeats):
            self.wait()
            stalls.append(self.snapshot(step, {"optimizer_step": step}))
        self.wait()
        stalls.sort()
        return {
            **self.ram_bytes(),
            "state": self.state_bytes,
            "stall_s": stalls[len(stalls) // 2],
            "copy": self.plan.note,
        }

    def wait(self) -> None:
        """The snapshot in flight (its checksum, publication and exchange) has ended."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # --- restore and the end ----------------------------------------------------------------------
    def restore(self, state: list[LocalTensor], wanted: bool, storage_root: str, warn=print):
        """The newest replica set every rank can load from (replica_restore.py); collective."""
        from threefold.checkpoint.replica_restore import restore

        return restore(self, state, wanted, storage_root, warn)

    def finish(self) -> None:
        """The run ended cleanly (or stopped on a signal, having saved to storage): no restart
        will read these copies. Every rank removes its node's store after a world barrier."""
        self.wait()
        for mapped in self.mapped.values():
            mapped.release()
        self.mapped.clear()
        comm.barrier(self.grid.world)
        self.store.wipe()
        try:
            self.store.dir.parent.rmdir()
        except OSError:
            pass
