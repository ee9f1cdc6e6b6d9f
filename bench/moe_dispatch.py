"""Expert parallelism on CPU/gloo: all-to-all dispatch time and MoE tokens/s for ep 1, 2, 4.

One process group of 4 ranks (dp 4); for each ep the same MoE layer (8 experts, top-2,
dropless) is built by threefold's build path (layout-invariant init, experts sharded over
ep), and every rank pushes its own tokens through forward + backward. With ep 1 each rank
computes every expert for its tokens; with ep 4 each holds 2 experts and tokens travel
there and back by all-to-all. Contestants alternate in rounds (ep1, ep2, ep4, ep1, ...).

Reported per ep: median time of one MoE forward+backward (the slowest rank's), the part of it
spent inside the all-to-alls (dispatch + combine, both directions: timed around
torch.distributed's all_to_all_single by this script only, as rank 0 saw it), and tokens/s
over all ranks. A round is one block of steps per ep; the ratios (tokens/s vs ep 1,
all-to-all share of the step) are medians of per-round ratios of round medians, with 95%
bootstrap intervals (bench/stats.py).

    python bench/moe_dispatch.py [--rounds 8] [--steps 3] [--tokens 1024] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]
os.environ.setdefault("OMP_NUM_THREADS", "1")

from stats import Interval, paired_ratio, show  # noqa: E402
from timing import round_medians, steps_of, summary  # noqa: E402

from harness import run_ranks  # noqa: E402

WORLD = 4
EPS = (1, 2, 4)


def _worker(rounds: int, steps: int, tokens: int, hidden: int, ffn: int, experts: int) -> dict:
    import torch
    import torch.distributed as dist

    from threefold.config import build_config
    from threefold.distributed.grid import Grid, RankLayout
    from threefold.distributed.parallelize import build_model
    from threefold.distributed.runtime import init_distributed, shutdown_distributed
    from threefold.validate import validate

    init_distributed(torch.device("cpu"), timeout_s=300)
    a2a = {"s": 0.0}
    raw = dist.all_to_all_single

    def timed(*args, **kwargs):  # this script's instrumentation, not threefold's
        t0 = time.perf_counter()
        out = raw(*args, **kwargs)
        a2a["s"] += time.perf_counter() - t0
        return out

    dist.all_to_all_single = timed
    layers = {}
    for ep in EPS:
        pairs = [
            ("model.num_experts", experts),
            ("model.top_k", 2),
            ("model.hidden", hidden),
            ("model.heads", 4),
            ("model.kv_heads", 4),
            ("model.ffn_hidden", ffn),
            ("model.layers", 1),
            ("model.seq_len", tokens),
            ("parallel.dp", WORLD),
            ("parallel.ep", ep),
            ("train.global_batch", WORLD),
            ("train.micro_batch", 1),
        ]
        cfg = validate(build_config(None, [(k, str(v)) for k, v in pairs]), WORLD)
        grid = Grid.build(RankLayout(dp=WORLD, ep=ep))
        layers[ep] = build_model(cfg, grid, torch.device("cpu")).layers["0"].mlp
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(tokens, 1, hidden, generator=gen).requires_grad_()
    times = {ep: [] for ep in EPS}  # per round, per step
    comm = {ep: [] for ep in EPS}
    for _ in range(rounds):
        for ep in EPS:
            layer = layers[ep]
            times[ep].append([])
            comm[ep].append([])
            for _ in range(steps):
                dist.barrier()
                a2a["s"] = 0.0
                t0 = time.perf_counter()
                layer(x).sum().backward()
                times[ep][-1].append(time.perf_counter() - t0)
                comm[ep][-1].append(a2a["s"])
                layer.pop_stats()
    dist.all_to_all_single = raw
    shutdown_distributed()
    return {"times": times, "comm": comm}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="bench/moe_dispatch.py")
    ap.add_argument("--rounds", type=int, default=8, help="rounds: one block of steps per ep")
    ap.add_argument("--steps", type=int, default=3, help="steps per ep per round")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank per step")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="3 rounds of 1 step, 256 tokens per rank")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.tokens = 3, 1, 256
    results = run_ranks(
        _worker, WORLD, args.rounds, args.steps, args.tokens, args.hidden, args.ffn, args.experts, timeout=1800
    )
    print(
        f"MoE layer ({args.experts} experts, top-2, dropless, hidden {args.hidden}, ffn {args.ffn}), "
        f"{WORLD} gloo ranks, {args.tokens} tokens per rank, {args.rounds} rounds x {args.steps} steps; "
        "ratios: median per-round ratio [95% bootstrap interval]\n"
    )
    print(
        "| ep | experts per rank | fwd+bwd median (ms) | IQR (ms) | all-to-all (ms) | all-to-all share | tokens/s | "
        "tokens/s vs ep1 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for ep in EPS:
        # The step's time is the slowest rank's; all-to-all time as rank 0 saw it.
        blocks = [[max(r["times"][ep][k][i] for r in results) for i in range(args.steps)] for k in range(args.rounds)]
        comm = results[0]["comm"][ep]
        med, q1, q3 = summary(steps_of(blocks))
        row = {
            "ep": ep,
            "blocks": blocks,
            "comm_blocks": comm,
            "step_s": med,
            "all_to_all_s": statistics.median(steps_of(comm)),
            "tokens_per_s": WORLD * args.tokens / med,
        }
        rows.append(row)
        print(
            f"| {ep} | {args.experts // ep} | {med * 1e3:.1f} | {(q3 - q1) * 1e3:.1f} | "
            f"{row['all_to_all_s'] * 1e3:.1f} | {show(share(row))} | {row['tokens_per_s']:,.0f} | "
            f"{show(vs_ep1(rows[0], row))} |"
        )
    return rows


def vs_ep1(ep1: dict, row: dict) -> Interval:
    """tokens/s of this ep / ep 1's = ep 1's step time / this ep's, per round."""
    return paired_ratio(round_medians(ep1["blocks"]), round_medians(row["blocks"]))


def share(row: dict) -> Interval:
    """All-to-all time / step time, per round (round medians)."""
    return paired_ratio(round_medians(row["comm_blocks"]), round_medians(row["blocks"]))


if __name__ == "__main__":
    main()
