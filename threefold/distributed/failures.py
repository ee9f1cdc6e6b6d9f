"""One console line per failure event, whatever the number of ranks that saw it.

A worker that fails on a hung or dead peer appends its reason to <log.dir>/failures.jsonl
(`record`) instead of printing it: one hung rank makes every other rank time out, and a line from
each would bury what happened. A worker that fails on its own (a Python exception) records that
exception, which then names the failure. Whoever speaks next reads the attempt's records once
(`summary`): rank 0 of the restarted attempt ("restart 1 of 2 after ...; resumed at step s"), or
the launcher when the agent gives up. The ranks with no record are the ones that hung or died.
Under torchrun (no threefold launcher reading the file) a worker also prints its own line.

A rank that NCCL's watchdog aborts (SIGABRT once a collective outlived its deadline) runs no more
Python. Under threefold's launcher its stderr goes to <log.dir>/workers/<run>/attempt_<n>/
(`worker_files`); the agent reads what a dead attempt's workers left there before it starts the
next attempt, and again when it gives up (`record_left_behind`): the watchdog's line, or the
exception in the error file torch's elastic `record` wrote.

A hang is also attributed (distributed/hang.py): a rank that fails on a peer records its
operation counts per group with its reason, and every rank's stall watch leaves the same state in
a file of its own (`state_file`) when it stops making progress. `summary` then names the
collective, its group and the rank or ranks that never posted it, appends that to its line, and
records it once per attempt as a "hang" record (rank -1: written by whoever summarised).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from threefold.distributed import hang

FAILURES = "failures.jsonl"
QUIET_ENV = "THREEFOLD_LAUNCHER"
"""Set by threefold's own launcher for its workers: it reports their failures itself."""
PEER, CRASH = "peer", "crash"
"""What a record says: this rank failed because of a peer (it timed out on a hung one, or lost a
dead one's connection), or on its own (an exception: it names the failure)."""
HANG = "hang"
"""A record of what summary attributed a hang to (hang.Attribution.to_json under "hang")."""
ACTION = "action"
"""A record of a rank that left because train.on_slow acted (training/actions.py): the attempt
ended on purpose, and the restart line says so instead of naming the ranks as hung."""
FAILED = (PEER, CRASH, ACTION)
WATCHDOG = "Watchdog caught collective operation timeout"
"""What NCCL's watchdog logs (ProcessGroupNCCL::WorkNCCL::checkTimeout) before it aborts the rank."""


def record(
    log_dir: str | Path,
    attempt: int,
    rank: int,
    why: str,
    kind: str = PEER,
    run: str | None = None,
    extra: dict | None = None,
) -> None:
    """Append this rank's reason for failing attempt `attempt` (one short line, any rank) of the
    elastic run `run` (default: this worker's, TORCHELASTIC_RUN_ID); `extra`: more fields (a
    peer failure's "ops": hang.snapshot)."""
    path = Path(log_dir) / FAILURES
    path.parent.mkdir(parents=True, exist_ok=True)
    run = os.environ.get("TORCHELASTIC_RUN_ID", "") if run is None else run
    entry = {"time": time.time(), "run": run, "attempt": attempt, "rank": rank, "kind": kind, "why": why}
    entry.update(extra or {})
    line = json.dumps(entry) + "\n"
    with open(path, "a", encoding="utf-8") as f:  # one write of one line: appends do not interleave
        f.write(line)
        f.flush()


def prints_own_line() -> bool:
    """Whether a failing worker prints its reason itself (no threefold launcher will)."""
    return os.environ.get(QUIET_ENV) != "1"


def _entries(log_dir: str | Path, run: str | None) -> list[dict]:
    """The records of elastic run `run` (default: this worker's; "" matches records of any run
    only when no run id is known)."""
    path = Path(log_dir) / FAILURES
    if not path.exists():
        return []
    run = os.environ.get("TORCHELASTIC_RUN_ID", "") if run is None else run
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if not run or entry.get("run", "") == run:  # an earlier run in the same log.dir is not this one
            entries.append(entry)
    return entries


