"""Training-step time of threefold's tensor parallelism vs PyTorch's DTensor TP on the same model.

Both contestants train the same Transformer (threefold's, same init, same batch) in the same
tp gloo processes: forward, summed-token loss with the logits left split over the vocabulary,
backward, gradient-norm clipping, AdamW. threefold: build_model + its loop's gradient sync,
norm and clip, AdamW(foreach=True) as `threefold train` runs it. DTensor: parallelize_module
with ColwiseParallel / RowwiseParallel / SequenceParallel / PrepareModuleInput (the torchtitan
plan, sequence dim 0 for our [seq, batch, hidden] activations), loss_parallel, and
AdamW(foreach=False) (foreach cannot mix DTensor and plain tensors). Contestants alternate in
blocks A, B, A, B ... to cancel machine drift; per-step time = interval between step ends on
rank 0.

    python bench/tp_vs_dtensor.py [--tp 2 4] [--sp on off] [--rounds 5] [--steps 10]
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


def make_cfg(tp: int, sp: bool, shape: dict):
    from threefold.config import build_config
    from threefold.validate import validate

    pairs = [(k, str(v)) for k, v in shape.items()] + [("parallel.tp", str(tp)), ("parallel.sp", str(sp))]
    cfg = build_config(None, pairs)
    return validate(cfg, tp)


def threefold_contestant(cfg, grid):
    import torch

    from threefold.distributed.parallelize import build_model
    from threefold.distributed.tensor_parallel import sync_tensor_parallel_grads
    from threefold.train.optim import build_optimizer, clip_gradients, global_grad_norm

    model = build_model(cfg, grid, torch.device("cpu"))
    opt = build_optimizer(model, cfg.train)

    def step(tokens, targets, n_tokens):
        loss = model(tokens, targets)
        (loss / n_tokens).backward()
        sync_tensor_parallel_grads(model, grid.tp)
        clip_gradients(model, cfg.train.grad_clip, global_grad_norm(model, []))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def dtensor_contestant(cfg, sp: bool):
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, loss_parallel, parallelize_module)

    from threefold.model.meta import plain_model
    from threefold.train.optim import param_groups

    mesh = init_device_mesh("cpu", (cfg.parallel.tp,))
    model = plain_model(cfg.model, cfg.train.seed, "cpu")
    seq = Shard(0)  # our activations are [seq, batch, hidden]
    region = seq if sp else Replicate()
    plan = {"tok_embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=region),
            "head": ColwiseParallel(input_layouts=region, output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        plan["norm"] = SequenceParallel(sequence_dim=0)
    parallelize_module(model, mesh, plan)
    for block in model.layers.values():
        layer_plan = {
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=region),
            "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(), "mlp.w2": RowwiseParallel(output_layouts=region),
        }
        if sp:
            layer_plan.update({
                "attn_norm": SequenceParallel(sequence_dim=0), "mlp_norm": SequenceParallel(sequence_dim=0),
                "attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, mesh, layer_plan)
    model.loss_fn = lambda logits, targets: F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(),
                                                            reduction="sum")
    t = cfg.train
    opt = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8,
                            foreach=False)
    params = [p for p in model.parameters()]

    def step(tokens, targets, n_tokens):
        with loss_parallel():
            loss = model(tokens, targets)
            (loss / n_tokens).backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=False)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, t.grad_clip, norm, foreach=False)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.full_tensor() if isinstance(loss, DTensor) else loss
        return value.item()

    return step


def bench_worker(tp: int, sp: bool, shape: dict, batch: int, rounds: int, steps: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist

    from threefold.distributed.grid import Grid, RankLayout
    from threefold.distributed.runtime import init_distributed, shutdown_distributed

    init_distributed(torch.device("cpu"), timeout_s=600)
    cfg = make_cfg(tp, sp, shape)
    grid = Grid.build(RankLayout(tp=tp))
    contestants = {"threefold": threefold_contestant(cfg, grid), "dtensor": dtensor_contestant(cfg, sp)}
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab, (batch, cfg.model.seq_len + 1), generator=gen)
    inputs, targets, n_tokens = tokens[:, :-1], tokens[:, 1:], batch * cfg.model.seq_len
    first_loss = {name: step(inputs, targets, n_tokens) / n_tokens for name, step in contestants.items()}
    for step in contestants.values():
        for _ in range(warmup - 1):
            step(inputs, targets, n_tokens)
    times = {name: [] for name in contestants}
    for _ in range(rounds):
        for name, step in contestants.items():  # A, B, A, B ...
            dist.barrier()
            last = time.perf_counter()
            for _ in range(steps):
                step(inputs, targets, n_tokens)
                now = time.perf_counter()
                times[name].append(now - last)
                last = now
    shutdown_distributed()
    return {"times": times, "first_loss": first_loss}


def summary(times: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(times, n=4)
    return statistics.median(times), q[0], q[2]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sp", nargs="+", default=["on", "off"], choices=["on", "off"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--kv-heads", type=int, default=4, help="DTensor's colwise split needs kv_heads divisible by tp")
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args(argv)
    shape = {"model.preset": args.preset, "model.kv_heads": args.kv_heads, "model.seq_len": args.seq}
    rows = []
    for tp in args.tp:
        for sp in args.sp:
            out = run_ranks(bench_worker, tp, tp, sp == "on", shape, args.batch, args.rounds, args.steps,
                            args.warmup, timeout=1800)[0]
            a, b = summary(out["times"]["threefold"]), summary(out["times"]["dtensor"])
            rows.append({"tp": tp, "sp": sp, "threefold": a, "dtensor": b, "ratio": a[0] / b[0],
                         "first_loss": out["first_loss"]})
    print(f"\nTraining step, {args.preset} preset (kv_heads {args.kv_heads}, seq {args.seq}), batch {args.batch}, "
          f"CPU/gloo, {args.rounds} rounds x {args.steps} steps, median [IQR] ms\n")
    print("| tp | sp | threefold ms | DTensor ms | threefold / DTensor | first-step loss per token (threefold, DTensor) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        fa, fb = r["first_loss"]["threefold"], r["first_loss"]["dtensor"]
        print(f"| {r['tp']} | {r['sp']} | {r['threefold'][0] * 1e3:.1f} [{r['threefold'][1] * 1e3:.1f}-"
              f"{r['threefold'][2] * 1e3:.1f}] | {r['dtensor'][0] * 1e3:.1f} [{r['dtensor'][1] * 1e3:.1f}-"
              f"{r['dtensor'][2] * 1e3:.1f}] | {r['ratio']:.2f} | {fa:.6f}, {fb:.6f} |")
    return rows


if __name__ == "__main__":
    main()
