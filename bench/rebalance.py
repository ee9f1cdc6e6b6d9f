"""train.on_slow rebalance: a heavy pipeline stage's step time before and after the restart with
the uneven partition the action chose.

Each round trains one run through `threefold train` (the production launcher) with a slow
stage and `--train.on_slow rebalance --train.max_restarts 1`: the slow-stage detector names it,
the action saves, writes the new partition and restarts, and the run trains on with it. The
default slow stage is a slower device: pp 2 of the tiny model (2 of 4 layers per stage) whose
stage-0 rank computes every block 3x slower (`--fault` DEVICE: slowlayer on layers 0 and 1 with
:rank=0, stretching each forward and backward pass there; a layer moved off rank 0 computes at
full speed). `--fault slow:rank=0:factor=3` instead sleeps once per step for twice the rank's
measured compute, waits included, so a cut does not shorten it: no gain to measure. A heavy
partition of real compute is `--fault '' -- --parallel.stage_layers 5,1 --model.layers 6 ...`: on a
host whose cores both stages' ranks share, cutting it evens the work but not the step. The step
time of each attempt (metrics.jsonl's step_time_s) is the median over its steps after `--warmup`
steps; a round's ratio is after / before, and the result is the median of the rounds' ratios with
its 95% bootstrap interval (bench/stats.py). Both halves run in the same run, back to back, so a
machine's drift between rounds cancels; a round whose action did not fire (the detector did not
name the stage on train.on_slow_reports reports in a row) is reported and left out.

    python bench/rebalance.py [--rounds 4] [--steps 24] [--warmup 2] [--fault SPEC] [-- --parallel.pp 2 ...]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats import paired_ratio, show  # noqa: E402

DEVICE = "slowlayer:layer=0:factor=3:rank=0,slowlayer:layer=1:factor=3:rank=0"
"""Stage 0's rank, a 3x slower device for the two blocks it holds in the balanced partition."""
DEFAULT = [
    "--model.preset",
    "tiny",
    "--parallel.pp",
    "2",
    "--parallel.microbatches",
    "4",
    "--train.global_batch",
    "8",
    "--train.micro_batch",
    "2",
    "--train.warmup_steps",
    "2",
]


def one_round(args: list[str], steps: int, warmup: int, interval: int, fault: str) -> dict | None:
    """One run: {"before": s, "after": s, "partition": "4,2", "acted_at": step} (median step
    seconds of each attempt past its first `warmup` steps), or None when the action did not act."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "threefold", "train", *args, "--train.steps", str(steps)]
        cmd += ["--train.on_slow", "rebalance", "--train.on_slow_reports", "2", "--train.max_restarts", "1"]
        cmd += ["--log.interval", str(interval), "--checkpoint.dir", f"{tmp}/ckpt"]
        cmd += ["--checkpoint.interval", str(interval), "--log.dir", f"{tmp}/log", "--log.quiet", "true"]
        subprocess.run(
            cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1", THREEFOLD_FAULT=fault), capture_output=True
        )
        log = Path(tmp) / "log"
        rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
        if not (log / "rebalance.json").exists():
            return None
        (entry,) = json.loads((log / "rebalance.json").read_text()).values()
    segments: dict[str, list[float]] = {}
    for row in rows:
        segments.setdefault(row["segment"], []).append(row["step_time_s"])
    if len(segments) != 2:
        return None
    before, after = (times[warmup:] for times in segments.values())
    if not before or not after:
        return None
    return {
        "before": statistics.median(before),
        "after": statistics.median(after),
        "partition": entry["stage_layers"],
        "acted_at": entry["step"],
    }


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="runs, each timed before and after its rebalance")
    ap.add_argument("--steps", type=int, default=24, help="training steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of each attempt")
    ap.add_argument("--interval", type=int, default=4, help="log.interval and checkpoint.interval")
    ap.add_argument("--fault", default=DEVICE, help="THREEFOLD_FAULT of every run ('' = none)")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 12 steps: indicative only")
    args = ap.parse_args(ours)
    if args.quick:
        args.rounds, args.steps, args.interval = 2, 12, 2
    extra = extra or DEFAULT
    rounds = [one_round(extra, args.steps, args.warmup, args.interval, args.fault) for _ in range(args.rounds)]
    kept = [r for r in rounds if r is not None]
    if not kept:
        print(f"the action did not fire in any of {args.rounds} rounds")
        return {}
    after_before = paired_ratio([r["after"] for r in kept], [r["before"] for r in kept])
    given = [extra[i + 1] for i, a in enumerate(extra) if a == "--parallel.stage_layers"]
    heavy = (given[-1] if given else "balanced") + (f" with `{args.fault}`" if args.fault else "")
    partitions = ", ".join(sorted({r["partition"] for r in kept}))
    print(
        f"{len(kept)} of {args.rounds} rounds acted (each one run of {args.steps} steps, rebalanced after the "
        f"checkpoint of step {', '.join(str(r['acted_at']) for r in kept)}); median step time of each attempt past "
        f"its first {args.warmup} steps; after / before: median per-round ratio [95% bootstrap interval]\n"
    )
    print("| run | slow stage | chosen | before (ms/step) | after (ms/step) | after / before |")
    print("|---|---|---|---|---|---|")
    before_ms = statistics.median(1e3 * r["before"] for r in kept)
    after_ms = statistics.median(1e3 * r["after"] for r in kept)
    print(f"| `{' '.join(extra)}` | {heavy} | {partitions} | {before_ms:.1f} | {after_ms:.1f} | {show(after_before)} |")
    return {"rounds": rounds, "after_before": after_before}


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
