"""A torchrun worker's seat in this round of the job, taken before it joins the process group.

    seat = take_seat(cfg)                 # every worker started by torchrun, first thing
    if seat.spare:
        wait_as_spare(seat, cfg)          # no rank, no group: returns when the job has ended
    else:
        run_worker(..., store=seat.store) # ranks of the seat's position
        release(seat, ok)                 # the job's end, told to the spares

The launcher's rank 0 (the host of torchrun's worker store for the round) reads one key per node
(its name and its agent's restart count), the job's last round from <log.dir>/nodes.json, decides
this round (training/seating.py), records it there and writes one key per node: its position, or
none. Every worker reads two keys. A seated worker's RANK, WORLD_SIZE, GROUP_RANK,
GROUP_WORLD_SIZE and TORCHELASTIC_RESTART_COUNT become its seat's (the count: the round's
attempt, the same on every node), so everything that reads them (fault drills, failure records,
the restart line, the node probe's node index) agrees; it joins the training group on the same
store under those. nodes.json must be where every node's rank 0 can read it (log.dir on shared
storage, as failures.jsonl already is); without it each round is seated as a first one.

A spare joins no group and runs nothing per step: it blocks in one wait on the store. The job
ending well releases it (exit 0; the store's host waits for every spare to have seen it). Its
agent restarts it when the rendezvous re-forms the job (a failure, a node joining): the agents
of healthy nodes do that for any node waiting to join. A job that failed, or a store that went
away, leaves it waiting train.timeout_s + 60 s for that restart before it gives up (exit 1).

Needs `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: every round then has a store of its own (a shared
one keeps the keys of a round that ended without a restart, such as a node joining).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from threefold.atomic import atomic_write
from threefold.config import Config
from threefold.distributed import comm
from threefold.training.seating import (
    ROUND_ENV,
    Node,
    Round,
    data_parallel,
    decide,
    first_line,
    host_order,
    labels,
    nodes_needed,
)

NODE_ENV = "THREEFOLD_NODE"
"""A node's name in the topology (default: its host name); agents sharing a host need one each."""
RECORD = "nodes.json"
"""<log.dir>/nodes.json: the job's rounds, newest last (RECORD_ROUNDS of them)."""
RECORD_ROUNDS = 64
PREFIX = "threefold/seats/"
END, DONE, FAILED, ACKS = "end", "done", "failed", "acks"
ACK_WAIT_S = 60.0
"""How long the store's host waits for every spare to have seen the end before it exits."""


