"""A hang, attributed: which collective of which group is stuck, and on which rank.

Every rank numbers its operations per group (comm.py's OpLog: the newest posted, the newest
completed). When a collective times out, each rank that can still run Python leaves that state,
O(groups) per rank (`snapshot`):

- a surviving rank puts it in its failure record (training/worker.py's peer-failure path);
- every rank also runs a `StallWatch`: a daemon thread that, once the rank's counts stood still
  for half its current collective deadline, writes the state to a file of its own
  (failures.state_file) and removes it when the counts move again. A main thread stuck in a
  sleep, in compute or in a C call cannot say anything; the thread can, before the peers' deadline
  ends the attempt. It reads only the counts, never what a drill does. On NCCL, where the
  watchdog aborts every rank of a timed-out collective without running Python, these files are
  what the ranks leave.

PyTorch's flight recorder (TORCH_FR_BUFFER_SIZE for gloo, TORCH_NCCL_TRACE_BUFFER_SIZE for NCCL:
a ring of the last `FR_ENTRIES` collectives per process, set before the process group is made,
distributed/runtime.py) adds torch's own count per process group, which also sees collectives
that bypass the OpLog (barriers, object collectives): a compact summary of it goes beside each
group's state, never the dump itself.

`attribute` reads the ranks' states (rank 0 of the restarted attempt, or the launcher, through
failures.summary): a rank waiting in collective #s of a group is held up by the members whose
posted count is below s ("never posted it"); a rank waiting in a point-to-point batch by the peers
that are not in a batch with it. A holder that is itself waiting is a link of a chain; one that
is in no communication, or that left no state (dead, or hung where no thread ran), is a root.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from threefold.atomic import atomic_write

FR_ENTRIES = 64
"""Entries of torch's flight-recorder ring (per process): the last collectives, for a dump."""
FR_ENV = "TORCH_FR_BUFFER_SIZE"
"""torch 2.13's name for both backends (TORCH_NCCL_TRACE_BUFFER_SIZE is its deprecated alias)."""
STALL_FRACTION = 0.5
"""A rank whose counts stand still for this fraction of its collective deadline writes its
state: early enough to come before the peers' deadline ends the attempt, late enough that a
healthy step (milliseconds to seconds between collectives) never does."""


# --- one rank's state ----------------------------------------------------------------------------


def compact_ranks(ranks: list[int]):
    """A group's members in O(1) space when they are an arithmetic progression of more than 8
    ranks (every grid group but embed is one): {"first", "step", "count"}; else the list."""
    if len(ranks) > 8:
        step = ranks[1] - ranks[0]
        if step > 0 and all(b - a == step for a, b in zip(ranks, ranks[1:])):
            return {"first": ranks[0], "step": step, "count": len(ranks)}
    return list(ranks)


def members(entry) -> list[int]:
    """The global ranks of a group entry's "ranks" (compact_ranks's form or a list)."""
    ranks = entry["ranks"]
    if isinstance(ranks, dict):
        return list(range(ranks["first"], ranks["first"] + ranks["step"] * ranks["count"], ranks["step"]))
    return list(ranks)


def _distinct_groups(groups: dict) -> list:
    seen: dict[int, tuple[str, object]] = {}
    for name, group in groups.items():
        if group is not None and group.pg is not None and group.size > 1:
            seen.setdefault(id(group), (name, group))
    return list(seen.values())


def flight_recorder() -> dict[str, dict]:
    """torch's flight recorder, per process-group name: its last enqueued, started and completed
    collective and its newest entry ({} when the recorder is off or torch lacks it)."""
    if not any(int(os.environ.get(k, "0") or 0) > 0 for k in (FR_ENV, "TORCH_NCCL_TRACE_BUFFER_SIZE")):
        return {}
    import torch

    c10d = getattr(torch._C, "_distributed_c10d", None)
    dumps = [getattr(c10d, n, None) for n in ("_dump_nccl_trace_json", "_dump_fr_trace_json")]
    out: dict[str, dict] = {}
    for dump in [d for d in dumps if d is not None]:
        try:
            data = json.loads(dump(True, False))
        except Exception:  # a recorder that cannot be read adds nothing (the OpLog still tells)
            continue
        # pg_status is keyed by the recorder's own pg id; its entries name the process group
        # (torch's group_name) that id stands for. A group whose entries left the ring is skipped.
        entries = data.get("entries") or []
        names = {str(e.get("pg_id")): (e.get("process_group") or [""])[0] for e in entries}
        for pg_id, status in (data.get("pg_status") or {}).items():
            if pg_id in names:
                out.setdefault(
                    names[pg_id],
                    {k: int(status.get(f"last_{k}_collective", -1)) for k in ("enqueued", "started", "completed")},
                )
        for entry in entries:
            name = (entry.get("process_group") or [""])[0]
            if name in out:
                seq = entry.get("collective_seq_id")
                out[name]["last"] = f"{entry.get('profiling_name')} #{seq} {entry.get('state')}"
    return out


