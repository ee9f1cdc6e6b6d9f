"""Chrome/Perfetto trace files (the JSON "trace event format"): one process track per rank.

Each rank's spans become complete events (ph "X", microseconds) on pid = global rank, tid 0;
nested spans nest on the track. A rank's timestamps are relative to its own start of the step:
every step begins right after the previous step's global reductions, so the ranks line up to
within that reduction's skew on any number of hosts (perf_counter is not one clock across
nodes). Traced steps follow one another on the time axis, separated by a small gap.
"""

from __future__ import annotations

import json
from pathlib import Path

from threefold.atomic import atomic_open

GAP_US = 1000.0  # between consecutive traced steps


def rank_name(rank: int, coords: dict) -> str:
    parts = " ".join(f"{k}{coords[k]}" for k in ("tp", "pp", "dp", "ep") if k in coords)
    return f"rank {rank} ({parts})" if parts else f"rank {rank}"


def metadata_events(ranks: list[tuple[int, dict]]) -> list[dict]:
    """Track names and order: one process per rank."""
    out = []
    for rank, coords in ranks:
        out.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": rank,
                "tid": 0,
                "ts": 0,
                "args": {"name": rank_name(rank, coords)},
            }
        )
        out.append(
            {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "ts": 0, "args": {"sort_index": rank}}
        )
    return out


def step_events(step: int, offset_us: float, per_rank: list[tuple[int, list]]) -> list[dict]:
    """Complete events of one traced step from each rank's (category, label, start_s, dur_s, depth)."""
    out = []
    for rank, events in per_rank:
        for category, label, start, duration, depth in events:
            out.append(
                {
                    "name": f"step {step}" if depth == 0 else label,
                    "cat": category,
                    "ph": "X",
                    "ts": offset_us + start * 1e6,
                    "dur": duration * 1e6,
                    "pid": rank,
                    "tid": 0,
                    "args": {"step": step, "depth": depth},
                }
            )
    return out


def write_json_atomic(path: Path, doc) -> None:
    """Write to a temp file and rename: a reader sees the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, text=True) as f:
        json.dump(doc, f, separators=(",", ":"))


class TraceFile:
    """Accumulates traced steps and rewrites <dir>/trace.json after each one."""

    def __init__(self, log_dir: str | Path, ranks: list[tuple[int, dict]]):
        self.path = Path(log_dir) / "trace.json"
        self.events = metadata_events(ranks)
        self.offset_us = 0.0

    def add_step(self, step: int, per_rank: list[tuple[int, list]], wall_s: float) -> None:
        self.events += step_events(step, self.offset_us, per_rank)
        self.offset_us += wall_s * 1e6 + GAP_US
        write_json_atomic(self.path, {"traceEvents": self.events, "displayTimeUnit": "ms"})


def gantt_rows(doc: dict, step: int | None = None) -> tuple[int, dict[int, list]]:
    """The spans of one traced step (the first when `step` is None), per rank (pid): a list of
    (category, name, start_ms, duration_ms, depth) sorted by start, the step itself left out.
    Returns (step, rows)."""
    spans = [e for e in doc.get("traceEvents", []) if e.get("ph") == "X"]
    steps = sorted({e["args"]["step"] for e in spans if "step" in e.get("args", {})})
    if not steps:
        return 0, {}
    step = steps[0] if step is None else step
    starts = {e["pid"]: e["ts"] for e in spans if e["args"].get("step") == step and e["args"].get("depth") == 0}
    rows: dict[int, list] = {}
    for e in spans:
        a = e["args"]
        if a.get("step") != step or a.get("depth", 0) == 0:
            continue
        rows.setdefault(e["pid"], []).append(
            (e["cat"], e["name"], (e["ts"] - starts.get(e["pid"], 0.0)) / 1e3, e["dur"] / 1e3, a.get("depth", 1))
        )
    for r in rows.values():
        r.sort(key=lambda x: (x[2], x[4]))
    return step, dict(sorted(rows.items()))


def check_trace(doc) -> list[str]:
    """Problems with a trace-event document (empty when valid): the fields Perfetto and
    chrome://tracing need, with their types."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["top level must be an object with a traceEvents list"]
    problems = []
    for i, e in enumerate(doc["traceEvents"]):
        if not isinstance(e, dict):
            problems.append(f"event {i} is not an object")
            continue
        if not isinstance(e.get("name"), str) or not isinstance(e.get("ph"), str):
            problems.append(f"event {i}: name and ph must be strings")
        for key in ("pid", "tid"):
            if not isinstance(e.get(key), int):
                problems.append(f"event {i}: {key} must be an integer")
        if not isinstance(e.get("ts"), (int, float)):
            problems.append(f"event {i}: ts must be a number")
        if e.get("ph") == "X" and not (isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0):
            problems.append(f"event {i}: a complete event needs dur >= 0")
        if "args" in e and not isinstance(e["args"], dict):
            problems.append(f"event {i}: args must be an object")
    return problems
