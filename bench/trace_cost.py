"""What the default traced step costs (log.trace_steps 'auto', #33), timed where it is paid.

The step that 'auto' traces is a report step anyway, so tracing it adds the span lists' gather to
rank 0, the replays of the step's dp and cp exchanges, and the trace.json write, all inside
StepObserver.end_step, and the keeping of every span during the step. The first part is timed
here directly: each round trains the same config twice through threefold's worker (the order
alternating), with the trace and with log.trace_steps '', timing end_step on every step of rank 0
(the rank that gathers and writes); the figure is the traced step's end_step with the trace minus
the same step's without, the median over rounds with its 95% bootstrap interval (bench/stats.py).
bench/spans_overhead.py --trace measures the whole step side by side, where this cost is below
the step-to-step noise.

    python bench/trace_cost.py [--rounds 6] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dp_common import spawn  # noqa: E402
from stats import bootstrap_median, show  # noqa: E402

LAYOUTS = {
    "one process": {},
    "dp2": {"parallel.dp": 2},
    "tp2 x pp2": {"parallel.tp": 2, "parallel.pp": 2, "parallel.microbatches": 4, "train.global_batch": 8},
}
BASE = {"model.preset": "tiny", "train.warmup_steps": 2, "checkpoint.dir": ""}

_END_STEP_S: dict[int, float] = {}  # this process's end_step seconds by step (counted from 1)


def _time_end_step() -> None:
    """Wrap StepObserver.end_step once per process to record its seconds by step."""
    from threefold.observe import observer

    if getattr(observer.StepObserver.end_step, "timed", False):
        return
    end_step = observer.StepObserver.end_step

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        out = end_step(self, *args, **kwargs)
        _END_STEP_S[self._step] = time.perf_counter() - start
        return out

    timed.timed = True
    observer.StepObserver.end_step = timed


def train_timing_end_step(cfg_dict: dict) -> dict[int, float]:
    """One rank of a training run; its end_step seconds by step."""
    from threefold.training.worker import run_worker

    _time_end_step()
    _END_STEP_S.clear()
    run_worker(cfg_dict)
    return dict(_END_STEP_S)


def end_step_seconds(overrides: dict, steps: int, trace: str) -> tuple[int | None, dict[int, float]]:
    """(the traced step, rank 0's end_step seconds by step) of one run with log.trace_steps `trace`."""
    from threefold.config import build_config
    from threefold.validate import validate

    with tempfile.TemporaryDirectory() as tmp:
        pairs = {**BASE, **overrides, "train.steps": steps, "log.dir": tmp, "log.quiet": True}
        pairs["log.trace_steps"] = trace
        cfg = validate(build_config(None, [(k, str(v)) for k, v in pairs.items()]))
        world = cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp
        traced = int(cfg.log.trace_steps) if cfg.log.trace_steps else None
        if world == 1:
            return traced, train_timing_end_step(cfg.to_dict())
        return traced, spawn(train_timing_end_step, world, cfg.to_dict())[0]


def measure(overrides: dict, rounds: int, steps: int) -> dict:
    """Per round, the traced step's end_step with the trace and without (milliseconds)."""
    on, off, step = [], [], None
    for r in range(rounds):
        for trace in ("auto", "") if r % 2 == 0 else ("", "auto"):
            traced, seconds = end_step_seconds(overrides, steps, trace)
            step = traced or step
            (on if trace else off).append(seconds)
    on_ms = [1e3 * run[step] for run in on]
    off_ms = [1e3 * run[step] for run in off]
    extra = bootstrap_median([a - b for a, b in zip(on_ms, off_ms)], unit="round")
    return {"step": step, "on_ms": on_ms, "off_ms": off_ms, "extra_ms": extra}


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6, help="rounds: one run with the trace, one without")
    ap.add_argument("--steps", type=int, default=20, help="training steps per run")
    args = ap.parse_args(argv)
    rows = {name: measure(over, args.rounds, args.steps) for name, over in LAYOUTS.items()}
    print(
        f"{args.rounds} rounds (trace auto / '', order alternating) x {args.steps} steps, tiny preset; rank 0's "
        "StepObserver.end_step on the step 'auto' traces, median over rounds in ms; traced - untraced: median "
        "per-round difference [95% bootstrap interval]\n"
    )
    print("| layout | traced step | end_step untraced (ms) | end_step traced (ms) | traced - untraced (ms) |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        print(
            f"| {name} | {row['step']} | {statistics.median(row['off_ms']):.2f} | "
            f"{statistics.median(row['on_ms']):.2f} | {show(row['extra_ms'])} |"
        )
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