def snapshot(groups: dict) -> dict:
    """This rank's state for a failure record: per group of two or more ranks (a grid's
    `groups`), its name, members, OpLog state and flight-recorder summary. O(groups)."""
    recorder = flight_recorder()
    out = []
    for name, group in _distinct_groups(groups):
        entry = {"name": name, "ranks": compact_ranks(group.ranks), **group.ops.state()}
        fr = recorder.get(str(getattr(group.pg, "group_name", "")))
        if fr:
            entry["fr"] = fr
        out.append(entry)
    return {"time": time.time(), "groups": out}


def _progress(groups: list) -> int:
    return sum(g.ops.posted + g.ops.completed for _, g in groups)


class StallWatch:
    """A daemon thread that writes this rank's snapshot to `path` once its operation counts have
    stood still for STALL_FRACTION of `deadline_s()` (the collective deadline in force), and
    removes the file when they move again. Polls a sum of O(groups) counters; writes nothing on
    a rank that keeps communicating."""

    def __init__(self, groups: dict, path: Path, deadline_s: Callable[[], float]):
        self.path, self.deadline_s = Path(path), deadline_s
        self._all = groups
        self._groups = _distinct_groups(groups)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="threefold-stall-watch", daemon=True)

    def start(self) -> StallWatch:
        if self._groups:
            self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread and let go of the groups (their process groups must not outlive the
        worker's own references: torch destroys them when those go)."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._all, self._groups, self.deadline_s = {}, [], lambda: 0.0

    def _run(self) -> None:
        last, since, written = _progress(self._groups), time.monotonic(), False
        while not self._done.is_set():
            after = max(0.5, STALL_FRACTION * self.deadline_s())
            self._done.wait(min(1.0, after / 8))
            now, count = time.monotonic(), _progress(self._groups)
            if count != last:
                last, since = count, now
                if written:
                    self.path.unlink(missing_ok=True)
                    written = False
            elif not written and now - since >= after:
                try:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    state = snapshot(self._all)
                    state["stalled_s"] = round(now - since, 3)
                    atomic_write(self.path, json.dumps(state) + "\n")
                    written = True
                except OSError:
                    return  # nowhere to write: this rank leaves nothing, as if it had died


# --- attribution (pure: from the ranks' states) ---------------------------------------------


@dataclass
class Wait:
    """One operation some ranks wait in, and the ranks holding it up."""

    group: str
    ranks: list[int]
    kind: str
    seq: int
    waiting: list[int]
    holders: list[int]
    peers: list[int] = field(default_factory=list)
    """For a point-to-point batch: the waiting rank's peers (its seq is its own count)."""

    @property
    def collective(self) -> bool:
        return not self.peers

    def to_json(self) -> dict:
        out = {"group": self.group, "ranks": compact_ranks(self.ranks), "op": self.kind, "seq": self.seq}
        out.update(waiting=self.waiting, never_posted=self.holders)
        if self.peers:
            out["peers"] = self.peers
        return out


@dataclass
class Attribution:
    """What `attribute` found: the stuck operations, what each holder was doing, the roots."""

    waits: list[Wait]
    doing: dict[int, str]
    roots: list[int]

    @property
    def waiters(self) -> set[int]:
        """The ranks that wait in an operation someone holds up."""
        return {r for w in self.waits for r in w.waiting}

    def to_json(self) -> dict:
        return {
            "stuck": [w.to_json() for w in self.waits],
            "doing": {str(r): d for r, d in sorted(self.doing.items())},
            "roots": self.roots,
        }

    def line(self, most: int = 3) -> str:
        """`hang: dp all-reduce #12 on group [0, 1]: rank 1 never posted it (...)`, once per root
        (the largest collective it holds up, else a point-to-point batch), at most `most`."""
        parts, shown = [], set()
        for root in self.roots:
            held = [w for w in self.waits if root in w.holders]
            if root in shown or not held:
                continue
            wait = max(held, key=lambda w: (w.collective, len(w.ranks), w.seq))
            together = [r for r in wait.holders if r in self.roots and r not in shown]
            shown.update(together)
            doing = "; ".join(f"rank {r}: {self.doing[r]}" if len(together) > 1 else self.doing[r] for r in together)
            text = f"{_op(wait)}: {_ranks(together)} never posted {'it' if wait.collective else 'its side'} ({doing})"
            if not wait.collective:  # the collective it holds up through the rank it keeps waiting
                above = [w for w in self.waits if w.collective and set(w.holders) & set(wait.waiting)]
                if above:
                    top = max(above, key=lambda w: len(w.ranks))
                    text += f"; so {_ranks(sorted(set(top.holders) & set(wait.waiting)))} never posted {_op(top)}"
            parts.append((text, len(together)))
        more = sum(n for _, n in parts[most:])
        text = "; ".join(t for t, _ in parts[:most])
        return f"hang: {text}" + (f" (and {more} more rank{'s' if more > 1 else ''})" if more else "")


def _kind(kind: str) -> str:
    return kind.replace("_", "-")


def _op(wait: Wait) -> str:
    ranks = wait.ranks if len(wait.ranks) <= 8 else [*wait.ranks[:3], "...", wait.ranks[-1]]
    group = "[" + ", ".join(map(str, ranks)) + "]"
    if wait.collective:
        return f"{wait.group} {_kind(wait.kind)} #{wait.seq} on group {group}"
    own = f"of rank {wait.waiting[0]} (its #{wait.seq})"
    return f"{wait.group} {_kind(wait.kind)} {own} with {_ranks(wait.peers)} on group {group}"


def _ranks(ranks) -> str:
    ranks = list(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} " + ", ".join(map(str, ranks))


def _pending(entry: dict) -> bool:
    return entry["posted"] > entry["completed"]


def _with(kind: str, peers) -> str:
    if not peers:
        return ""
    word = {"recv": "from", "send": "to"}.get(kind, "with")
    return f" {word} {_ranks(peers)}"


def _doing(rank: int, state: dict | None, waits: list[Wait]) -> str:
    """What a rank holding an operation up was doing: the operations it waited in itself, from
    the others' states and its own, else its newest operation per group."""
    if state is None:
        return "it left no state: dead, or hung where no thread of it ran"
    own = [w for w in waits if rank in w.waiting]
    if own:
        return "it was in " + ", ".join(
            f"{w.group} {_kind(w.kind)} #{w.seq}{_with(w.kind, w.peers) if w.peers else ''}" for w in own
        )
    # Its counts alone cannot say which of its groups it used last (an asynchronous operation
    # stays "posted" until its handle is waited on through comm.wait): each group's newest.
    last = ", ".join(
        f"{g['name']} {_kind(g['posted_kind'])} #{g['posted']}{_with(g['posted_kind'], g.get('posted_peers'))}"
        for g in state["groups"]
        if g["posted"]
    )
    return f"it waited on no peer; newest per group: {last or 'none'}"


def attribute(states: dict[int, dict]) -> Attribution | None:
    """The stuck operations and who holds them up, from each rank's snapshot (`states`, by
    global rank; a rank missing left none). None when no rank was waiting in an operation."""
    index: dict[tuple, dict[int, dict]] = {}
    for rank, state in states.items():
        for g in state.get("groups", []):
            index.setdefault((g["name"], tuple(members(g))), {})[rank] = g
    merged: dict[tuple, Wait] = {}
    for (name, ranks), by_rank in sorted(index.items()):
        for waiter, g in sorted(by_rank.items()):
            if not _pending(g):
                continue
            seq, peers = g["posted"], list(g.get("posted_peers") or [])
            holders = []
            for q in peers or [r for r in ranks if r != waiter]:
                other = by_rank.get(q)
                if other is None:
                    holders.append(q)
                elif peers and not (_pending(other) and waiter in (other.get("posted_peers") or [])):
                    holders.append(q)  # not in a batch with the waiter: it never posted its side
                elif not peers and other["posted"] < seq:
                    holders.append(q)
            if not holders:
                continue  # every member posted it: a slow completion, not a missing post
            key = (name, ranks, g["posted_kind"], seq) if not peers else (name, ranks, "p2p", waiter)
            wait = merged.get(key)
            if wait is None:
                merged[key] = Wait(name, list(ranks), g["posted_kind"], seq, [waiter], holders, peers)
            else:
                wait.waiting.append(waiter)
                wait.holders = sorted(set(wait.holders) | set(holders))
    if not merged:
        return None
    waits = sorted(merged.values(), key=lambda w: (not w.collective, w.group, w.ranks, w.seq))
    holders = sorted({r for w in waits for r in w.holders})
    waiters = {r for w in waits for r in w.waiting}
    doing = {r: _doing(r, states.get(r), waits) for r in holders}
    # A holder that waits on another is a link of a chain; the roots wait on nobody (a cycle of
    # waits, which has no root, names every holder).
    roots = [r for r in holders if r not in waiters]
    return Attribution(waits, doing, roots or holders)
