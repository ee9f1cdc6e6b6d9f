"""Goodput: where a run's wall time went, across failures and restarts.

    productive_s   steps whose result the run kept (each step counted once)
    lost_s         steps computed and then thrown away: recomputed after resuming from an
                   older checkpoint (restart, rollback)
    recovery_s     per failure, from the failure to the start of the first step after it
                   (restart, start-up, checkpoint load): MTTR minus that step's own time, in
                   parts (`recovery_parts`, and per failure): detect (the failure to the first
                   failures.jsonl record of a rank that saw it, or to the new attempt's start),
                   restart (to the start of loading, its pre-flight excepted), preflight,
                   load (memory replicas or storage: each failure says which, `source`) and
                   rewarm (the end of loading to the first step's start)
    checkpoint_s   time the loop was blocked by checkpoint saves and memory snapshots (and the
                   end of training by the last asynchronous save)
    skipped_s      steps taken but not applied (NaN/Inf, fp16 overflow)
    other_s        the rest: start-up of the first attempt, logging, data set-up

A restart that train.on_slow caused (excluding a node, rebalancing the pipeline) is a failure
here like any other: its faults.jsonl record (kind on_slow_exclude / on_slow_rebalance) dates it,
and the summary counts them as `actions`.

MTTR of a failure is measured from the failure to the end of the first new step. A fault
injected by threefold.training.faults records its exact time in faults.jsonl; for a real failure
the end of the last completed step stands in for it (an over-estimate by < one step).

Everything is derived from metrics.jsonl (every line carries `segment`, an id of the process
attempt that wrote it; an attempt's first line its `attempt_start`: process start, pre-flight,
load), so the accounting survives restarts: a resumed run re-reads the file.

The ledger, <log.dir>/goodput.jsonl, is one file per run that every attempt appends to: an
"attempt" line as each attempt's first step is recorded (its pre-flight and load, and the
failure before it in parts), and a "progress" line on every report step with the run's
categories so far. `threefold report` plots it over the run (analysis/plots.py).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from threefold.atomic import atomic_write

FAULTS = "faults.jsonl"
SUMMARY = "goodput.json"
LEDGER = "goodput.jsonl"
PARTS = ("detect_s", "restart_s", "preflight_s", "load_s", "rewarm_s")
NOT_FAILURES = ("nan", "corrupt", "ramloss", "enospc", "slow")
"""faults.jsonl kinds that do not end an attempt (a drill that poisons, corrupts or slows)."""
ACTION_PREFIX = "on_slow_"
"""faults.jsonl's kind of a restart train.on_slow caused (training/actions.py): counted as a
failure (its lost and recovery time), and in the summary's `actions`."""


