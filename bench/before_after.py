"""One change, measured: the same `threefold train` run from two source trees, side by side.

    git worktree add /tmp/before <commit>
    python bench/before_after.py --before /tmp/before --after . --rounds 6
    python bench/before_after.py --before /tmp/before --cases moe-ep2 --steps 10 --warmup 3

Each round runs every case once from each tree (the order alternates between rounds, so machine
drift hits both alike) through the production launcher, with the tree first on PYTHONPATH, and
takes the median `step_time_s` of the run's steps after `--warmup`. The speed-up is the median of
the per-round ratios before/after with its 95% bootstrap interval (bench/stats.py): above 1 the
change is faster. Both trees run the same arguments; a case that fails in either says so.
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

from stats import paired_ratio, show

CASES = {
    # Ring attention over two context ranks at a 4k sequence: the ring's per-block kernels.
    "cp2-ring-4k": [
        "--model.preset", "tiny", "--model.seq_len", "4096", "--parallel.cp", "2", "--parallel.cp_impl", "ring",
        "--train.global_batch", "2", "--train.micro_batch", "1",
    ],
    # The tiny model with 8 experts, top-2, sharded over two expert ranks (dp 2): routing,
    # dispatch and the expert matmuls.
    "moe-ep2": [
        "--model.preset", "tiny", "--model.num_experts", "8", "--model.top_k", "2",
        "--parallel.dp", "2", "--parallel.ep", "2", "--train.global_batch", "8", "--train.micro_batch", "2",
    ],
}  # fmt: skip


def step_seconds(tree: Path, args: list[str], steps: int, warmup: int) -> float:
    """Median step time of one run of `threefold train` imported from `tree`."""
    with tempfile.TemporaryDirectory() as log:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree.resolve()))
        cmd = [sys.executable, "-m", "threefold", "train", *args, "--train.steps", str(steps)]
        cmd += ["--log.dir", log, "--log.quiet", "true", "--checkpoint.dir", ""]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"{tree}: exit {done.returncode}: {last}")
        lines = [json.loads(x) for x in Path(log, "metrics.jsonl").read_text().splitlines()]
    times = [x["step_time_s"] for x in lines if "step_time_s" in x][warmup:]
    if not times:
        raise RuntimeError(f"{tree}: no step after {warmup} warm-up steps (raise --steps)")
    return statistics.median(times)


def measure(trees: dict[str, Path], args: list[str], rounds: int, steps: int, warmup: int) -> dict[str, list]:
    """Per-round median step times of each tree, the order alternating between rounds."""
    times: dict[str, list[float]] = {name: [] for name in trees}
    for r in range(rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            times[name].append(step_seconds(trees[name], args, steps, warmup))
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench/before_after.py", description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="source tree of the code before the change")
    ap.add_argument("--after", type=Path, default=Path(__file__).resolve().parents[1], help="tree after it")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out (start-up, compilation)")
    args = ap.parse_args(argv)
    trees = {"before": args.before, "after": args.after}
    print("| case | before s/step (median) | after s/step (median) | before / after [95% CI] |")
    print("|---|---|---|---|")
    for case in args.cases:
        try:
            t = measure(trees, CASES[case], args.rounds, args.steps, args.warmup)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            print(f"| {case} | failed: {str(err).splitlines()[0]} | | |")
            continue
        speedup = paired_ratio(t["before"], t["after"])
        med = {name: statistics.median(v) for name, v in t.items()}
        print(f"| {case} | {med['before']:.3f} | {med['after']:.3f} | {show(speedup)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
