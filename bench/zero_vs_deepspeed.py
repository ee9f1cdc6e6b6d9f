"""threefold's ZeRO 1, 2 and 3 vs DeepSpeed's, side by side on CPU/gloo (2 ranks by default).

    pip install -e '.[bench]'            # DeepSpeed (DS_BUILD_OPS=0: its ops build when first used)
    python bench/zero_vs_deepspeed.py [--ranks 2] [--rounds 12] [--steps 2] [--stages 1 2 3]
                                      [--bucket-mb 1] [--ds-optimizer cpu_adam] [--json FILE] [--quick]

The same tiny llama, init, batches, AdamW hyper-parameters (weight decay on matrices only) and
clipping at 1.0 as bench/dp_vs_ddp.py. threefold runs its Trainer's step at ZeRO N with
parallel.overlap_param_gather on and parallel.zero3_prefetch 1; DeepSpeed runs
deepspeed.initialize's engine at zero_optimization.stage N with overlap_comm and
contiguous_gradients on and every bucket size (reduce, all-gather, ZeRO-3 prefetch) equal to
threefold's bucket, on DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu) over the same gloo
process group. Contestants alternate in rounds (bench/timing.py); the table gives median step
times with their interquartile range and the median per-round ratio threefold / DeepSpeed with
its 95% bootstrap interval (bench/stats.py).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

INSTALL = "pip install -e '.[bench]'"
MISSING = f"bench/zero_vs_deepspeed.py: DeepSpeed is not installed; install the bench extra: {INSTALL}"
# DeepSpeed's optimizers for its side, all AdamW with per-group weight decay. cpu_adam (its
# DeepSpeedCPUAdam, AVX kernels built on first use) measured fastest on this CPU (docs/benchmarks.md).
DS_OPTIMIZERS = ("cpu_adam", "torch_fused", "torch_foreach", "fused_adam")
FP32_BYTES = 4  # the benches train in fp32 on CPU: a gradient element is 4 bytes on both sides


def missing_deepspeed() -> str | None:
    """The one line to print when DeepSpeed cannot be imported, else None."""
    return MISSING if importlib.util.find_spec("deepspeed") is None else None


def bucket_elements(bucket_mb: float) -> int:
    """threefold's bucket (MiB of fp32 gradient) in DeepSpeed's unit, elements."""
    return int(bucket_mb * 2**20 / FP32_BYTES)


def deepspeed_config(cfg, stage: int, bucket_mb: float, dp: int) -> dict:
    """DeepSpeed's config mirroring threefold's run `cfg` at ZeRO `stage`: the same micro-batch
    and accumulation, clipping, fp32, and each of its bucket sizes equal to threefold's bucket."""
    t, bucket = cfg.train, bucket_elements(bucket_mb)
    zero = {
        "stage": stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
    }
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = bucket
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.global_batch // (t.micro_batch * dp),
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def adamw_arguments(cfg) -> dict:
    """The AdamW hyper-parameters threefold's engine uses (weight decay per parameter group)."""
    t = cfg.train
    return {"lr": t.lr, "betas": (t.beta1, t.beta2), "eps": 1e-8}


def deepspeed_optimizer(name: str, groups: list[dict], cfg):
    """DeepSpeed's side's AdamW over `groups` (threefold's param_groups: decay on matrices only)."""
    import torch

    kw = adamw_arguments(cfg)
    if name == "cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kw)
    if name == "fused_adam":
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, adam_w_mode=True, **kw)
    if name in ("torch_fused", "torch_foreach"):
        return torch.optim.AdamW(groups, **kw, **{name.removeprefix("torch_"): True})
    raise ValueError(f"--ds-optimizer {name!r}: valid are {', '.join(DS_OPTIMIZERS)}")


def threefold_config(cfg, zero: int, bucket_mb: float):
    """threefold's run at ZeRO `zero`: reductions overlapped with backward, ZeRO 1/2 gathers
    behind the next forward, ZeRO 3 one block prefetched."""
    cfg = copy.deepcopy(cfg)
    p = cfg.parallel
    p.zero, p.bucket_mb, p.grad_reduce, p.overlap_param_gather, p.zero3_prefetch = zero, bucket_mb, "overlap", True, 1
    return cfg