def record_fault(log_dir: str | Path, rank: int, kind: str, step: int, **fields) -> None:
    """Note an injected failure's time (any rank; one short appended line); `fields`: more
    (the elastic run and the drill, so a restarted attempt does not fire it again)."""
    path = Path(log_dir) / FAULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"time": time.time(), "rank": rank, "kind": kind, "step": step, **fields}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def process_start_time() -> float:
    """When this process started (Linux /proc), so a run's wall time includes its start-up;
    elsewhere: now. Its age from the uptime clock (10 ms resolution; /proc/stat's boot time is
    whole seconds, which would misdate a restart by up to a second)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def read_faults(log_dir: str | Path) -> list[dict]:
    return _read_lines(Path(log_dir) / FAULTS)


def _detections(log_dir: Path) -> list[float]:
    """Times at which a rank recorded a failure it saw (distributed/failures.py's records)."""
    return sorted(e["time"] for e in _read_lines(log_dir / "failures.jsonl") if e.get("kind") in ("peer", "crash"))


def recovery_parts(failed_at: float, detected: float | None, start: dict, first_step_start: float) -> dict:
    """A failure's recovery in parts that add up to first_step_start - failed_at: detect, restart,
    preflight, load, rewarm. `start`: the new attempt's `attempt_start` (empty after a rollback,
    which loads without restarting)."""
    load_start = min(start.get("load_start", first_step_start), first_step_start)
    load_end = min(max(start.get("load_end", load_start), load_start), first_step_start)
    known = [t for t in (detected, start.get("process_start")) if t is not None]
    detected = min(max(min(known, default=failed_at), failed_at), load_start)
    preflight = min(start.get("preflight_s", 0.0), load_start - detected)
    return {
        "detect_s": detected - failed_at,
        "restart_s": load_start - detected - preflight,
        "preflight_s": preflight,
        "load_s": load_end - load_start,
        "rewarm_s": first_step_start - load_end,
    }


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
        self.preflight_s = 0.0  # every attempt's
        self.model: dict = {}
        """checkpoint.interval auto's choice: intervals, their inputs, the predicted goodput."""
        self._live = False  # replaying metrics.jsonl: nothing goes to the ledger
        self._detected: list[float] = []  # failures.jsonl's times of ranks that saw a failure
        if not enabled:
            return
        # Fault times of older runs in the same directory never fall between this run's steps.
        self._faults = sorted(
            (f["time"], f.get("kind", "")) for f in read_faults(self.dir) if f.get("kind") not in NOT_FAILURES
        )
        self._detected = _detections(self.dir)
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
        self._live = True
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
            # The failure fired in the step after prev; another rank may begin that step while
            # the first still writes prev's line: look back as far as prev's own start.
            since = prev["time"] - prev.get("step_time_s", 0.0)
            failed_at, cause = next(
                ((max(t, prev["time"]), kind) for t, kind in self._faults if since <= t <= rec["time"]),
                (prev["time"], ""),
            )
            mttr = rec["time"] - failed_at
            redone = [s for s in self.productive if s >= step] + [s for s in self.skipped if s >= step]
            lost = sum(self.productive.pop(s, 0.0) + self.skipped.pop(s, 0.0) for s in redone)
            self.lost_s += lost + (failed_at - prev["time"])  # the step cut short by the failure
            self.recovery_s += max(0.0, mttr - step_time)
            start = rec.get("attempt_start") or {}
            detected = next((t for t in self._detected if failed_at <= t <= rec["time"]), None)
            parts = recovery_parts(failed_at, detected, start, rec["time"] - step_time)
            failure = {
                "after_step": prev["step"],
                "resumed_at_step": step - 1,
                "lost_steps": len(redone),
                "lost_s": lost + (failed_at - prev["time"]),
                "mttr_s": mttr,
                "source": start.get("source", "storage"),
                **parts,
            }
            if cause:  # an injected fault, or a restart train.on_slow caused (on_slow_exclude ...)
                failure["cause"] = cause
            self.failures.append(failure)
            out.update(mttr_s=mttr, lost_steps=len(redone))
        if rec.get("attempt_start"):
            self.preflight_s += rec["attempt_start"].get("preflight_s", 0.0)
            self._ledger({"event": "attempt", "time": rec["time"], "step": step, **rec["attempt_start"]}, out)
        (self.skipped if rec.get("step_skipped") else self.productive)[step] = step_time
        self.checkpoint_s += rec.get("ckpt_block_s", 0.0) + rec.get("snapshot_block_s", 0.0)
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
        parts = {k: sum(f.get(k, 0.0) for f in self.failures) for k in PARTS}
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
            "recovery_parts": parts,
            "preflight_s": self.preflight_s,
            **({"checkpoint_model": self.model} if self.model else {}),
        }

    def _ledger(self, line: dict, out: dict | None = None) -> None:
        """Append one line to goodput.jsonl (the live attempt only; a replay adds nothing). An
        attempt line carries the failure before it, in parts."""
        if not self._live:
            return
        if line.get("event") == "attempt" and out and "mttr_s" in out and self.failures:
            line["failure"] = self.failures[-1]
        path = self.dir / LEDGER
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def progress(self) -> None:
        """A report step: the run's categories so far, one ledger line."""
        if self.enabled:
            keys = ("wall_s", "productive_s", "lost_s", "recovery_s", "checkpoint_s", "skipped_s", "other_s")
            summary = self.summary()
            line = {"event": "progress", "time": time.time(), **{k: summary[k] for k in keys}}
            parts = summary["recovery_parts"]
            line.update(goodput=summary["goodput"], preflight_total_s=summary["preflight_s"], **parts)
            self._ledger(line)

    def write(self) -> None:
        """<log_dir>/goodput.json, replaced atomically."""
        if not self.enabled:
            return
        path = self.dir / SUMMARY
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(self.summary(), indent=1) + "\n")
