"""Cost of span recording: the same run with log.spans off and on, side by side.

Each round trains the same config twice through `threefold train` (the production launcher),
once with spans off and once on, the order alternating between rounds to cancel machine
drift. Per-step time is the interval between consecutive metrics lines (everything counts:
the spans' marks, the per-step all-gather, spans.jsonl), after `--warmup` steps.
Overhead = median(on) / median(off) - 1.

    python bench/spans_overhead.py [--rounds 5] [--steps 30] [--warmup 5] [-- --parallel.tp 2 ...]

Default layout: tiny preset, tp2 x pp2 (4 processes), 1F1B over 4 micro-batches.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT = ["--model.preset", "tiny", "--parallel.tp", "2", "--parallel.pp", "2", "--parallel.microbatches", "4",
           "--train.global_batch", "8", "--train.warmup_steps", "2"]


def step_times(extra: list[str], spans: bool, steps: int, warmup: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "threefold", "train", *extra, "--train.steps", str(steps),
               "--log.dir", tmp, "--log.quiet", "true", "--log.spans", "true" if spans else "false"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        stamps = [json.loads(line)["time"] for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    return [b - a for a, b in zip(stamps, stamps[1:])][warmup:]


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ours, _, extra = (argv[:argv.index("--")], None, argv[argv.index("--") + 1:]) if "--" in argv else (argv, None, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="1 round (off, on) of 6 steps: indicative only")
    args = ap.parse_args(ours)
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 6, 2
    extra = extra or DEFAULT
    off, on = [], []
    for r in range(args.rounds):
        for spans in ((False, True) if r % 2 == 0 else (True, False)):
            (on if spans else off).append(statistics.median(step_times(extra, spans, args.steps, args.warmup)))
    a, b = statistics.median(off), statistics.median(on)
    result = {"off_ms": 1e3 * a, "on_ms": 1e3 * b, "overhead": b / a - 1, "off_rounds_ms": [1e3 * x for x in off],
              "on_rounds_ms": [1e3 * x for x in on], "rounds": args.rounds, "steps": args.steps,
              "config": " ".join(extra)}
    print(f"{args.rounds} rounds (off/on alternating) x {args.steps} steps, median of round medians")
    print("| run | spans off (ms/step) | spans on (ms/step) | overhead |")
    print("|---|---|---|---|")
    print(f"| `{result['config']}` | {a * 1e3:.1f} | {b * 1e3:.1f} | {100 * result['overhead']:+.2f}% |")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
