"""Training-step time of threefold's pipeline parallelism vs torch.distributed.pipelining.

Both contestants train the same model (threefold's Transformer, tiny preset: 4 layers, or 8
where either side runs two chunks per rank, so every virtual stage holds two layers) in the
same p gloo processes, on the same global batch cut into the same m micro-batches:

  A  threefold: build_stage -> PipelineExecutor.run(micro-batches, loss_scale = global tokens),
     then AdamW (threefold.training.optim.build_optimizer) step and zero_grad(set_to_none=True).
  B  torch: one PipelineStage per virtual stage, each wrapping a threefold chunk built by
     build_model with the same layer ids (so the same layout-invariant initialization), the
     schedule class with n_microbatches=m, loss_fn = summed cross-entropy / global tokens and
     scale_grads=False (the same scaling as A), schedule.step(x, target=y), the same AdamW.

Pairs: gpipe/ScheduleGPipe, 1f1b/Schedule1F1B, interleaved (v=2)/ScheduleInterleaved1F1B
(v=2), and zb. threefold's zb is ZB-H1 with one chunk per rank; torch's zero-bubble schedules
all need two: zb (v=1) is compared with ScheduleInterleavedZeroBubble (v=2, stages r and r+p)
and ScheduleZBVZeroBubble (v=2, V placement: rank r holds stages r and 2p-1-r). Same model,
p, m, data; different placement, so those two ratios compare schedules, not executors.

No gradient clipping, constant lr; the same fixed random batch every step. Contestants
alternate in blocks A, B, A, B ... inside ONE process group per p to cancel drift; step time
is the interval between step ends on pipeline rank 0 (median and interquartile range); the
ratio is the median over rounds of the per-round ratio, with its 95% bootstrap interval.
First-step losses (same weights, same data) must agree; the second-step loss (after one
AdamW step) checks that the gradients agree too.

    python bench/pp_vs_torch.py [--steps 1] [--rounds 8] [--warmup 2] [--p 2 4] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from functools import partial
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]
os.environ.setdefault("OMP_NUM_THREADS", "1")

from stats import show  # noqa: E402
from timing import alternate, cell, ratio, steps_of  # noqa: E402

from harness import run_ranks  # noqa: E402

GLOBAL_BATCH = 16

# (label, threefold schedule, threefold v, torch schedule class, torch v, torch placement)
PAIRS = {
    "gpipe": ("gpipe", 1, "ScheduleGPipe", 1, "loop"),
    "1f1b": ("1f1b", 1, "Schedule1F1B", 1, "loop"),
    "interleaved": ("interleaved", 2, "ScheduleInterleaved1F1B", 2, "loop"),
    "zb/izb": ("zb", 1, "ScheduleInterleavedZeroBubble", 2, "loop"),
    "zb/zbv": ("zb", 1, "ScheduleZBVZeroBubble", 2, "v"),
}
CASES = {2: [(name, 4) for name in PAIRS], 4: [("gpipe", 8), ("1f1b", 8)]}  # p -> (pair, m)


def make_cfg(schedule: str, p: int, m: int, v: int, layers: int, preset: str):
    from threefold.config import build_config
    from threefold.validate import validate

    pairs = [
        ("model.preset", preset),
        ("model.layers", str(layers)),
        ("parallel.pp", str(p)),
        ("parallel.schedule", schedule),
        ("parallel.vpp", str(v)),
        ("parallel.microbatches", str(m)),
        ("train.global_batch", str(GLOBAL_BATCH)),
        ("log.dir", ""),
        ("log.quiet", "true"),
    ]
    return validate(build_config(None, pairs), p)


def threefold_contestant(cfg, grid):
    import torch
    from torch import nn

    from threefold.distributed.parallelize import build_model
    from threefold.distributed.pipeline.stage import build_stage
    from threefold.training.optim import build_optimizer

    device = torch.device("cpu")
    chunks, executor = build_stage(cfg, grid, device, partial(build_model, cfg, grid, device))
    opt = build_optimizer(nn.ModuleList(chunks), cfg.train)
    m, holds_last = cfg.parallel.microbatches, any(executor.plan.last)

    def step(tokens, targets, n_tokens):
        micro = list(zip(tokens.chunk(m), targets.chunk(m)))
        loss_sum, _ = executor.run(micro, n_tokens)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss_sum.item() / n_tokens if holds_last else None

    return step


def torch_contestant(cfg, grid, schedule_name: str, v: int, placement: str, n_tokens: int):
    import torch
    from torch import nn
    from torch.distributed import pipelining

    from threefold.distributed.parallelize import build_model
    from threefold.distributed.pipeline.partition import stage_layer_ids
    from threefold.model.transformer import cross_entropy_sum
    from threefold.training.optim import build_optimizer

    device, p, r = torch.device("cpu"), cfg.parallel.pp, grid.pp_rank
    stages = p * v
    ids = [r, 2 * p - 1 - r] if placement == "v" else [c * p + r for c in range(v)]
    layers = stage_layer_ids(cfg.model, p, v)
    # A chunk's forward(x) is already (tokens | hidden) -> (hidden | logits): no wrapper needed.
    chunks = [build_model(cfg, grid, device, layers[s], s == 0, s == stages - 1) for s in ids]
    pipe_stages = [pipelining.PipelineStage(c, s, stages, device, group=grid.pp.pg) for c, s in zip(chunks, ids)]

    def loss_fn(logits, targets):  # the same sum / global tokens as threefold's last stage
        return cross_entropy_sum(logits, targets.t()) / n_tokens

    cls = getattr(pipelining, schedule_name)
    schedule = cls(
        pipe_stages if v > 1 else pipe_stages[0],
        n_microbatches=cfg.parallel.microbatches,
        loss_fn=loss_fn,
        scale_grads=False,
    )
    opt = build_optimizer(nn.ModuleList(chunks), cfg.train)
    first, last = 0 in ids, stages - 1 in ids

    def step(tokens, targets, n_tokens):
        args = (tokens,) if first else ()
        losses: list = []
        if last:
            schedule.step(*args, target=targets, losses=losses)
        else:
            schedule.step(*args)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return sum(loss.item() for loss in losses) if last else None

    return step


def bench_worker(p: int, cases: list, preset: str, rounds: int, steps: int, warmup: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    from threefold.distributed.grid import Grid, RankLayout
    from threefold.distributed.runtime import init_distributed, shutdown_distributed

    init_distributed(torch.device("cpu"), timeout_s=300)
    grid = Grid.build(RankLayout(pp=p))
    out = []
    for name, m in cases:
        schedule, v, torch_cls, torch_v, placement = PAIRS[name]
        layers = 8 if max(v, torch_v) > 1 else 4
        cfg = make_cfg(schedule, p, m, v, layers, preset)
        seq = cfg.model.seq_len
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.model.vocab, (GLOBAL_BATCH, seq + 1), generator=gen)
        x, y, n_tokens = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), GLOBAL_BATCH * seq
        contestants = {
            "threefold": partial(threefold_contestant(cfg, grid), x, y, n_tokens),
            "torch": partial(torch_contestant(cfg, grid, torch_cls, torch_v, placement, n_tokens), x, y, n_tokens),
        }
        losses = {k: [step(), step()] for k, step in contestants.items()}
        blocks = alternate(contestants, rounds, steps, dist.barrier, warmup)
        out.append(
            {
                "name": name,
                "p": p,
                "m": m,
                "v": (v, torch_v),
                "layers": layers,
                "torch": torch_cls,
                "blocks": blocks,
                "losses": losses,
            }
        )
        del contestants
        gc.collect()
    shutdown_distributed()
    return out


def merge(per_rank: list[list[dict]]) -> list[dict]:
    """Rank 0's times; each loss from the rank holding the last stage."""
    rows = per_rank[0]
    for i, row in enumerate(rows):
        for k in row["losses"]:
            row["losses"][k] = next(r[i]["losses"][k] for r in per_rank if r[i]["losses"][k][0] is not None)
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1, help="timed steps per block")
    ap.add_argument("--rounds", type=int, default=8, help="rounds: one threefold block, one torch block")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per contestant after the loss check")
    ap.add_argument("--p", type=int, nargs="+", default=[2, 4], choices=sorted(CASES))
    ap.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--quick", action="store_true", help="p=2 only, 3 rounds of 1 step, 1 warm-up step")
    args = ap.parse_args(argv)
    if args.quick:
        args.p, args.rounds, args.steps, args.warmup = [2], 3, 1, 1
    rows = []
    t0 = time.perf_counter()
    for p in args.p:
        cases = [c for c in CASES[p] if c[0] in args.pairs]
        if cases:
            rows += merge(
                run_ranks(bench_worker, p, p, cases, args.preset, args.rounds, args.steps, args.warmup, timeout=900)
            )
    print(
        f"\nPipeline training step (executor/schedule + AdamW), {args.preset} preset, global batch {GLOBAL_BATCH}, "
        f"CPU/gloo, 1 thread per rank, {args.rounds} rounds x {args.steps} steps, median [IQR] ms on pp rank 0 "
        f"({time.perf_counter() - t0:.0f} s); ratio: median per-round ratio [95% bootstrap interval]\n"
    )
    print("| schedule | p | m | v | threefold ms | torch ms | ratio | loss A | loss B |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = r["blocks"]
        va, vb = r["v"]
        v = str(va) if va == vb else f"{va} / {vb}"
        la, lb = r["losses"]["threefold"][0], r["losses"]["torch"][0]
        print(
            f"| {r['name']} ({r['torch']}, {r['layers']} layers) | {r['p']} | {r['m']} | {v} | "
            f"{cell(steps_of(b['threefold']))} | {cell(steps_of(b['torch']))} | "
            f"{show(ratio(b, 'threefold', 'torch'))} | {la:.6f} | {lb:.6f} |"
        )
    print(
        "\nWith the tiny model on CPU each micro-batch computes briefly, so the ratios weigh each side's "
        "per-action Python overhead (schedule bookkeeping, p2p set-up) alongside the schedules themselves."
    )
    print("\nSecond-step loss (after one AdamW step on each side's own gradients):\n")
    print("| schedule | p | loss A | loss B | abs diff |")
    print("|---|---|---|---|---|")
    for r in rows:
        la, lb = r["losses"]["threefold"][1], r["losses"]["torch"][1]
        print(f"| {r['name']} | {r['p']} | {la:.6f} | {lb:.6f} | {abs(la - lb):.1e} |")
    print("\nContestants:\n")
    print(
        "- threefold: build_stage over build_model (the chunks of this rank), PipelineExecutor.run with the "
        "schedule's action list, loss scaled by the global tokens; AdamW(foreach=True) "
        "(threefold.training.optim.build_optimizer), zero_grad(set_to_none=True)."
    )
    print(
        "- torch: one torch.distributed.pipelining.PipelineStage per virtual stage over the same chunks, the "
        "schedule class named in the table (n_microbatches=m, loss_fn = summed cross-entropy / global tokens, "
        "scale_grads=False), schedule.step; the same AdamW(foreach=True) and zero_grad(set_to_none=True)."
    )
    print(
        f"- Both: pipeline group of p gloo ranks (one per stage rank), no gradient clipping, constant lr, the same "
        f"fixed batch; two loss-check steps and {args.warmup} untimed warm-up step(s) each, then {args.rounds} "
        f"rounds x {args.steps} step(s) alternating threefold, torch; per-round value = median of the round's "
        "step times on pp rank 0."
    )
    return rows


if __name__ == "__main__":
    main()
