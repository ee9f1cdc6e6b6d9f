"""Cost of span recording: the same run with log.spans off and on, side by side.

Each round trains the same config twice through `threefold train` (the production launcher),
once with spans off and once on, the order alternating between rounds to cancel machine
drift. Per-step time is the interval between consecutive metrics lines (everything counts:
the spans' marks, the per-step all-gather, spans.jsonl), after `--warmup` steps. A round is
one run of each; on / off is the median over rounds of the ratio of the two runs' median step
times, with its 95% bootstrap interval (bench/stats.py). Overhead = that ratio - 1.

    python bench/spans_overhead.py [--rounds 4] [--steps 20] [--warmup 4] [-- --parallel.tp 2 ...]

Default layout: tiny preset, tp2 x pp2 (4 processes), 1F1B over 4 micro-batches.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats import show  # noqa: E402
from timing import cell, on_off_rounds, ratio, steps_of  # noqa: E402

DEFAULT = [
    "--model.preset",
    "tiny",
    "--parallel.tp",
    "2",
    "--parallel.pp",
    "2",
    "--parallel.microbatches",
    "4",
    "--train.global_batch",
    "8",
    "--train.warmup_steps",
    "2",
]


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ours, _, extra = (
        (argv[: argv.index("--")], None, argv[argv.index("--") + 1 :]) if "--" in argv else (argv, None, [])
    )
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="rounds: one run with spans off, one with spans on")
    ap.add_argument("--steps", type=int, default=20, help="training steps per run")
    ap.add_argument("--warmup", type=int, default=4, help="step intervals dropped at the start of each run")
    ap.add_argument("--quick", action="store_true", help="2 rounds (off, on) of 6 steps: indicative only")
    args = ap.parse_args(ours)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 6, 2
    extra = extra or DEFAULT
    blocks = on_off_rounds(extra, "log.spans", args.rounds, args.steps, args.warmup)
    on_off = ratio(blocks, "on", "off")
    result = {"blocks": blocks, "rounds": args.rounds, "steps": args.steps, "config": " ".join(extra)}
    print(
        f"{args.rounds} rounds (off/on, order alternating) x {args.steps} steps, the first {args.warmup} "
        "intervals of each run dropped; median [IQR] ms/step; on / off: median per-round ratio [95% bootstrap "
        "interval]\n"
    )
    print("| run | spans off (ms/step) | spans on (ms/step) | on / off |")
    print("|---|---|---|---|")
    print(
        f"| `{result['config']}` | {cell(steps_of(blocks['off']))} | {cell(steps_of(blocks['on']))} | {show(on_off)} |"
    )
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