def summary(log_dir: str | Path, attempt: int | None, world: int, run: str | None = None) -> str | None:
    """What went wrong in `attempt` (None: the last one recorded) of elastic run `run` (default:
    this worker's), in one line (None: nothing was recorded). A rank's own exception names the
    failure; otherwise the ranks that left no record are named as hung or dead, and the stuck
    collective and the ranks that never posted it follow (`; hang: ...`), recorded once."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "") if run is None else run
    entries = _entries(log_dir, run)
    if attempt is None and entries:
        attempt = max(e.get("attempt", 0) for e in entries)
    reasons: dict[tuple[str, str], list[int]] = {}
    reported = set()
    for entry in entries:
        kind = entry.get("kind", PEER)
        if entry.get("attempt") == attempt and kind in FAILED and entry["rank"] not in reported:
            reported.add(entry["rank"])
            reasons.setdefault((kind, entry["why"]), []).append(entry["rank"])
    crashes = [f"{_ranks(sorted(ranks))}: {why}" for (kind, why), ranks in reasons.items() if kind == CRASH]
    if crashes:
        return "; ".join(crashes)
    acted = [f"{_ranks(sorted(ranks))}: {why}" for (kind, why), ranks in reasons.items() if kind == ACTION]
    if acted:
        return "; ".join(acted)
    found, waiters = _attributed(log_dir, run, attempt, entries)
    tail = f"; {found}" if found and reported else found
    if not reported:
        return tail or None
    # A rank without a record whose state shows it waiting on a peer is not one that hung: its
    # own wait had no deadline (a gloo receive) when the attempt was torn down.
    waited = [r for r in range(world) if r not in reported and r in waiters]
    silent = [r for r in range(world) if r not in reported and r not in waiters]
    if waited:
        reasons[("", "left its state waiting on a peer")] = waited
    seen = "; ".join(f"{_ranks(sorted(ranks))}: {why}" for (_, why), ranks in reasons.items())
    if not silent:
        return f"every rank failed ({seen}){tail or ''}"
    return f"{_ranks(silent)} hung or died ({seen}){tail or ''}"


def state_file(log_dir: str | Path, run: str, attempt: int, rank: int) -> Path:
    """Where a worker's stall watch leaves its operation state (hang.StallWatch), beside its
    stderr (worker_files)."""
    return worker_files(log_dir, run or "local", attempt, rank)[0].with_name(f"rank_{rank}.ops.json")


def _states(log_dir: str | Path, run: str, attempt: int, entries: list[dict]) -> dict[int, dict]:
    """Every rank's operation state for `attempt`: its failure record's "ops" where it left one
    (taken when it failed), else its stall watch's file."""
    states: dict[int, dict] = {}
    directory = state_file(log_dir, run, attempt, 0).parent
    if directory.is_dir():
        for path in directory.glob("rank_*.ops.json"):
            try:
                states[int(path.name[len("rank_") : -len(".ops.json")])] = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue  # cut short by a kill: this rank left nothing readable
    for entry in entries:
        if entry.get("attempt") == attempt and entry.get("kind") in FAILED and entry.get("ops"):
            states[entry["rank"]] = entry["ops"]
    return states


def _attributed(log_dir: str | Path, run: str, attempt: int | None, entries: list[dict]) -> tuple[str | None, set]:
    """The hang's one-line attribution for `attempt` (None: nothing to attribute) and the ranks
    it shows waiting on a peer; recorded as a HANG record the first time it is made."""
    if attempt is None:
        return None, set()
    earlier = [e for e in entries if e.get("attempt") == attempt and e.get("kind") == HANG]
    if earlier:
        found = earlier[0].get("hang", {})
        waiting = {r for w in found.get("stuck", []) for r in w.get("waiting", [])}
        return earlier[0]["why"], waiting - set(found.get("roots", []))
    found = hang.attribute(_states(log_dir, run, attempt, entries))
    if found is None:
        return None, set()
    line = found.line()
    record(log_dir, attempt, -1, line, HANG, run=run, extra={"hang": found.to_json()})
    return line, found.waiters - set(found.roots)


def worker_files(log_dir: str | Path, run: str, attempt: int, rank: int) -> tuple[Path, Path]:
    """Where a worker of threefold's launcher leaves its stderr and its error file (torch elastic's
    TORCHELASTIC_ERROR_FILE: the exception that ended it)."""
    directory = Path(log_dir) / "workers" / run / f"attempt_{attempt}"
    return directory / f"rank_{rank}.stderr", directory / f"rank_{rank}.error.json"


def record_left_behind(log_dir: str | Path, run: str, attempt: int) -> None:
    """Agent side, once `attempt`'s workers are gone: a record for each rank that left none but
    whose files say why it died (NCCL's watchdog line in its stderr, an exception in its error
    file). Each file is read once per attempt, only for ranks without a record."""
    directory = worker_files(log_dir, run, attempt, 0)[0].parent
    if not directory.is_dir():
        return
    entries = _entries(log_dir, run)
    reported = {e["rank"] for e in entries if e.get("attempt") == attempt and e.get("kind", PEER) in FAILED}
    for stderr in sorted(directory.glob("rank_*.stderr")):
        rank = int(stderr.name[len("rank_") : -len(".stderr")])
        if rank in reported:
            continue
        left = _watchdog(stderr) or _exception(stderr.with_name(f"rank_{rank}.error.json"))
        if left is not None:
            record(log_dir, attempt, rank, left[1], left[0], run=run)


def _watchdog(stderr: Path) -> tuple[str, str] | None:
    """(PEER, why) when NCCL's watchdog logged a timed-out collective in `stderr`."""
    try:
        with open(stderr, encoding="utf-8", errors="replace") as f:
            line = next((line for line in f if WATCHDOG in line), None)
    except OSError:
        return None
    if line is None:
        return None
    op = re.search(r"OpType=(\w+)", line)
    ms = re.search(r"Timeout\(ms\)=(\d+)", line)
    what = op.group(1) if op else "a collective"
    after = f" after {int(ms.group(1)) / 1000:g} s" if ms else ""
    return PEER, f"NCCL's watchdog aborted it: {what} timed out{after} (a peer is hung or dead)"


def _exception(error_file: Path) -> tuple[str, str] | None:
    """(CRASH, "Type: message") from an error file torch elastic's `record` wrote."""
    try:
        data = json.loads(error_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    message = data.get("message", "")
    if isinstance(message, dict):
        message = message.get("message", "")
    lines = str(message).strip().splitlines()
    return (CRASH, lines[0][:200]) if lines else None


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"
