"""Reading a run directory back: run.json, metrics.jsonl and, when spans were on, spans.jsonl and
trace.json; the goodput ledger goodput.jsonl when the run wrote one. A missing or unreadable
required file is one clear line (RunDirError, exit 2); a half-written last line (a run still
going, or killed mid-write) is dropped with a note.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from threefold.errors import UserError


class RunDirError(UserError):
    """A run directory lacks what a report needs."""


@dataclass
class Run:
    path: Path
    info: dict  # run.json
    metrics: list[dict]
    spans: list[dict] = field(default_factory=list)  # spans.jsonl: per step, every rank's categories
    trace: dict | None = None
    notes: list[str] = field(default_factory=list)
    ledger: list[dict] = field(default_factory=list)  # goodput.jsonl: every attempt's lines

    @property
    def config(self) -> dict:
        return self.info.get("config", {})

    @property
    def name(self) -> str:
        return self.path.name or str(self.path)

    def steady(self, records: list[dict]) -> list[dict]:
        """The steps after the first (start-up, first-touch allocation), when there are others."""
        return records[1:] if len(records) > 1 else records


def _read_jsonl(path: Path, notes: list[str]) -> list[dict]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # the line being written when the run stopped
                notes.append(f"{path.name}: dropped a half-written last line")
                break
            raise RunDirError(f"{path}: line {i + 1} is not JSON (the file is damaged)") from None
        if not isinstance(record, dict):
            raise RunDirError(f"{path}: line {i + 1} is not a JSON object (the file is damaged)")
        out.append(record)
    return out


def load_run(path: str | Path) -> Run:
    """Read a run directory; raises RunDirError naming what is missing."""
    path = Path(path)
    if not path.exists():
        raise RunDirError(f"report: {path} does not exist (give the run's log.dir)")
    if not path.is_dir():
        raise RunDirError(f"report: {path} is not a directory (give the run's log.dir)")
    run_json, metrics_path = path / "run.json", path / "metrics.jsonl"
    if not run_json.exists():
        what = (
            "has metrics.jsonl but no run.json (copied in part?)"
            if metrics_path.exists()
            else "has no run.json (not a run directory, or the run never started)"
        )
        raise RunDirError(f"report: {path} {what}")
    try:
        info = json.loads(run_json.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise RunDirError(f"report: {run_json} is not valid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(info, dict) or not isinstance(info.get("config"), dict):
        raise RunDirError(f"report: {run_json} has no config section (not written by threefold train)")
    if not metrics_path.exists():
        raise RunDirError(f"report: {path} has no metrics.jsonl (the run stopped before its first step ended)")
    notes: list[str] = []
    metrics = [m for m in _read_jsonl(metrics_path, notes) if "step" in m]
    if not metrics:
        raise RunDirError(f"report: {metrics_path} has no complete step yet")
    run = Run(path, info, metrics, notes=notes)
    spans_path = path / "spans.jsonl"
    if spans_path.exists():
        run.spans = [s for s in _read_jsonl(spans_path, notes) if isinstance(s.get("ranks"), list)]
    ledger_path = path / "goodput.jsonl"
    if ledger_path.exists():
        run.ledger = _read_jsonl(ledger_path, notes)
    trace_path = path / "trace.json"
    if trace_path.exists():
        try:
            run.trace = json.loads(trace_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            notes.append("trace.json is not valid JSON: no pipeline timeline")
    return run