def _threefold(cfg, grid, zero: int, bucket_mb: float, losses: list):
    from threefold_side import stepper, trainer

    run = stepper(trainer(threefold_config(cfg, zero, bucket_mb), grid))

    def step(micro):
        losses.append(run(micro))

    return step


def _deepspeed(cfg, grid, stage: int, bucket_mb: float, optimizer: str, losses: list):
    import deepspeed
    import torch

    from threefold.distributed.parallelize import build_model
    from threefold.training.optim import param_groups

    model = build_model(cfg, grid, torch.device("cpu"))
    params = sum(p.numel() for p in model.parameters())  # before ZeRO 3 partitions them
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=deepspeed_optimizer(optimizer, param_groups(model, cfg.train.weight_decay), cfg),
        config=deepspeed_config(cfg, stage, bucket_mb, grid.dp.size),
        dist_init_required=False,
    )
    # The model returns the summed token loss; per local token, as threefold and DDP average.
    local_tokens = cfg.train.global_batch * cfg.model.seq_len / grid.dp.size

    def step(micro):
        total = 0.0
        for x, y in micro:
            loss = engine(x, y) / local_tokens
            engine.backward(loss)
            total += loss.detach()
        engine.step()
        losses.append(total)  # this rank's share; averaged over ranks afterwards (not timed)

    return step, params


def _quiet() -> None:
    import logging
    import warnings

    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    # DeepSpeed calls torch's older collective names, which warn on every call.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use", category=FutureWarning)


def _worker(args) -> dict:
    import torch
    import torch.distributed as dist
    from dp_common import batches, make_cfg
    from timing import alternate, feeder

    from threefold.distributed.grid import Grid, RankLayout

    dist.init_process_group("gloo")
    import deepspeed

    _quiet()
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group above
    grid = Grid.build(RankLayout(dp=dist.get_world_size()))
    cfg = make_cfg(**{"model.layers": args.layers, "parallel.dp": grid.dp.size})
    data = batches(cfg, grid.dp_rank, grid.dp.size, args.warmup + args.rounds * args.steps)
    barrier = lambda: dist.barrier(group=grid.dp.pg)  # noqa: E731
    out = {"stages": {}}
    for stage in args.stages:
        ours, theirs = [], []
        ds_step, out["params"] = _deepspeed(cfg, grid, stage, args.bucket_mb, args.ds_optimizer, theirs)
        blocks = alternate(
            {
                "threefold": feeder(_threefold(cfg, grid, stage, args.bucket_mb, ours), data),
                "deepspeed": feeder(ds_step, data),
            },
            args.rounds,
            args.steps,
            barrier,
            args.warmup,
        )
        # Both walked the same batches from the same init with the same updates: the warm-up
        # losses agree up to the two AdamW implementations' float32 rounding.
        theirs_t = torch.tensor([float(x) for x in theirs[: args.warmup]], dtype=torch.float64)
        dist.all_reduce(theirs_t, group=grid.dp.pg)
        theirs_t /= grid.dp.size  # each rank's loss is per local token: the mean is the global loss
        gap = max((abs(a - b) for a, b in zip(ours[: args.warmup], theirs_t.tolist())), default=0.0)
        out["stages"][stage] = {"blocks": blocks, "warmup_loss_gap": gap}
    out["deepspeed"] = deepspeed.__version__
    dist.barrier()
    dist.destroy_process_group()
    return out


def table(r: dict) -> list[str]:
    from stats import fmt
    from timing import cell, ratio, steps_of

    lines = [
        "| ZeRO stage | threefold ms | DeepSpeed ms | median ratio threefold / DeepSpeed | 95% interval |",
        "|---|---|---|---|---|",
    ]
    for stage, s in r["stages"].items():
        i = ratio(s["blocks"], "threefold", "deepspeed")
        lines.append(
            f"| {stage} | {cell(steps_of(s['blocks']['threefold']))} | {cell(steps_of(s['blocks']['deepspeed']))} "
            f"| {fmt(i.value)} | [{fmt(i.lo)}, {fmt(i.hi)}] |"
        )
    return lines


