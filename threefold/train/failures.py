"""One console line per failure event, whatever the number of ranks that saw it.

A worker that fails on a hung or dead peer appends its reason to <log.dir>/failures.jsonl
(`record`) instead of printing it: one hung rank makes every other rank time out, and a line from
each would bury what happened. Whoever speaks next reads the attempt's records once (`summary`):
rank 0 of the restarted attempt ("restart 1 of 2 after ...; resumed at step s"), or the launcher
when the agent gives up. The ranks with no record are the ones that hung or died. Under torchrun
(no threefold launcher reading the file) a worker also prints its own line.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

FAILURES = "failures.jsonl"
QUIET_ENV = "THREEFOLD_LAUNCHER"
"""Set by threefold's own launcher for its workers: it reports their failures itself."""


def record(log_dir: str | Path, attempt: int, rank: int, why: str) -> None:
    """Append this rank's reason for failing attempt `attempt` (one short line, any rank)."""
    path = Path(log_dir) / FAILURES
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"time": time.time(), "attempt": attempt, "rank": rank, "why": why}) + "\n"
    with open(path, "a", encoding="utf-8") as f:  # one write of one line: appends do not interleave
        f.write(line)
        f.flush()


def prints_own_line() -> bool:
    """Whether a failing worker prints its reason itself (no threefold launcher will)."""
    return os.environ.get(QUIET_ENV) != "1"


def summary(log_dir: str | Path, attempt: int | None, world: int) -> str | None:
    """What went wrong in `attempt` (None: the last one recorded), in one line (None: nothing
    was recorded)."""
    path = Path(log_dir) / FAILURES
    if not path.exists():
        return None
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
    if attempt is None and entries:
        attempt = max(e.get("attempt", 0) for e in entries)
    reasons: dict[str, list[int]] = {}
    reported = set()
    for entry in entries:
        if entry.get("attempt") == attempt:
            reported.add(entry["rank"])
            reasons.setdefault(entry["why"], []).append(entry["rank"])
    if not reported:
        return None
    silent = [r for r in range(world) if r not in reported]
    seen = "; ".join(f"{_ranks(sorted(ranks))}: {why}" for why, ranks in reasons.items())
    if not silent:
        return f"every rank failed ({seen})"
    return f"{_ranks(silent)} hung or died ({seen})"


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"
