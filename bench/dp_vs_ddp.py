"""threefold data parallelism vs PyTorch's own, side by side on CPU/gloo (2 ranks by default).

    python bench/dp_vs_ddp.py [--ranks 2] [--rounds 6] [--steps 4] [--layers 4] [--bucket-mb 1] [--quick]

Matchups (the same model, init, data, AdamW hyper-parameters and clipping at 1.0):
  threefold zero 0  vs  torch DistributedDataParallel + AdamW          (goal: time ratio <= 1.0)
  threefold zero 1  vs  DDP + ZeroRedundancyOptimizer(parameters_as_bucket_view=True)
  threefold zero 3  vs  FSDP2 fully_shard per block + root, init_device_mesh("cpu")
                                                           (goal: <= 0.8x time, <= 1.0x memory)
  threefold zero 0, reductions overlapped vs launched after backward (what overlap buys)
Contestants of a matchup run in turns (A for k steps, B for k steps, ... `rounds` times);
the table shows the median step time with the 25th-75th percentile spread. Memory is the
per-rank model state (parameters + gradients + optimizer state, distinct storages) after a
step. The overlap table shows the exposed gradient communication (after the slowest rank's
backward ended) against the blocking cost of the same collectives.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dp_common import batches, interleave, make_cfg, spawn, storage_bytes, summary  # noqa: E402


def _grid():
    from threefold.distributed.grid import Grid, RankLayout

    return Grid.build(RankLayout(dp=dist.get_world_size()))


def _threefold(cfg, grid, zero: int, bucket_mb: float, overlap: bool = True, memory: dict | None = None):
    from threefold.distributed.data_parallel import DataParallel, measure_memory
    from threefold.distributed.parallelize import build_model

    t = cfg.train
    model = build_model(cfg, grid, torch.device("cpu"))
    engine = DataParallel(model, grid, zero=zero, bucket_mb=bucket_mb, betas=(t.beta1, t.beta2),
                          weight_decay=t.weight_decay)
    per_step = t.global_batch * cfg.model.seq_len
    stamps = []  # (end of backward, reductions done) per step; compared across ranks afterwards

    def step(micro, i):
        for x, y in micro:
            # overlap=False: every backward under no_sync, so finish() launches all buckets.
            with contextlib.nullcontext() if overlap else engine.no_sync():
                engine.backward(model(x, y) / per_step)
        engine.finish()
        stamps.append((engine.grads.t_backward_end, engine.grads.t_done))
        engine.step(t.lr, engine.grad_norm(), t.grad_clip)
        if memory is not None:  # after the step, before zero_grad: where FSDP2 is measured too
            memory["bytes"] = measure_memory(engine).measured_total
        engine.zero_grad()
    return step, engine, stamps


def _exposed(stamps: list, skip: int, group) -> float:
    """Median over steps of (this rank's reductions done - the slowest rank's end of
    backward): perf_counter is one clock for the processes of one host."""
    ends = torch.tensor([s[0] for s in stamps], dtype=torch.float64)
    every = torch.zeros(dist.get_world_size(group) * len(stamps), dtype=torch.float64)
    dist.all_gather_single(every, ends, group=group)
    latest = every.view(-1, len(stamps)).max(dim=0).values
    return statistics.median(max(0.0, done - float(latest[i])) for i, (_, done) in enumerate(stamps) if i >= skip)


def _torch_step(cfg, model, wrapped, optimizer, dp: int, after_step=None):
    t = cfg.train
    local_tokens = t.global_batch * cfg.model.seq_len / dp  # DDP and FSDP average over ranks

    def step(micro, i):
        for x, y in micro:
            (wrapped(x, y) / local_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        if after_step is not None:
            after_step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _ddp(cfg, grid, bucket_mb: float, zero_redundancy: bool):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from threefold.distributed.parallelize import build_model
    from threefold.train.optim import param_groups

    t = cfg.train
    model = build_model(cfg, grid, torch.device("cpu"))
    ddp = DDP(model, process_group=grid.dp.pg, bucket_cap_mb=bucket_mb)
    if zero_redundancy:
        groups = param_groups(model, t.weight_decay)
        optimizer = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                            process_group=grid.dp.pg, parameters_as_bucket_view=True, lr=t.lr,
                                            betas=(t.beta1, t.beta2), eps=1e-8, weight_decay=t.weight_decay)
        optimizer.add_param_group(groups[1])
    else:
        optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                                      eps=1e-8, foreach=True)
    return _torch_step(cfg, model, ddp, optimizer, grid.dp.size)


def _fsdp2(cfg, grid):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from threefold.distributed.parallelize import build_model
    from threefold.train.optim import param_groups

    t = cfg.train
    model = build_model(cfg, grid, torch.device("cpu"))
    mesh = init_device_mesh("cpu", (grid.dp.size,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                                  eps=1e-8, foreach=True)
    memory = {}

    def measure() -> None:  # local shards of parameters, gradients, optimizer state, after the step
        local = [p.to_local() for p in model.parameters()]
        local += [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        local += [v.to_local() if hasattr(v, "to_local") else v
                  for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        memory["bytes"] = storage_bytes(local)
    return _torch_step(cfg, model, model, optimizer, grid.dp.size, measure), memory


def _worker(args) -> dict:
    dist.init_process_group("gloo")
    grid = _grid()
    cfg = make_cfg(**{"model.layers": args.layers})
    total = args.warmup * 2 + args.rounds * args.steps * 2
    data = batches(cfg, grid.dp_rank, grid.dp.size, total)
    barrier = lambda: dist.barrier(group=grid.dp.pg)  # noqa: E731
    tf0, eng0, stamps0 = _threefold(cfg, grid, 0, args.bucket_mb)
    out = {"params": sum(p.numel() for p in eng0.params)}
    out["dp"] = interleave({"threefold": tf0, "torch": _ddp(cfg, grid, args.bucket_mb, False)}, data,
                           args.warmup, args.rounds, args.steps, barrier)
    out["overlap0"] = {"exposed": _exposed(stamps0, args.warmup, grid.dp.pg), "serial": eng0.time_serial_comm(),
                       "buckets": len(eng0.layout.buckets)}

    tf1, _, _ = _threefold(cfg, grid, 1, args.bucket_mb)
    out["zero1"] = interleave({"threefold": tf1, "torch": _ddp(cfg, grid, args.bucket_mb, True)}, data,
                              args.warmup, args.rounds, args.steps, barrier)

    tf3_memory = {}
    tf3, _, _ = _threefold(cfg, grid, 3, args.bucket_mb, memory=tf3_memory)
    fsdp, fsdp_memory = _fsdp2(cfg, grid)
    out["zero3"] = interleave({"threefold": tf3, "torch": fsdp}, data, args.warmup, args.rounds, args.steps, barrier)
    out["zero3_memory"] = {"threefold": tf3_memory["bytes"], "torch": fsdp_memory["bytes"]}

    on, _, _ = _threefold(cfg, grid, 0, args.bucket_mb)
    off, _, _ = _threefold(cfg, grid, 0, args.bucket_mb, overlap=False)
    out["overlap"] = interleave({"threefold": on, "torch": off}, data, args.warmup, args.rounds, args.steps, barrier)
    tf2, eng2, stamps2 = _threefold(cfg, grid, 2, args.bucket_mb)
    for i in range(args.warmup + args.rounds * args.steps):
        tf2(data[i % len(data)], i)
    out["overlap2"] = {"exposed": _exposed(stamps2, args.warmup, grid.dp.pg), "serial": eng2.time_serial_comm(),
                       "buckets": len(eng2.layout.buckets)}
    dist.barrier()
    dist.destroy_process_group()
    return out


def _row(name: str, times: dict, memory: dict | None = None) -> str:
    a, b = summary(times["threefold"]), summary(times["torch"])
    cell = lambda s: f"{s[0] * 1e3:.1f} ({s[1] * 1e3:.1f}-{s[2] * 1e3:.1f})"  # noqa: E731
    mem = f"{memory['threefold'] / memory['torch']:.2f} ({memory['threefold']:,} / {memory['torch']:,} B)" \
        if memory else "-"
    return f"| {name} | {cell(a)} | {cell(b)} | {a[0] / b[0]:.2f} | {mem} |"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4, help="steps per contestant per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--quick", action="store_true", help="1 round of 2 steps, 1 warm-up step")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 2, 1
    r = spawn(_worker, args.ranks, args)[0]
    print(f"\n{args.ranks} ranks, tiny llama ({r['params']:,} parameters, {args.layers} blocks), seq 64, "
          f"8 sequences/rank/step, bucket {args.bucket_mb} MB; {args.rounds} rounds x {args.steps} steps "
          "interleaved; median (p25-p75) ms/step\n")
    print("| matchup | threefold | torch | time ratio | memory ratio |")
    print("|---|---|---|---|---|")
    print(_row("zero 0 vs DDP", r["dp"]))
    print(_row("zero 1 vs ZeroRedundancyOptimizer", r["zero1"]))
    print(_row("zero 3 vs FSDP2 fully_shard", r["zero3"], r["zero3_memory"]))
    print(_row("zero 0 overlapped (threefold col.) vs reduced after backward (torch col.)", r["overlap"]))
    print("\n| overlap | buckets | serial comm ms | exposed after backward ms | hidden |")
    print("|---|---|---|---|---|")
    for name, key in (("zero 0 (all_reduce)", "overlap0"), ("zero 2 (reduce_scatter)", "overlap2")):
        o = r[key]
        print(f"| {name} | {o['buckets']} | {o['serial'] * 1e3:.2f} | {o['exposed'] * 1e3:.2f} | "
              f"{1 - o['exposed'] / o['serial']:.2f} |")
    return r


if __name__ == "__main__":
    main()