def contestants(args, r: dict) -> list[str]:
    gap = max(s["warmup_loss_gap"] for s in r["stages"].values())
    b = bucket_elements(args.bucket_mb)
    return [
        f"- threefold: its Trainer's train_step, the step `threefold train` runs, at parallel.zero N, bucket "
        f"{args.bucket_mb:g} MiB, grad_reduce overlap (reduce-scatters bucket by bucket during backward), "
        "overlap_param_gather true (ZeRO 1/2: each bucket's all-gather starts after its update and the next "
        "forward waits where it first uses it), zero3_prefetch 1 (ZeRO 3: the next block's gather on its own "
        "communicator); finalize_grads, the ranks' health all-reduce (MAX), clip at 1.0, the engine's AdamW on CPU "
        "(train.adamw fused: torch's fused kernel on flat shards), the step's loss summed in the norm's collectives.",
        f"- DeepSpeed {r['deepspeed']}: deepspeed.initialize on DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu) "
        "over the same gloo process group (torch.distributed.init_process_group('gloo'), then "
        "deepspeed.init_distributed(dist_backend='gloo') adopts it); zero_optimization stage N with overlap_comm "
        f"true, contiguous_gradients true, reduce_scatter true, reduce_bucket_size = allgather_bucket_size = "
        f"stage3_prefetch_bucket_size = {b:,} elements ({args.bucket_mb:g} MiB of fp32), other ZeRO-3 knobs at "
        "their defaults; gradient_clipping 1.0, fp32; optimizer "
        + {
            "cpu_adam": "DeepSpeedCPUAdam(adamw_mode=True) (its AVX AdamW, faster here than torch's fused or "
            "foreach AdamW and DeepSpeed's FusedAdam)",
            "torch_fused": "torch.optim.AdamW(fused=True)",
            "torch_foreach": "torch.optim.AdamW(foreach=True)",
            "fused_adam": "DeepSpeed's FusedAdam(adam_w_mode=True)",
        }[args.ds_optimizer]
        + ", weight decay on matrices only; engine(x, y), engine.backward, engine.step.",
        f"- Both: {args.ranks} gloo ranks, OMP_NUM_THREADS=1, the same init, batches and AdamW hyper-parameters; "
        f"{args.warmup} untimed warm-up steps each, then {args.rounds} rounds x {args.steps} step(s); per-round "
        f"value = median of the round's step times on rank 0. Largest difference of the two's losses over the "
        f"warm-up steps: {gap:.1e} (the same init, batches and updates; 0 = equal to the last bit).",
    ]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12, help="rounds: one threefold block, one DeepSpeed block")
    parser.add_argument("--steps", type=int, default=2, help="steps per contestant per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per contestant")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=(1, 2, 3))
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="MiB: threefold's bucket and DeepSpeed's")
    parser.add_argument("--ds-optimizer", default="cpu_adam", choices=DS_OPTIMIZERS, help="DeepSpeed's AdamW")
    parser.add_argument("--json", help="also write the per-round step times and ratios here")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 1 step, 1 warm-up step")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 3, 1, 1
    missing = missing_deepspeed()
    if missing:
        print(missing, file=sys.stderr)
        raise SystemExit(2)
    # The comparison is on CPU/gloo: DeepSpeed must not pick a CUDA accelerator (and NCCL) on a GPU host.
    os.environ["DS_ACCELERATOR"] = "cpu"
    from dp_common import spawn

    r = spawn(_worker, args.ranks, args)[0]
    r.update(rounds=args.rounds, steps=args.steps, warmup=args.warmup, bucket_mb=args.bucket_mb)
    r["ds_optimizer"] = args.ds_optimizer
    print(
        f"\n{args.ranks} ranks, tiny llama ({r['params']:,} parameters, {args.layers} blocks), seq 64, "
        f"8 sequences/rank/step, bucket {args.bucket_mb:g} MiB; {args.rounds} rounds x {args.steps} steps "
        "interleaved; median [p25-p75] ms/step; ratio: median per-round ratio with its 95% bootstrap interval\n"
    )
    print("\n".join(table(r)))
    print("\nContestants:\n")
    print("\n".join(contestants(args, r)))
    if args.json:
        write_json(args.json, r)
    return r


def write_json(path: str, r: dict) -> None:
    from suite import interval_json
    from timing import ratio

    data = {k: v for k, v in r.items() if k != "stages"}
    data["stages"] = {
        str(stage): {
            **s,
            "ratio threefold / deepspeed": interval_json(ratio(s["blocks"], "threefold", "deepspeed")),
        }
        for stage, s in r["stages"].items()
    }
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


if __name__ == "__main__":
    main()
