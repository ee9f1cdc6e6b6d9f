"""Cost of one collective call and of one ring step when ranks share cores (the cpu profile's priors).

    python bench/ring_latency.py                     # 4 ranks, groups of 2 and 4
    python bench/ring_latency.py --world 8 --groups 2 4 8 --burst-ms 5

Every rank alternates a burst of matrix multiplications (what a training rank does between two
TP collectives) with an all-reduce of a few floats inside its group of `g` consecutive ranks,
the way TP groups are laid out. Only the all-reduce is timed. gloo's ring all-reduce takes
2 (g - 1) steps, so the median time per call is fitted as

    call(g) = collective_overhead + 2 (g - 1) * ring_step_latency

over the group sizes. With more ranks than cores a rank's peer is often off its core when the
rank's message arrives, so each step waits for the scheduler to give the peer its core back:
that wait, not the wire, is the ring-step latency the planner's cpu profile uses.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dp_common import spawn  # noqa: E402
from stats import Interval, bootstrap, show  # noqa: E402

from threefold.observe.host import available_cores  # noqa: E402


def _rank_main(groups: list[int], calls: int, burst_ms: float, rounds: int) -> dict[int, list[float]]:
    """Seconds of every timed all-reduce for each group size, on this rank."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    a = torch.randn(192, 192)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    # Every rank does the same work between calls (its own timing, taken on a shared core,
    # would differ): the fastest rank's estimate, agreed by all.
    per_mm = torch.tensor([(time.perf_counter() - t0) / 20])
    dist.all_reduce(per_mm, op=dist.ReduceOp.MIN)
    reps = max(1, round(burst_ms * 1e-3 / per_mm.item()))
    mine = {}
    for g in groups:
        for start in range(0, world, g):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(start, start + g)))
            if start <= rank < start + g:
                mine[g] = group
    x = torch.ones(4)
    for g in groups:  # connect each group before timing
        dist.all_reduce(x, group=mine[g])
    times: dict[int, list[float]] = {g: [] for g in groups}
    for r in range(rounds):  # group sizes alternate (A, B, A, B ...) so machine drift hits all alike
        for g in groups if r % 2 == 0 else groups[::-1]:
            dist.barrier()
            for _ in range(calls // rounds):
                for _ in range(reps):
                    a @ a
                t = time.perf_counter()
                dist.all_reduce(x, group=mine[g])
                times[g].append(time.perf_counter() - t)
    dist.destroy_process_group()
    return times


def group_ratio(per_rank: list[dict], a: int, b: int) -> Interval:
    """call(a) / call(b), a call costing the slowest rank's median, with a 95% interval from
    resampling every rank's calls (each rank and group size independently)."""

    def statistic(*arrays):  # the a-group arrays of every rank, then the b-group ones
        ranks = len(per_rank)
        slowest = lambda xs: np.max([np.median(x, axis=-1) for x in xs], axis=0)  # noqa: E731
        return slowest(arrays[:ranks]) / slowest(arrays[ranks:])

    samples = [r[a] for r in per_rank] + [r[b] for r in per_rank]
    return bootstrap(samples, statistic, f"bootstrap over {len(per_rank[0][a])} calls per rank")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="bench/ring_latency.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--world", type=int, default=4, help="ranks (more than the host's cores to measure sharing)")
    ap.add_argument("--groups", type=int, nargs="+", default=[2, 4], help="group sizes (each divides --world)")
    ap.add_argument("--calls", type=int, default=80, help="timed all-reduces per group size")
    ap.add_argument(
        "--burst-ms",
        type=float,
        default=20.0,
        help="compute between two calls, milliseconds (training's TP collectives: ~10-40)",
    )
    ap.add_argument("--rounds", type=int, default=4, help="blocks per group size, the sizes alternating")
    ap.add_argument("--quick", action="store_true", help="30 calls per group size: indicative only")
    args = ap.parse_args(argv)
    if args.quick:
        args.calls, args.rounds = 30, 2
    bad = [g for g in args.groups if g < 2 or args.world % g]
    if bad or len(set(args.groups)) < 2:
        ap.error(f"--groups needs two or more sizes >= 2 that divide --world {args.world} (got {args.groups})")
    per_rank = spawn(_rank_main, args.world, args.groups, args.calls, args.burst_ms, args.rounds, timeout=600)
    # The slowest rank's median per size, as the training step waits for its slowest rank.
    call = {g: max(statistics.median(r[g]) for r in per_rank) for g in args.groups}
    steps = np.array([[1.0, 2 * (g - 1)] for g in args.groups])
    (overhead, step), *_ = np.linalg.lstsq(steps, np.array([call[g] for g in args.groups]), rcond=None)
    print(f"{args.world} ranks on {available_cores()} cores, {args.burst_ms:g} ms of compute between calls\n")
    print("| group | ring steps | ms per all-reduce |")
    print("|---|---|---|")
    for g in args.groups:
        print(f"| {g} | {2 * (g - 1)} | {call[g] * 1e3:.2f} |")
    print(f"fit: collective_overhead_us {overhead * 1e6:.0f}, intra_latency_us {step * 1e6:.0f}")
    big, small = max(args.groups), min(args.groups)
    print(
        f"\ngroup of {big} / group of {small} per call: {show(group_ratio(per_rank, big, small))} "
        "(95% bootstrap interval)"
    )
    return {
        "world": args.world,
        "call_s": call,
        "samples": per_rank,
        "collective_overhead_us": overhead * 1e6,
        "intra_latency_us": step * 1e6,
    }


if __name__ == "__main__":
    main()