def node_name(environ: dict | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get(NODE_ENV) or socket.gethostname()


@dataclass
class Seat:
    """This worker's place in the round: a position (its ranks) or none (a spare)."""

    store: object
    """The launcher's store for the round (seat keys under PREFIX); the training group joins on it."""
    position: int | None
    rank: int
    world: int
    attempt: int
    spare_workers: int
    """Workers waiting on spare nodes this round (the job's end waits for each to see it)."""
    hosts_store: bool
    """This worker hosts the store (the launcher's rank 0): it leaves after the spares."""

    @property
    def spare(self) -> bool:
        return self.position is None


def take_seat(cfg: Config) -> Seat:
    """This worker's seat in the round (collective over every worker torchrun started). Seated:
    the environment now names the seat's rank, world and attempt. A layout that cannot be made of
    whole nodes raises ConfigError on every worker."""
    env = os.environ
    per_node = int(env.get("LOCAL_WORLD_SIZE", 1))
    local = int(env.get("LOCAL_RANK", 0))
    store, launch_rank, launch_world = comm.launcher_store(timedelta(seconds=cfg.train.startup_timeout_s))
    nodes = int(env.get("GROUP_WORLD_SIZE", launch_world // per_node))
    group = int(env.get("GROUP_RANK", launch_rank // per_node))
    needed = nodes_needed(cfg, nodes, per_node)
    order = host_order(cfg.parallel.hostfile)  # read by every worker: a bad file is every worker's one line
    keys = comm.prefixed(store, PREFIX)
    if local == 0:
        restarts = int(env.get("TORCHELASTIC_RESTART_COUNT", 0))  # this agent's, before the seat's
        # The tag (the agent's pid: a worker's parent under torchrun) tells apart agents on one host.
        entry = {"name": node_name(env), "tag": str(os.getppid()), "restarts": restarts}
        keys.set(f"node/{group}", json.dumps(entry))
    if launch_rank == 0:
        _seat_the_round(cfg, keys, nodes, needed, per_node, env.get("TORCHELASTIC_RUN_ID", ""), order)
    position = int(keys.get(f"pos/{group}"))
    rnd = json.loads(keys.get("round"))
    seat = Seat(
        store,
        None if position < 0 else position,
        (position * per_node + local) if position >= 0 else -1,
        needed * per_node,
        int(rnd["attempt"]),
        (nodes - needed) * per_node,
        launch_rank == 0,
    )
    if not seat.spare:
        env.update(
            RANK=str(seat.rank),
            WORLD_SIZE=str(seat.world),
            GROUP_RANK=str(position),
            GROUP_WORLD_SIZE=str(needed),
            ROLE_RANK=str(seat.rank),
            ROLE_WORLD_SIZE=str(seat.world),
            TORCHELASTIC_RESTART_COUNT=str(seat.attempt),
        )
        env[ROUND_ENV] = json.dumps({k: rnd[k] for k in ("restarts", "failed", "change")})
        if seat.rank == 0 and rnd.get("line"):
            print(rnd["line"], flush=True)
    return seat


def _seat_the_round(cfg: Config, keys, nodes: int, needed: int, per_node: int, run: str, order: list[str]) -> None:
    """The launcher's rank 0: decide the round, record it, give every node its position
    (O(nodes) keys, once per round)."""
    names = [f"node/{g}" for g in range(nodes)]
    keys.wait(names)
    entries = [json.loads(v) for v in keys.multi_get(names)]
    path = Path(cfg.log.dir) / RECORD
    history = _history(path, run)
    previous = Round.from_json(history[-1]) if history else None
    names = labels([e["name"] for e in entries], [e["tag"] for e in entries], previous)
    present = [Node(label, int(e["restarts"])) for label, e in zip(names, entries)]
    rnd = decide(previous, present, needed, data_parallel(cfg, needed, per_node), order)
    history.append({**rnd.to_json(), "time": time.time()})
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({"run": run, "rounds": history[-RECORD_ROUNDS:]}, indent=1) + "\n")
    where = {label: k for k, label in enumerate(rnd.seats)}
    keys.multi_set([f"pos/{g}" for g in range(nodes)], [str(where.get(label, -1)) for label in names])
    line = first_line(rnd) if previous is None and rnd.spares else ""
    small = {"attempt": rnd.attempt, "restarts": rnd.restarts, "failed": rnd.failed, "change": rnd.change}
    keys.set("round", json.dumps({**small, "line": line}))  # read by every worker: no node lists


def _history(path: Path, run: str) -> list[dict]:
    """The rounds of elastic run `run` recorded in `path` (none: another run's, or no file)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return list(data.get("rounds", [])) if data.get("run") == run else []


def wait_as_spare(seat: Seat, cfg: Config) -> None:
    """A spare's whole life in the round: one wait on the store until the job ends. Returns when
    it ended well; otherwise (it failed, or the store is gone) gives the agent train.timeout_s +
    60 s to restart this worker into the next round, then exits 1."""
    keys = comm.prefixed(seat.store, PREFIX)
    while True:
        try:
            keys.wait([END], timedelta(seconds=60))
            how = keys.get(END).decode()
        except comm.StoreTimeout:
            continue
        except Exception:  # the store's host is gone: the job re-forms or has ended
            how = "lost"
        break
    if how == DONE:
        keys.add(ACKS, 1)
        if seat.hosts_store:
            _wait_for_acks(keys, seat.spare_workers)
        return
    time.sleep(cfg.train.timeout_s + 60.0)  # the agent's restart (SIGTERM) ends this sooner
    print(f"threefold: spare node {node_name()}: the job it waited for ended ({how})", file=sys.stderr, flush=True)
    sys.exit(1)


def release(seat: Seat, ok: bool) -> None:
    """A seated worker leaving the round: when the job ended well the seat of rank 0 tells the
    spares (and the store's host waits until each has seen it); when this worker failed, it tells
    them so. Best effort: the store may be gone with a failed node."""
    if seat.spare_workers == 0:
        return
    keys = comm.prefixed(seat.store, PREFIX)
    try:
        if not ok:
            keys.set(END, FAILED)
            return
        if seat.rank == 0:
            keys.set(END, DONE)
        if seat.hosts_store:
            _wait_for_acks(keys, seat.spare_workers)
    except Exception:
        pass


def _wait_for_acks(keys, count: int) -> None:
    deadline = time.monotonic() + ACK_WAIT_S
    while int(keys.add(ACKS, 0)) < count and time.monotonic() < deadline:
        time.sleep(0.1)
