"""Where a node keeps its memory replicas: shared memory named after the run, so the copy outlives
a worker that the elastic agent restarts (checkpoint/replica_store.py reads and writes it).

    /dev/shm/threefold-<run key>/<host>-<agent pid>-n<node>/

/dev/shm is tmpfs (RAM). The run key hashes the elastic run's id and the log directory, so two
runs on one machine never share a copy. The agent's pid names a node's directory: a worker the
agent restarts finds the copy of its attempt's predecessor, while a node that died (its agent
with it) and the node that replaces it start empty, as they would on a real cluster. Several
"nodes" on one machine (torchrun agents on localhost, or parallel.devices_per_node) each get
their own directory.

Clean-up: a run that ends cleanly removes its node's directory (checkpoint/replicas.py),
threefold's launcher removes the run's root when it exits, and every run removes the
directories of agents that are gone from this host (a run that torchrun gave up on).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import tempfile
from pathlib import Path

PREFIX = "threefold-"


def shm_root() -> Path:
    """/dev/shm where it exists (Linux), else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def run_key(run_id: str, log_dir: str) -> str:
    return hashlib.sha256(f"{run_id}|{os.path.abspath(log_dir)}".encode()).hexdigest()[:12]


def run_root(run_id: str, log_dir: str) -> Path:
    """The run's directory of memory replicas on this host."""
    return shm_root() / f"{PREFIX}{run_key(run_id, log_dir)}"


def node_dir(root: Path, node: int) -> Path:
    """A node's directory under a run root: this host, this worker's agent (its parent), and the
    node's index among the agent's workers (`node`: 0 unless parallel.devices_per_node splits
    one agent's workers into several nodes)."""
    return root / f"{socket.gethostname()}-{os.getppid()}-n{node}"


def remove_run(run_id: str, log_dir: str) -> None:
    """Every memory replica of the run on this host (the launcher, when the run is over)."""
    shutil.rmtree(run_root(run_id, log_dir), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def collect_dead() -> list[Path]:
    """Remove the node directories, of any run, whose agent on this host is gone (and the run
    roots they leave empty); returns what was removed."""
    host, removed = socket.gethostname(), []
    for root in shm_root().glob(f"{PREFIX}*"):
        if not root.is_dir():
            continue
        for node in root.iterdir():
            owner, sep, rest = node.name.rpartition("-n")
            owner_host, _, pid = owner.rpartition("-")
            if sep and owner_host == host and pid.isdigit() and rest.isdigit() and not _alive(int(pid)):
                shutil.rmtree(node, ignore_errors=True)
                removed.append(node)
        try:
            root.rmdir()  # only when empty
        except OSError:
            pass
    return removed
