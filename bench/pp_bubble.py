"""Pipeline bubble measured by the real executor vs theory, with equal-cost stages.

p gloo processes run threefold's PipelineExecutor over SleepStage chunks (fixed forward /
backward / weight-gradient times that use no CPU core), so p > cores still behaves like p
devices. Bubble = 1 - (compute time / step wall time), mean over ranks per step; reported as
the median over steps with its 95% bootstrap interval (bench/stats.py).

    python bench/pp_bubble.py [--p 4] [--m 8] [--forward-ms 10] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]
os.environ.setdefault("OMP_NUM_THREADS", "1")

from stats import Interval, bootstrap_median, show  # noqa: E402

from harness import run_ranks  # noqa: E402


def bubble_worker(cases: list[tuple[str, int]], p: int, m: int, forward_s: float, steps: int) -> dict:
    """Every (schedule, v) case in turn, in one process group (groups are slow to create on
    gloo); per case, this rank's bubble per step."""
    import torch

    from threefold.distributed.grid import Grid, RankLayout
    from threefold.distributed.pipeline import build_schedule
    from threefold.distributed.pipeline.executor import PipelineExecutor, StagePlan
    from threefold.distributed.pipeline.p2p import WireFormat
    from threefold.distributed.pipeline.synthetic import SleepStage
    from threefold.distributed.pipeline.weight_grad import WeightGradStore, attach_weight_grad_store
    from threefold.distributed.runtime import init_distributed, shutdown_distributed

    init_distributed(torch.device("cpu"), timeout_s=300)
    grid = Grid.build(RankLayout(pp=p))
    out = {}
    for schedule, v in cases:
        r, stages = grid.pp_rank, p * v
        chunks = [SleepStage(forward_s / v, last=(c * p + r == stages - 1)) for c in range(v)]
        store = WeightGradStore() if schedule == "zb" else None
        if store:
            attach_weight_grad_store(chunks, store)
        wire = WireFormat((4, 4), torch.float32, torch.device("cpu"))
        plan = StagePlan(
            chunks, [c * p + r == 0 for c in range(v)], [c * p + r == stages - 1 for c in range(v)], wire, grid.pp
        )
        executor = PipelineExecutor(plan, build_schedule(schedule, p, m, v)[r], store)
        micro = [(torch.ones(4, 4), torch.zeros(4, 4)) for _ in range(m)]
        bubbles = []
        for _ in range(steps + 1):
            _, stats = executor.run(micro, loss_divisor=1.0)
            busy = sum(stats.compute_s.values())
            bubbles.append(1.0 - busy / stats.wall_s)
        out[schedule] = bubbles[1:]  # the first step warms up the transfers
    shutdown_distributed()
    return out


def measure(cases: list[tuple[str, int]], p: int, m: int, forward_ms: float, steps: int) -> dict[str, list[float]]:
    """Per schedule, the bubble of each step (mean over ranks)."""
    per_rank = run_ranks(bubble_worker, p, cases, p, m, forward_ms / 1e3, steps, timeout=900)
    return {s: [statistics.mean(rank[s][i] for rank in per_rank) for i in range(steps)] for s, _ in cases}


def over_theory(row: dict) -> Interval:
    """measured / theory: the median over steps of each step's bubble / theory, bootstrapped."""
    return bootstrap_median([b / row["theory"] for b in row["per_step"]], unit="step")


def theory(schedule: str, p: int, m: int, v: int) -> float:
    from threefold.distributed.pipeline import bubble_theory

    return bubble_theory(schedule, p, m, v)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--forward-ms", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=5, help="measured steps per schedule (after one warm-up step)")
    args = ap.parse_args(argv)
    rows = []
    cases = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)]
    measured = measure(cases, args.p, args.m, args.forward_ms, args.steps)
    print(f"Stage forward {args.forward_ms:g} ms, {args.steps} steps after one warm-up step\n")
    print("| schedule | p | m | v | measured bubble (median) | theory | measured/theory [95% interval] |")
    print("|---|---|---|---|---|---|---|")
    for schedule, v in cases:
        want = theory(schedule, args.p, args.m, v)
        row = {
            "schedule": schedule,
            "p": args.p,
            "m": args.m,
            "v": v,
            "per_step": measured[schedule],
            "measured": statistics.median(measured[schedule]),
            "theory": want,
        }
        rows.append(row)
        print(
            f"| {schedule} | {args.p} | {args.m} | {v} | {row['measured']:.3f} | {want:.3f} | "
            f"{show(over_theory(row))} |",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
