"""Training-step time of threefold's tensor parallelism vs PyTorch's DTensor TP on the same model.

Both contestants train the same Transformer (threefold's, same init, same batch) in the same
tp gloo processes: forward, summed-token loss with the logits left split over the vocabulary,
backward, gradient-norm clipping, AdamW. threefold: its Trainer's train_step, the step
`threefold train` runs (TP layers, finalize_grads, the engine's clip and AdamW). DTensor: parallelize_module
with ColwiseParallel / RowwiseParallel / SequenceParallel / PrepareModuleInput (the torchtitan
plan, sequence dim 0 for our [seq, batch, hidden] activations), loss_parallel, and one
AdamW(foreach=True) per parameter kind with foreach norm and clipping (bench/torch_peers.py).
Contestants alternate in blocks A, B, A, B ... to cancel machine drift; per-step time =
interval between step ends on rank 0; the ratio is the median over rounds of the per-round
ratio of round medians, with its 95% bootstrap interval (bench/stats.py).

    python bench/tp_vs_dtensor.py [--tp 2 4] [--sp on off] [--rounds 6] [--steps 2]
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]
os.environ.setdefault("OMP_NUM_THREADS", "1")

from stats import show  # noqa: E402
from timing import alternate, cell, ratio, steps_of  # noqa: E402

from harness import run_ranks  # noqa: E402


def make_cfg(tp: int, sp: bool, shape: dict, batch: int):
    """The run both sides train: one micro-batch of `batch` sequences per step, constant lr."""
    from threefold.config import build_config
    from threefold.validate import validate

    pairs = {
        **shape,
        "parallel.tp": tp,
        "parallel.sp": sp,
        "train.global_batch": batch,
        "train.micro_batch": batch,
        "train.warmup_steps": 0,
        "train.min_lr_ratio": 1.0,
    }
    return validate(build_config(None, [(k, str(v)) for k, v in pairs.items()]), tp)


def threefold_contestant(cfg, grid):
    """step(tokens, targets, n_tokens) -> the batch's summed loss, through threefold's Trainer."""
    from threefold_side import stepper, trainer

    run = stepper(trainer(cfg, grid))

    def step(tokens, targets, n_tokens):
        return run([(tokens, targets)]) * n_tokens

    return step


def dtensor_contestant(cfg, sp: bool):
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )
    from torch_peers import MeshOptimizer

    from threefold.model.meta import plain_model

    mesh = init_device_mesh("cpu", (cfg.parallel.tp,), mesh_dim_names=("tp",))
    model = plain_model(cfg.model, cfg.train.seed, "cpu")
    seq = Shard(0)  # our activations are [seq, batch, hidden]
    region = seq if sp else Replicate()
    plan = {
        "tok_embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=region),
        "head": ColwiseParallel(input_layouts=region, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan["norm"] = SequenceParallel(sequence_dim=0)
    parallelize_module(model, mesh, plan)
    for block in model.layers.values():
        layer_plan = {
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=region),
            "mlp.w1": ColwiseParallel(),
            "mlp.w3": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(output_layouts=region),
        }
        if sp:
            layer_plan.update(
                {
                    "attn_norm": SequenceParallel(sequence_dim=0),
                    "mlp_norm": SequenceParallel(sequence_dim=0),
                    "attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                    "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                }
            )
        parallelize_module(block, mesh, layer_plan)
    model.loss_fn = lambda logits, targets: F.cross_entropy(
        logits.float().flatten(0, -2), targets.flatten(), reduction="sum"
    )
    opt = MeshOptimizer(model, cfg.train)

    def step(tokens, targets, n_tokens):
        with loss_parallel():
            loss = model(tokens, targets)
            (loss / n_tokens).backward()
        opt.clip(cfg.train.grad_clip, opt.grad_norm())
        opt.step()
        opt.zero_grad()
        value = loss.full_tensor() if isinstance(loss, DTensor) else loss
        return value.item()

    return step, opt.describe()


def bench_worker(tp: int, sp: bool, shape: dict, batch: int, rounds: int, steps: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist

    from threefold.distributed.grid import Grid, RankLayout
    from threefold.distributed.runtime import init_distributed, shutdown_distributed

    init_distributed(torch.device("cpu"), timeout_s=600)
    cfg = make_cfg(tp, sp, shape, batch)
    grid = Grid.build(RankLayout(tp=tp))
    ours = threefold_contestant(cfg, grid)
    peer, described = dtensor_contestant(cfg, sp)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab, (batch, cfg.model.seq_len + 1), generator=gen)
    inputs, targets, n_tokens = tokens[:, :-1], tokens[:, 1:], batch * cfg.model.seq_len
    contestants = {
        name: partial(step, inputs, targets, n_tokens) for name, step in (("threefold", ours), ("dtensor", peer))
    }
    # Warm-up from the same weights: step 1's loss checks the forward, step 2's the update too.
    losses = {name: [step() / n_tokens for _ in range(max(1, warmup))] for name, step in contestants.items()}
    blocks = alternate(contestants, rounds, steps, dist.barrier)
    shutdown_distributed()
    return {"blocks": blocks, "losses": losses, "peer": described}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sp", nargs="+", default=["on", "off"], choices=["on", "off"])
    ap.add_argument("--rounds", type=int, default=6, help="rounds: one threefold block, one DTensor block")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per block")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per contestant; their losses are compared")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--kv-heads", type=int, default=4, help="DTensor's colwise split needs kv_heads divisible by tp")
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args(argv)
    shape = {"model.preset": args.preset, "model.kv_heads": args.kv_heads, "model.seq_len": args.seq}
    rows = []
    for tp in args.tp:
        for sp in args.sp:
            out = run_ranks(
                bench_worker, tp, tp, sp == "on", shape, args.batch, args.rounds, args.steps, args.warmup, timeout=1800
            )[0]
            rows.append({"tp": tp, "sp": sp, **out})
    print(
        f"\nTraining step, {args.preset} preset (kv_heads {args.kv_heads}, seq {args.seq}), batch {args.batch}, "
        f"CPU/gloo, {args.rounds} rounds x {args.steps} steps, median [IQR] ms; ratio: median per-round ratio "
        "[95% bootstrap interval]\n"
    )
    print(
        "| tp | sp | threefold ms | DTensor ms | threefold / DTensor | loss per token, warm-up steps (threefold; "
        "DTensor) |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        b, la, lb = r["blocks"], r["losses"]["threefold"], r["losses"]["dtensor"]
        print(
            f"| {r['tp']} | {r['sp']} | {cell(steps_of(b['threefold']))} | {cell(steps_of(b['dtensor']))} | "
            f"{show(ratio(b, 'threefold', 'dtensor'))} | {', '.join(f'{x:.6f}' for x in la)}; "
            f"{', '.join(f'{x:.6f}' for x in lb)} |"
        )
    worst = max(abs(x - y) for r in rows for x, y in zip(r["losses"]["threefold"], r["losses"]["dtensor"]))
    print(
        f"\nLargest warm-up loss difference (same weights and batch): {worst:.1e}. On CPU with the tiny "
        "model the ratio mostly measures DTensor's per-operator Python dispatch, not tensor-parallel compute "
        "or communication.\n"
    )
    print("Contestants:\n")
    print(
        "- threefold: its Trainer's train_step (tp group of the same ranks, dp 1): TP layers, summed-token loss "
        "over vocab-split logits, finalize_grads (TP partial sums, the global norm), the ranks' health "
        "all-gather, clip and the engine's AdamW (torch's foreach arithmetic on flat buffers, weight decay on "
        "matrices only), the loss and metrics reductions."
    )
    for r in rows:
        print(f"- DTensor tp{r['tp']} sp {r['sp']}: parallelize_module (torchtitan plan), loss_parallel; {r['peer']}.")
    print(
        f"- Both: mesh (tp,) of gloo ranks on CPU, the same init and batch, constant lr, clipping at the same "
        f"global norm; {args.warmup} untimed warm-up steps each (their losses in the table), then "
        f"{args.rounds} rounds x {args.steps} steps alternating threefold, DTensor; per-round value = median "
        "of the round's step times on rank 0."
    )
    return rows


if __name__ == "__main__":
    main()
