"""One trial: the candidate's config as a TOML file, run by `threefold train --config` (the same
code path, launcher and all, as the run that will use the result) for a few steps, then read
back as the planner reads any run directory.

The trial runs inside whatever allocation `threefold tune` runs in: it is a child process on
this host, launched by the same torchrun agent `threefold train` always uses. An out-of-memory
failure, a refusal and any other failure are told apart from the trial's stderr, so the journal
says which and the tuner learns from each (tune/loop.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from threefold.config import Config
from threefold.planner.emit import write_config
from threefold.planner.tune.space import Candidate, trial_config

OOM_MARKERS = ("out of memory", "outofmemoryerror", "cannot allocate memory", "memoryerror")


@dataclass
class TrialResult:
    """What one trial measured, or why it has no measurement."""

    name: str
    status: str
    """ok | oom | refused | failed"""
    path: str
    seconds: float
    reason: str = ""
    tokens_per_s: float = 0.0
    step_time_s: float = 0.0
    noise: float = 0.0
    """Standard deviation of log(step time) over the steps used: the trial's own spread."""
    steps_used: int = 0
    categories: dict[str, float] = field(default_factory=dict)
    """Median measured seconds per planner category key (planner/runs.py), slowest rank."""

    def as_dict(self) -> dict:
        return {
            "status": self.status,
            "reason": self.reason,
            "path": self.path,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": self.tokens_per_s,
            "step_time_s": self.step_time_s,
            "noise": self.noise,
            "steps_used": self.steps_used,
            "categories": self.categories,
        }

    @classmethod
    def from_dict(cls, name: str, data: dict) -> TrialResult:
        keys = ("status", "reason", "path", "seconds", "tokens_per_s", "step_time_s", "noise", "steps_used")
        return cls(name=name, categories=dict(data.get("categories", {})), **{k: data[k] for k in keys if k in data})


def run_trial(cfg: Config, cand: Candidate, run_dir: Path, steps: int, timeout_s: float) -> TrialResult:
    """Train `cand` for `steps` steps into `run_dir` (run.json, metrics.jsonl, spans.jsonl)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "spans.jsonl", "run.json"):
        (run_dir / stale).unlink(missing_ok=True)
    trial = trial_config(cfg, cand.layout)
    trial.train.steps = steps
    trial.train.warmup_steps = min(trial.train.warmup_steps, 1)
    trial.log.dir, trial.log.spans, trial.log.quiet = str(run_dir), True, True
    trial.log.interval = 1  # spans reach spans.jsonl on report steps: every step, for the fit
    trial.checkpoint.dir, trial.checkpoint.resume, trial.checkpoint.interval = "", "", 0
    trial.train.eval_every = 0
    toml = write_config(str(run_dir / "trial.toml"), trial, f"tune trial {cand.name}")
    cmd = [sys.executable, "-m", "threefold", "train", "--config", str(toml)]
    start = time.perf_counter()
    env = dict(os.environ, THREEFOLD_TUNE_TRIAL=cand.name)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as err:
        _keep_output(run_dir, err.stdout, err.stderr)
        return TrialResult(
            cand.name, "failed", str(run_dir), time.perf_counter() - start, f"timed out after {timeout_s:g} s"
        )
    seconds = time.perf_counter() - start
    _keep_output(run_dir, proc.stdout, proc.stderr)
    if proc.returncode != 0:
        status, reason = classify_failure(proc.stderr or "", run_dir)
        return TrialResult(cand.name, status, str(run_dir), seconds, reason)
    return measure(cand.name, run_dir, seconds)


def measure(name: str, run_dir: Path, seconds: float) -> TrialResult:
    """A finished trial's run directory read as the planner reads a calibration run."""
    from threefold.errors import UserError
    from threefold.planner.runs import load_run

    try:
        run = load_run(str(run_dir))
    except UserError as err:
        return TrialResult(name, "failed", str(run_dir), seconds, str(err))
    t, m = run.cfg.train, run.cfg.model
    tokens = t.global_batch * m.seq_len
    return TrialResult(
        name,
        "ok",
        str(run_dir),
        seconds,
        tokens_per_s=tokens / run.step_time_s,
        step_time_s=run.step_time_s,
        noise=run.noise.get("step", 0.0),
        steps_used=run.steps_used,
        categories=dict(run.categories),
    )


def classify_failure(stderr: str, run_dir: Path) -> tuple[str, str]:
    """(status, one-line reason) of a trial that exited non-zero."""
    text = stderr
    for extra in ("agent.log", "failures.jsonl"):
        f = run_dir / extra
        if f.is_file():
            text += "\n" + f.read_text(encoding="utf-8", errors="replace")
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    said = next((line for line in reversed(lines) if line.startswith("threefold:")), lines[-1] if lines else "")
    if any(marker in text.lower() for marker in OOM_MARKERS):
        return "oom", said or "out of memory"
    if said.startswith("threefold: error:"):
        return "refused", said
    return "failed", said or "exited without a message"


def _keep_output(run_dir: Path, stdout, stderr) -> None:
    for name, text in (("stdout.txt", stdout), ("stderr.txt", stderr)):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        (run_dir / name).write_text(text or "", encoding="utf-8")
