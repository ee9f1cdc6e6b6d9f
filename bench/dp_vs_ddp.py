"""threefold data parallelism vs PyTorch's own, side by side on CPU/gloo (2 ranks by default).

    python bench/dp_vs_ddp.py [--ranks 2] [--rounds 12] [--steps 2] [--layers 4] [--bucket-mb 1] [--quick]

Matchups (the same model, init, data, AdamW hyper-parameters and clipping at 1.0):
  threefold zero 0  vs  torch DistributedDataParallel + AdamW          (goal: time ratio <= 1.0)
  threefold zero 1  vs  DDP + ZeroRedundancyOptimizer(parameters_as_bucket_view=True)
  threefold zero 3  vs  FSDP2 fully_shard per block + root, init_device_mesh("cpu")
                                                           (goal: <= 0.8x time, <= 1.0x memory)
  threefold zero 1  vs  DDP + AdamW, and DDP vs DDP + ZeroRedundancyOptimizer: where ZeRO 1's
                        floor lies (DDP's all-reduce moves what ZeRO 1's reduce-scatter and
                        all-gather move, and updates every parameter instead of half)
  threefold zero 0, reductions overlapped vs launched after backward (what overlap buys)
Every torch peer runs as a careful user would set it up: DDP with gradient_as_bucket_view and
the same bucket size as threefold, AdamW(fused=True) (torch's fastest AdamW on CPU, as
threefold's default train.adamw fused; through ZeroRedundancyOptimizer and FSDP2 too),
clip_grad_norm_(foreach=True). Contestants of a matchup run in rounds (A for k
steps, then B for k steps); the table shows the median step time with the 25th-75th
percentile spread, and the median per-round ratio with its 95% bootstrap interval. Memory is
the per-rank model state (parameters + gradients + optimizer state, distinct storages) after
a step. The overlap table shows the exposed gradient communication (after the slowest rank's
backward ended) against the blocking cost of the same collectives.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from dp_common import batches, make_cfg, spawn, storage_bytes  # noqa: E402
from stats import bootstrap_median, show  # noqa: E402
from timing import alternate, cell, feeder, ratio, steps_of  # noqa: E402


def _grid():
    """The grid `threefold train` builds for ZeRO (training/worker.py): the dp group with its all-gather lane."""
    from threefold.distributed.grid import Grid, RankLayout

    return Grid.build(RankLayout(dp=dist.get_world_size()), lanes=("dp_cp",))


def _threefold(cfg, grid, zero: int, bucket_mb: float, overlap: bool = True, memory: dict | None = None):
    """threefold's Trainer at ZeRO `zero`; overlap=False reduces the gradients after backward
    (parallel.grad_reduce after) instead of bucket by bucket during it."""
    from threefold_side import MemoryAfterFirstStep, stepper, trainer

    cfg = copy.deepcopy(cfg)
    cfg.parallel.zero, cfg.parallel.bucket_mb = zero, bucket_mb
    cfg.parallel.grad_reduce = "overlap" if overlap else "after"
    # Once, after the first step (state sizes are fixed from then on), before zero_grad: where
    # FSDP2 is measured too. With warm-up, neither side pays for it in its timed steps.
    probe = MemoryAfterFirstStep() if memory is not None else None
    tf = trainer(cfg, grid, probe)
    run, grads = stepper(tf), tf.engine.grads
    stamps = []  # (end of backward, reductions done) per step; compared across ranks afterwards

    def step(micro):
        run(micro)
        stamps.append((grads.t_backward_end, grads.t_done))
        if probe is not None:
            memory["bytes"] = probe.report.measured_total

    return step, tf.engine, stamps


def _exposed(stamps: list, skip: int, group) -> list[float]:
    """Per step after `skip`: this rank's reductions done - the slowest rank's end of backward
    (perf_counter is one clock for the processes of one host)."""
    ends = torch.tensor([s[0] for s in stamps], dtype=torch.float64)
    every = torch.zeros(dist.get_world_size(group) * len(stamps), dtype=torch.float64)
    dist.all_gather_single(every, ends, group=group)
    latest = every.view(-1, len(stamps)).max(dim=0).values
    return [max(0.0, done - float(latest[i])) for i, (_, done) in enumerate(stamps) if i >= skip]


def _torch_step(cfg, model, wrapped, optimizer, dp: int, after_step=None, set_to_none: bool = True):
    t = cfg.train
    local_tokens = t.global_batch * cfg.model.seq_len / dp  # DDP and FSDP average over ranks

    def step(micro):
        for x, y in micro:
            (wrapped(x, y) / local_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=True)
        optimizer.step()
        if after_step is not None:
            after_step()
        optimizer.zero_grad(set_to_none=set_to_none)

    return step


def _ddp(cfg, grid, bucket_mb: float, zero_redundancy: bool):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from threefold.distributed.parallelize import build_model
    from threefold.training.optim import param_groups

    t = cfg.train
    model = build_model(cfg, grid, torch.device("cpu"))
    # bucket_cap_mb is MiB, as threefold's bucket_mb. Gradients stay views into the buckets only
    # if zero_grad keeps them (set_to_none=False): set to None, the views are rebuilt every step.
    ddp = DDP(model, process_group=grid.dp.pg, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)
    if zero_redundancy:
        groups = param_groups(model, t.weight_decay)
        optimizer = ZeroRedundancyOptimizer(
            groups[0]["params"],
            optimizer_class=torch.optim.AdamW,
            process_group=grid.dp.pg,
            parameters_as_bucket_view=True,
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=1e-8,
            weight_decay=t.weight_decay,
            fused=True,
        )
        optimizer.add_param_group(groups[1])
    else:
        optimizer = torch.optim.AdamW(
            param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, fused=True
        )
    return _torch_step(cfg, model, ddp, optimizer, grid.dp.size, set_to_none=False)


def _fsdp2(cfg, grid):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from threefold.distributed.parallelize import build_model
    from threefold.training.optim import param_groups

    t = cfg.train
    model = build_model(cfg, grid, torch.device("cpu"))
    mesh = init_device_mesh("cpu", (grid.dp.size,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(
        param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, fused=True
    )
    memory = {}

    def measure() -> None:  # local shards of parameters, gradients, optimizer state, after the first step
        if "bytes" in memory:
            return
        local = [p.to_local() for p in model.parameters()]
        local += [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        local += [
            v.to_local() if hasattr(v, "to_local") else v
            for s in optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.dim() > 0
        ]
        memory["bytes"] = storage_bytes(local)

    return _torch_step(cfg, model, model, optimizer, grid.dp.size, measure), memory


def _worker(args) -> dict:
    dist.init_process_group("gloo")
    grid = _grid()
    cfg = make_cfg(**{"model.layers": args.layers, "parallel.dp": dist.get_world_size()})
    data = batches(cfg, grid.dp_rank, grid.dp.size, args.warmup + args.rounds * args.steps)
    barrier = lambda: dist.barrier(group=grid.dp.pg)  # noqa: E731

    def matchup(ours, theirs) -> dict:  # every contestant walks the same batches
        return alternate(
            {"threefold": feeder(ours, data), "torch": feeder(theirs, data)},
            args.rounds,
            args.steps,
            barrier,
            args.warmup,
        )

    tf0, eng0, stamps0 = _threefold(cfg, grid, 0, args.bucket_mb)
    out = {"params": sum(p.numel() for p in eng0.params)}
    ddp = _ddp(cfg, grid, args.bucket_mb, False)
    out["dp"] = matchup(tf0, ddp)
    out["overlap0"] = {
        "exposed": _exposed(stamps0, args.warmup, grid.dp.pg),
        "serial": eng0.time_serial_comm(),
        "buckets": len(eng0.layout.buckets),
    }

    tf1, _, _ = _threefold(cfg, grid, 1, args.bucket_mb)
    zero_redundancy = _ddp(cfg, grid, args.bucket_mb, True)
    out["zero1"] = matchup(tf1, zero_redundancy)
    # The floor of any ZeRO 1 here: DDP's all-reduce moves the bytes of a reduce-scatter plus a
    # parameter all-gather, and its step differs from ZeRO 1's only by the update of the other half.
    out["zero1_ddp"] = matchup(tf1, ddp)
    out["ddp_zero1"] = matchup(ddp, zero_redundancy)

    tf3_memory = {}
    tf3, _, _ = _threefold(cfg, grid, 3, args.bucket_mb, memory=tf3_memory)
    fsdp, fsdp_memory = _fsdp2(cfg, grid)
    out["zero3"] = matchup(tf3, fsdp)
    out["zero3_memory"] = {"threefold": tf3_memory["bytes"], "torch": fsdp_memory["bytes"]}

    on, _, _ = _threefold(cfg, grid, 0, args.bucket_mb)
    off, _, _ = _threefold(cfg, grid, 0, args.bucket_mb, overlap=False)
    out["overlap"] = matchup(on, off)
    tf2, eng2, stamps2 = _threefold(cfg, grid, 2, args.bucket_mb)
    for i in range(args.warmup + args.rounds * args.steps):
        tf2(data[i % len(data)])
    out["overlap2"] = {
        "exposed": _exposed(stamps2, args.warmup, grid.dp.pg),
        "serial": eng2.time_serial_comm(),
        "buckets": len(eng2.layout.buckets),
    }
    dist.barrier()
    dist.destroy_process_group()
    return out


def hidden(overlap: dict):
    """Share of the serial gradient communication hidden behind backward, per step, bootstrapped."""
    return bootstrap_median([1 - e / overlap["serial"] for e in overlap["exposed"]], unit="step")


def _row(name: str, blocks: dict, memory: dict | None = None) -> str:
    mem = (
        f"{memory['threefold'] / memory['torch']:.2f} ({memory['threefold']:,} / {memory['torch']:,} B)"
        if memory
        else "-"
    )
    return (
        f"| {name} | {cell(steps_of(blocks['threefold']))} | {cell(steps_of(blocks['torch']))} | "
        f"{show(ratio(blocks, 'threefold', 'torch'))} | {mem} |"
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12, help="rounds: one threefold block, one torch block")
    parser.add_argument("--steps", type=int, default=2, help="steps per contestant per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per contestant")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="MiB, threefold's and DDP's buckets alike")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 1 step, 1 warm-up step")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 3, 1, 1
    r = spawn(_worker, args.ranks, args)[0]
    r.update(rounds=args.rounds, steps=args.steps, warmup=args.warmup, bucket_mb=args.bucket_mb)
    print(
        f"\n{args.ranks} ranks, tiny llama ({r['params']:,} parameters, {args.layers} blocks), seq 64, "
        f"8 sequences/rank/step, bucket {args.bucket_mb:g} MiB; {args.rounds} rounds x {args.steps} steps "
        "interleaved; median [p25-p75] ms/step; time ratio: median per-round ratio [95% bootstrap interval]\n"
    )
    print("| matchup | threefold | torch | time ratio | memory ratio |")
    print("|---|---|---|---|---|")
    print(_row("zero 0 vs DDP", r["dp"]))
    print(_row("zero 1 vs ZeroRedundancyOptimizer", r["zero1"]))
    print(_row("zero 3 vs FSDP2 fully_shard", r["zero3"], r["zero3_memory"]))
    print(_row("zero 1 vs DDP (unsharded: zero 1's floor)", r["zero1_ddp"]))
    print(_row("DDP (threefold col.) vs ZeroRedundancyOptimizer (torch col.)", r["ddp_zero1"]))
    print(_row("zero 0 overlapped (threefold col.) vs reduced after backward (torch col.)", r["overlap"]))
    print(
        f"\nWith a {r['params']:,}-parameter model on gloo, per-step Python and gloo latency weigh as much as the "
        "data-parallel algorithm: the ratios compare each stack's overhead as much as its parallelism."
    )
    print("\n| overlap | buckets | serial comm ms | exposed after backward ms | hidden (median [95% interval]) |")
    print("|---|---|---|---|---|")
    for name, key in (("zero 0 (all_reduce)", "overlap0"), ("zero 2 (reduce_scatter)", "overlap2")):
        o = r[key]
        print(
            f"| {name} | {o['buckets']} | {o['serial'] * 1e3:.2f} | {statistics.median(o['exposed']) * 1e3:.2f} | "
            f"{show(hidden(o))} |"
        )
    print("\nContestants:\n")
    print(
        f"- threefold: its Trainer's train_step, the step `threefold train` runs (ZeRO 0/1/2/3, bucket "
        f"{args.bucket_mb:g} MiB, reductions overlapped with backward; finalize_grads, the ranks' health "
        "all-reduce, clip at 1.0 and the engine's AdamW (train.adamw fused: torch's fused kernel on flat "
        "slices); ZeRO 1/2 reduce-scatter into the owned slices; the step's loss summed in the norm's collectives)."
    )
    print(
        f"- DDP: DistributedDataParallel(bucket_cap_mb={args.bucket_mb:g}, gradient_as_bucket_view=True), "
        "AdamW(fused=True) with weight decay on matrices only, clip_grad_norm_(foreach=True), "
        "zero_grad(set_to_none=False) so gradients stay bucket views."
    )
    print(
        "- ZeroRedundancyOptimizer: the same DDP, ZeroRedundancyOptimizer(optimizer_class=AdamW, "
        "parameters_as_bucket_view=True, fused=True), the same clipping and zero_grad."
    )
    print(
        '- FSDP2: fully_shard per block and on the root over init_device_mesh("cpu", (dp,)), '
        "AdamW(fused=True), clip_grad_norm_(foreach=True) on its DTensor gradients, "
        "zero_grad(set_to_none=True)."
    )
    print(
        f"- Both sides of each matchup: {args.ranks} gloo ranks, the same init, batches and hyper-parameters; "
        f"{args.warmup} untimed warm-up step(s) each, then {args.rounds} rounds x {args.steps} step(s); per-round "
        "value = median of the round's step times on rank 0."
    )
    return r


if __name__ == "__main__":
    main()
