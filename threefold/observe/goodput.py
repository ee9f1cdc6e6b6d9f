"""Goodput: where a run's wall time went, across failures and restarts.

    productive_s   steps whose result the run kept (each step counted once)
    lost_s         steps computed and then thrown away: recomputed after resuming from an
                   older checkpoint (restart, rollback)
    recovery_s     per failure, from the failure to the start of the first step after it
                   (restart, start-up, checkpoint load): MTTR minus that step's own time
    checkpoint_s   time the loop was blocked by checkpoint saves (and the end of training by
                   the last asynchronous one)
    skipped_s      steps taken but not applied (NaN/Inf, fp16 overflow)
    other_s        the rest: start-up of the first attempt, logging, data set-up

A restart that train.on_slow caused (excluding a node, rebalancing the pipeline) is a failure
here like any other: its faults.jsonl record (kind on_slow_exclude / on_slow_rebalance) dates it,
and the summary counts them as `actions`.

MTTR of a failure is measured from the failure to the end of the first new step. A fault
injected by threefold.training.faults records its exact time in faults.jsonl; for a real failure
the end of the last completed step stands in for it (an over-estimate by < one step).

Everything is derived from metrics.jsonl (every line carries `segment`, an id of the process
attempt that wrote it), so the accounting survives restarts: a resumed run re-reads the file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from threefold.atomic import atomic_write

FAULTS = "faults.jsonl"
SUMMARY = "goodput.json"
ACTION_PREFIX = "on_slow_"
"""faults.jsonl's kind of a restart train.on_slow caused (training/actions.py): counted as a
failure (its lost and recovery time), and in the summary's `actions`."""


def record_fault(log_dir: str | Path, rank: int, kind: str, step: int) -> None:
    """Note an injected failure's time (any rank; one short appended line)."""
    path = Path(log_dir) / FAULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"time": time.time(), "rank": rank, "kind": kind, "step": step}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def process_start_time() -> float:
    """When this process started (Linux /proc), so a run's wall time includes its start-up;
    elsewhere: now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _read_lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut short by the crash
            continue
    return out


class Goodput:
    def __init__(self, log_dir: str | Path, enabled: bool, continuing: bool):
        """`continuing`: this attempt appends to an existing run (restart, resume, rollback)."""
        self.enabled, self.dir = enabled, Path(log_dir)
        self.started = process_start_time()
        self.productive: dict[int, float] = {}  # step -> time of its kept computation
        self.skipped: dict[int, float] = {}
        self.lost_s = self.recovery_s = self.checkpoint_s = 0.0
        self.failures: list[dict] = []
        self.prev: dict | None = None
        self.previous_counters: dict = {}  # the last record's run-long counters (skipped steps ...)
        self._faults: list[tuple[float, str]] = []  # (time, kind) of each recorded failure
        if not enabled:
            return
        # Fault times of older runs in the same directory never fall between this run's steps.
        self._faults = sorted((f["time"], f.get("kind", "")) for f in _read_lines(self.dir / FAULTS))
        if continuing:
            summary = self.dir / SUMMARY
            try:
                self.started = json.loads(summary.read_text())["started"]
            except (OSError, ValueError, KeyError):
                self.started = None
            for rec in _read_lines(self.dir / "metrics.jsonl"):
                self.update(rec)
            if self.started is None:
                first = _read_lines(self.dir / "metrics.jsonl")[:1]
                self.started = first[0]["time"] - first[0]["step_time_s"] if first else time.time()
        self.write()

    def update(self, rec: dict) -> dict:
        """Account one metrics record; returns the fields to add to it."""
        out: dict = {}
        if not self.enabled:
            return out
        step, step_time = rec["step"], rec.get("step_time_s", 0.0)
        prev = self.prev
        if prev is not None and rec.get("segment") != prev.get("segment"):
            # A failure between prev and rec: steps from rec's on were computed before and are redone.
            failed_at, cause = next(
                ((t, kind) for t, kind in self._faults if prev["time"] <= t <= rec["time"]), (prev["time"], "")
            )
            mttr = rec["time"] - failed_at
            redone = [s for s in self.productive if s >= step] + [s for s in self.skipped if s >= step]
            lost = sum(self.productive.pop(s, 0.0) + self.skipped.pop(s, 0.0) for s in redone)
            self.lost_s += lost + (failed_at - prev["time"])  # the step cut short by the failure
            self.recovery_s += max(0.0, mttr - step_time)
            failure = {
                "after_step": prev["step"],
                "resumed_at_step": step - 1,
                "lost_steps": len(redone),
                "mttr_s": mttr,
            }
            if cause:  # an injected fault, or a restart train.on_slow caused (on_slow_exclude ...)
                failure["cause"] = cause
            self.failures.append(failure)
            out.update(mttr_s=mttr, lost_steps=len(redone))
        (self.skipped if rec.get("step_skipped") else self.productive)[step] = step_time
        self.checkpoint_s += rec.get("ckpt_block_s", 0.0)
        self.prev = rec
        self.previous_counters = {k: rec[k] for k in ("steps_skipped", "nonfinite_steps") if k in rec}
        summary = self.summary(rec["time"])
        out["goodput"] = summary["goodput"]
        return out

    def summary(self, now: float | None = None) -> dict:
        now = time.time() if now is None else now
        wall = max(1e-9, now - (self.started or now))
        productive, skipped = sum(self.productive.values()), sum(self.skipped.values())
        other = wall - productive - skipped - self.lost_s - self.recovery_s - self.checkpoint_s
        mttrs = [f["mttr_s"] for f in self.failures]
        return {
            "started": self.started,
            "wall_s": wall,
            "productive_s": productive,
            "lost_s": self.lost_s,
            "recovery_s": self.recovery_s,
            "checkpoint_s": self.checkpoint_s,
            "skipped_s": skipped,
            "other_s": other,
            "goodput": productive / wall,
            "steps_kept": len(self.productive),
            "failures": self.failures,
            "mttr_s_mean": sum(mttrs) / len(mttrs) if mttrs else None,
            "actions": sum(f.get("cause", "").startswith(ACTION_PREFIX) for f in self.failures),
        }

    def write(self) -> None:
        """<log_dir>/goodput.json, replaced atomically."""
        if not self.enabled:
            return
        path = self.dir / SUMMARY
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(self.summary(), indent=1) + "\n")
