"""What memory replicas cost a step: checkpoint.memory_interval 1 (a snapshot after every step,
its copy sent to a rank of the other node) against 0, paired.

    python bench/replica_stall.py [--rounds 6] [--steps 40] [--warmup 8]

dp2 x pp2 of the tiny model in four processes, two "nodes" of two (parallel.devices_per_node 2,
so each rank's snapshot has a buddy on the other node), the production launcher. A round is one
run with snapshots and one without, their order alternating; a run's step time is the median of
the intervals between its metrics lines after the warm-up (everything a step costs, the
snapshot's stall included). The ratio is the median of the per-round ratios with its 95%
bootstrap interval (bench/stats.py). The host RAM the replicas hold is `threefold memory`'s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stats import paired_ratio, show  # noqa: E402
from timing import on_off_rounds  # noqa: E402

ARGS = ["--parallel.dp", "2", "--parallel.pp", "2", "--parallel.devices_per_node", "2", "--train.lr", "5e-4"]
ARGS += ["--checkpoint.dir", ""]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="bench/replica_stall.py", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8)
    args = ap.parse_args(argv)
    blocks = on_off_rounds(ARGS, "checkpoint.memory_interval", args.rounds, args.steps, args.warmup, ("0", "1"))
    on = [statistics.median(b) for b in blocks["on"]]
    off = [statistics.median(b) for b in blocks["off"]]
    ratio = paired_ratio(on, off)
    print("| layout | snapshot every | step, replicas off (ms) | step, replicas on (ms) | on / off [95% interval] |")
    print("|---|---|---|---|---|")
    print(
        f"| tiny dp2 x pp2, 2 nodes of 2 | 1 step | {statistics.median(off) * 1e3:.1f} | "
        f"{statistics.median(on) * 1e3:.1f} | {show(ratio)} |"
    )
    return {"ratio": ratio.value, "lo": ratio.lo, "hi": ratio.hi, "on_s": on, "off_s": off}


if __name__ == "__main__":
    main()
