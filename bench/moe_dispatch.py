"""Expert parallelism on CPU/gloo: all-to-all dispatch time and MoE tokens/s for ep 1, 2, 4.

One process group of 4 ranks (dp 4); for each ep the same MoE layer (8 experts, top-2,
dropless) is built by threefold's build path (layout-invariant init, experts sharded over
ep), and every rank pushes its own tokens through forward + backward. With ep 1 each rank
computes every expert for its tokens; with ep 4 each holds 2 experts and tokens travel
there and back by all-to-all. Contestants alternate in rounds (ep1, ep2, ep4, ep1, ...).

Reported per ep: median time of one MoE forward+backward, the part of it spent inside the
all-to-alls (dispatch + combine, both directions: timed around torch.distributed's
all_to_all_single by this script only), and tokens/s over all ranks.

    python bench/moe_dispatch.py [--rounds 5] [--steps 5] [--tokens 1024] [--quick]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

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
        pairs = [("model.num_experts", experts), ("model.top_k", 2), ("model.hidden", hidden), ("model.heads", 4),
                 ("model.kv_heads", 4), ("model.ffn_hidden", ffn), ("model.layers", 1), ("model.seq_len", tokens),
                 ("parallel.dp", WORLD), ("parallel.ep", ep), ("train.global_batch", WORLD),
                 ("train.micro_batch", 1)]
        cfg = validate(build_config(None, [(k, str(v)) for k, v in pairs]), WORLD)
        grid = Grid.build(RankLayout(dp=WORLD, ep=ep))
        layers[ep] = build_model(cfg, grid, torch.device("cpu")).layers["0"].mlp
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(tokens, 1, hidden, generator=gen).requires_grad_()
    times = {ep: [] for ep in EPS}
    comm = {ep: [] for ep in EPS}
    for _ in range(rounds):
        for ep in EPS:
            layer = layers[ep]
            for _ in range(steps):
                dist.barrier()
                a2a["s"] = 0.0
                t0 = time.perf_counter()
                layer(x).sum().backward()
                times[ep].append(time.perf_counter() - t0)
                comm[ep].append(a2a["s"])
                layer.pop_stats()
    dist.all_to_all_single = raw
    shutdown_distributed()
    return {"times": times, "comm": comm}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="bench/moe_dispatch.py")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank per step")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.tokens = 2, 2, 256
    results = run_ranks(_worker, WORLD, args.rounds, args.steps, args.tokens, args.hidden, args.ffn, args.experts,
                        timeout=1800)
    print(f"MoE layer ({args.experts} experts, top-2, dropless, hidden {args.hidden}, ffn {args.ffn}), "
          f"{WORLD} gloo ranks, {args.tokens} tokens per rank, {args.rounds} rounds x {args.steps} steps")
    print("| ep | experts per rank | fwd+bwd median (ms) | IQR (ms) | all-to-all (ms) | all-to-all share | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    base, rows = None, []
    for ep in EPS:
        # The step's time is the slowest rank's; all-to-all time as rank 0 saw it.
        steps = [max(r["times"][ep][i] for r in results) for i in range(len(results[0]["times"][ep]))]
        med = statistics.median(steps)
        q = statistics.quantiles(steps, n=4) if len(steps) >= 4 else [min(steps), med, max(steps)]
        comm = statistics.median(results[0]["comm"][ep])
        tps = WORLD * args.tokens / med
        base = base or tps
        print(f"| {ep} | {args.experts // ep} | {med * 1e3:.1f} | {(q[2] - q[0]) * 1e3:.1f} | {comm * 1e3:.1f} | "
              f"{comm / med:.0%} | {tps:,.0f} ({tps / base:.2f}x ep1) |")
        rows.append({"ep": ep, "step_s": med, "all_to_all_s": comm, "tokens_per_s": tps, "vs_ep1": tps / base})
    return rows


if __name__ == "__main__":
    main()
