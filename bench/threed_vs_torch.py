"""Full 3D (dp x tp x pp) training step: threefold vs PyTorch's composable stack, side by side.

Both contestants train the same model (threefold's Transformer, tiny preset) in the same
dp*tp*pp gloo processes (8 for the default dp2 x tp2 x pp2), on the same global batch cut into
the same micro-batches, with the same AdamW hyper-parameters, constant lr and clipping:

  A  threefold: its Trainer's train_step, the step `threefold train` runs: build_stage over
     build_model (TP-sharded chunks) -> PipelineExecutor.run -> finalize_grads (DataParallel,
     ZeRO `--zero`, default 3; TP partial sums; the global norm over dp, tp and pp) -> the
     ranks' health all-gather -> clip + AdamW -> zero_grad -> the loss and metrics reductions.
  B  torch: for each pipeline rank, the plain (unsharded) chunk with the same layer ids and
     the same layout-invariant initialization, then DTensor tensor parallelism
     (`parallelize_module`: ColwiseParallel wq/wk/wv/w1/w3/head, RowwiseParallel wo/w2 and the
     embedding, the head's logits left vocab-sharded under `loss_parallel`), then FSDP2
     `fully_shard` per block and per chunk over the dp dimension of one 3-D DeviceMesh
     (pp, dp, tp), so each stage's parameters are 2-D (dp, tp) sharded; then
     `torch.distributed.pipelining.PipelineStage` over the mesh's pp group with the matching
     schedule class (Schedule1F1B / ScheduleGPipe), loss = summed cross-entropy / tokens of
     the dp rank's batch (FSDP2 averages over dp), scale_grads=False; the global gradient norm
     as torchtitan computes it (per-mesh DTensor norms, squared, summed over pp), foreach
     clipping and one AdamW(foreach=True) per device mesh (bench/torch_peers.py).

Configured identically: same weights, same batches, same lr (constant), betas, eps 1e-8,
weight decay on matrices only, clipping at the same global norm, fp32 everywhere, dropout 0,
no sequence parallelism, no tied embeddings. FSDP2 runs with reshard_after_forward=False
inside the pipeline, as torchtitan does, so parameters are gathered once per step rather than
per micro-batch. Contestants alternate in blocks A, B, A, B ... inside one process group;
step time is the interval between step ends on global rank 0 (median and interquartile range);
tokens/s = global batch tokens / step time; the ratio is the median over rounds of the
per-round ratio, with its 95% bootstrap interval (bench/stats.py).

The threefold side also reports the bytes its collectives moved per step next to the analytic
count for the layout (the tp and dp groups' stats, which threefold's communication layer keeps
for every group) and its per-rank model-state memory next to ZeRO's formula.

    python bench/threed_vs_torch.py [--dp 2 --tp 2 --pp 2] [--rounds 9] [--steps 1] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]
os.environ.setdefault("OMP_NUM_THREADS", "1")

from composable3d import SCHEDULES, torch_contestant  # noqa: E402
from stats import show  # noqa: E402
from timing import alternate, cell, feeder, ratio, steps_of, summary  # noqa: E402

from harness import run_ranks  # noqa: E402


def make_cfg(dp: int, tp: int, pp: int, schedule: str, zero: int, shape: dict):
    from threefold.config import build_config
    from threefold.validate import validate

    pairs = [(k, str(v)) for k, v in shape.items()]
    pairs += [
        ("parallel.dp", str(dp)),
        ("parallel.tp", str(tp)),
        ("parallel.pp", str(pp)),
        ("parallel.schedule", schedule),
        ("parallel.zero", str(zero)),
        ("parallel.sp", "false"),
        ("train.warmup_steps", "0"),
        ("train.min_lr_ratio", "1.0"),
    ]  # constant lr, as the torch side
    return validate(build_config(None, pairs), dp * tp * pp)


def threefold_contestant(cfg, grid):
    """step(micro, n_tokens) -> the summed token loss of the global batch, through threefold's
    Trainer; and the model-state memory after its first update."""
    from threefold_side import MemoryAfterFirstStep, stepper, trainer

    probe = MemoryAfterFirstStep()
    tf = trainer(cfg, grid, probe)
    run = stepper(tf)
    blocks = sum(q.numel() for c in tf.chunks for q in c.layers.parameters())
    memory = {"block_numel": blocks}

    def step(micro, n_tokens):
        loss = run(micro) * n_tokens
        if "measured" not in memory:
            report = probe.report
            memory.update(
                measured=report.measured_total,
                predicted=report.predicted_total,
                formula=report.formula,
                numel=report.numel,
            )
        return loss

    return step, memory


def analytic_bytes(cfg, layers: int, first: bool, last: bool, numel: int, block_numel: int) -> dict:
    """Message bytes per step on this rank that the layout needs (the convention of Group.stats).
    TP without SP: per layer and micro-batch 2 forward all-reduces (attention and MLP outputs)
    and 2 backward (the inputs of the column-parallel projections) of s*b*h values; the first
    stage's vocab-parallel embedding adds one forward, the last stage's head one backward.
    DP (P = this rank's parameters, fp32): ZeRO 0 one all-reduce of P; 1/2 a reduce-scatter of
    the gradients and an all-gather of the parameters (2P); 3 (threefold/distributed/
    data_parallel/params.py) a reduce-scatter of P, every block gathered for each micro-batch's
    forward and again for its backward, the root (embedding, norm, head) once per micro-batch
    (the root stays gathered from a forward to its backward: fewer when micro-batches overlap)."""
    m, p = cfg.model, cfg.parallel
    x = m.seq_len * cfg.train.micro_batch * m.hidden * 4
    tp = p.microbatches * x * (4 * layers + int(first) + int(last)) if p.tp > 1 else 0
    if p.dp == 1:
        dp = 0
    elif p.zero == 0:
        dp = numel
    elif p.zero in (1, 2):
        dp = 2 * numel
    else:
        dp = numel + 2 * p.microbatches * block_numel + p.microbatches * (numel - block_numel)
    return {"tp": tp, "dp": 4 * dp}


def bench_worker(
    dp: int, tp: int, pp: int, schedule: str, zero: int, shape: dict, rounds: int, steps: int, warmup: int
) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from threefold.data import GlobalBatchSampler, load_tokens
    from threefold.distributed.grid import Grid, RankLayout
    from threefold.distributed.pipeline.partition import stage_layer_ids
    from threefold.distributed.runtime import init_distributed, shutdown_distributed

    init_distributed(torch.device("cpu"), timeout_s=900)
    cfg = make_cfg(dp, tp, pp, schedule, zero, shape)
    grid = Grid.build(RankLayout(tp=tp, dp=dp, pp=pp))
    # threefold's default order tp-cp-ep-dp-pp puts rank = tp + tp*dp_index + tp*dp*pp_index:
    # the row-major (pp, dp, tp) mesh gives every rank the same coordinates on both sides.
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    assert (mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()) == (
        grid.pp_rank,
        grid.dp_rank,
        grid.tp_rank,
    )
    t, m = cfg.train, cfg.model
    tokens = load_tokens(cfg.data.path, cfg.data.vocab, cfg.data.dtype, cfg.data.cache_dir).tokens
    sampler = GlobalBatchSampler(len(tokens), m.seq_len, t.global_batch, t.seed)
    n_data = 2 + warmup + rounds * steps
    data = [sampler.microbatches(tokens, s, grid.dp_rank, dp, t.micro_batch) for s in range(n_data)]
    n_tokens = t.global_batch * m.seq_len

    tf_step, tf_memory = threefold_contestant(cfg, grid)
    tp0, dp0 = grid.tp.stats.total_bytes, grid.dp.stats.total_bytes
    first_loss = {"threefold": [tf_step(data[0], n_tokens)]}
    comm = {"tp": grid.tp.stats.total_bytes - tp0, "dp": grid.dp.stats.total_bytes - dp0}
    torch_step, torch_memory = torch_contestant(cfg, schedule, mesh, n_tokens // dp)
    steps_of_contestant = {"threefold": tf_step, "torch": torch_step}
    first_loss["torch"] = [torch_step(data[0], n_tokens)]
    for name, step in steps_of_contestant.items():  # second step: checks the gradients and the update agree
        first_loss[name].append(step(data[1], n_tokens))
    # Each contestant walks the same batches (data[2], data[3], ...) through warm-up and timing.
    contestants = {name: feeder(step, data[2:], n_tokens) for name, step in steps_of_contestant.items()}
    blocks = alternate(contestants, rounds, steps, dist.barrier, warmup)
    layers = stage_layer_ids(m, pp, 1, cfg.parallel.stage_layers)[grid.pp_rank]
    analytic = analytic_bytes(
        cfg, len(layers), grid.is_first_stage, grid.is_last_stage, tf_memory["numel"], tf_memory["block_numel"]
    )
    out = {
        "rank": grid.global_rank,
        "coords": (grid.dp_rank, grid.tp_rank, grid.pp_rank),
        "blocks": blocks,
        "losses": first_loss,
        "comm": comm,
        "analytic": analytic,
        "memory": {"threefold": tf_memory, "torch": torch_memory},
    }
    del contestants, steps_of_contestant
    gc.collect()
    shutdown_distributed()
    return out


def global_losses(per_rank: list[dict], n_tokens: int) -> dict[str, list[float]]:
    """Loss per token of the whole global batch: threefold's step reduces it (every rank has
    it); torch's is the sum of the last stage's tp-rank-0 values over dp."""
    out = {"threefold": [per_rank[0]["losses"]["threefold"][k] / n_tokens for k in range(2)]}
    holders = [r for r in per_rank if r["losses"]["torch"][0] is not None and r["coords"][1] == 0]
    out["torch"] = [sum(r["losses"]["torch"][k] for r in holders) / n_tokens for k in range(2)]
    return out


def run(
    dp: int = 2,
    tp: int = 2,
    pp: int = 2,
    schedule: str = "1f1b",
    zero: int = 3,
    rounds: int = 9,
    steps: int = 1,
    warmup: int = 1,
    shape: dict | None = None,
) -> dict:
    shape = shape or {"model.preset": "tiny", "model.seq_len": 64, "train.global_batch": 16, "train.micro_batch": 2}
    per_rank = run_ranks(
        bench_worker, dp * tp * pp, dp, tp, pp, schedule, zero, shape, rounds, steps, warmup, timeout=1800
    )
    cfg = make_cfg(dp, tp, pp, schedule, zero, shape)
    n_tokens = cfg.train.global_batch * cfg.model.seq_len
    blocks = per_rank[0]["blocks"]
    a, b = summary(steps_of(blocks["threefold"])), summary(steps_of(blocks["torch"]))
    losses = global_losses(per_rank, n_tokens)
    return {
        "dp": dp,
        "tp": tp,
        "pp": pp,
        "schedule": schedule,
        "zero": zero,
        "m": cfg.parallel.microbatches,
        "micro_batch": cfg.train.micro_batch,
        "global_batch": cfg.train.global_batch,
        "seq": cfg.model.seq_len,
        "layers": cfg.model.layers,
        "hidden": cfg.model.hidden,
        "grad_clip": cfg.train.grad_clip,
        "rounds": rounds,
        "steps": steps,
        "warmup": warmup,
        "blocks": blocks,
        "bucket_mb": cfg.parallel.bucket_mb,
        "threefold": a,
        "torch": b,
        "tokens_per_s": (n_tokens / a[0], n_tokens / b[0]),
        "ratio": ratio(blocks, "torch", "threefold"),
        "losses": losses,
        "loss_diff": max(abs(x - y) for x, y in zip(losses["threefold"], losses["torch"])),
        "ranks": per_rank,
    }


def markdown(r: dict) -> str:
    lines = [
        f"dp{r['dp']} x tp{r['tp']} x pp{r['pp']} ({r['dp'] * r['tp'] * r['pp']} processes), {r['schedule']}, "
        f"tiny llama ({r['layers']} layers, hidden {r['hidden']}), seq {r['seq']}, global batch "
        f"{r['global_batch']} = dp {r['dp']} x {r['m']} micro-batches of {r['micro_batch']}; threefold ZeRO "
        f"{r['zero']} vs FSDP2; {r['rounds']} rounds x {r['steps']} steps interleaved, median [IQR] ms "
        "on rank 0; ratio: median per-round ratio [95% bootstrap interval]",
        "",
        "| contestant | step ms | tokens/s | loss step 1 | loss step 2 |",
        "|---|---|---|---|---|",
    ]
    for k, label in (("threefold", "threefold"), ("torch", "FSDP2 + DTensor TP + pipelining")):
        i = 0 if k == "threefold" else 1
        la = r["losses"][k]
        lines.append(
            f"| {label} | {cell(steps_of(r['blocks'][k]))} | {r['tokens_per_s'][i]:,.0f} | {la[0]:.6f} | {la[1]:.6f} |"
        )
    lines += [
        "",
        f"tokens/s ratio threefold / torch: **{show(r['ratio'])}**; largest loss difference "
        f"{r['loss_diff']:.1e}. With {r['dp'] * r['tp'] * r['pp']} processes on a few CPU cores and a tiny "
        "model, the ratio weighs each stack's Python and per-operator dispatch overhead (DTensor's above all) "
        "more than its parallel algorithms.",
        "",
        "Configured identically: the same weights (threefold's layout-invariant initialization of the plain "
        "chunks), the same batches (threefold's sampler), constant lr, AdamW betas, eps 1e-8 and weight "
        f"decay on matrices only, both clipping at global gradient norm {r['grad_clip']}, fp32, dropout 0, "
        "no sequence parallelism, untied embeddings. What differs is each stack's own machinery: FSDP2 runs "
        "with reshard_after_forward=False (torchtitan's setting under pipelining: one gather per step) "
        "while threefold's ZeRO 3 gathers each block per micro-batch.",
        "",
        "Contestants:",
        "",
        f"- threefold: its Trainer's train_step: build_stage over build_model, PipelineExecutor "
        f"({r['schedule']}), finalize_grads (DataParallel ZeRO {r['zero']}, bucket {r['bucket_mb']:g} MiB; TP "
        "partial sums; the norm over dp, tp and pp), the ranks' health all-gather, clip + the engine's AdamW "
        "(torch's foreach arithmetic on flat shards), the loss and metrics reductions.",
        f"- torch: DTensor TP (parallelize_module) inside FSDP2 fully_shard per block and per chunk "
        f"(reshard_after_forward=False) on a (pp {r['pp']}, dp {r['dp']}, tp {r['tp']}) DeviceMesh with dp x tp "
        "flattened (one all-reduce for 2-D norms), "
        f"pipelining.PipelineStage + {SCHEDULES[r['schedule']]}(scale_grads=False), loss_parallel; "
        f"{r['ranks'][0]['memory']['torch']['optimizer']}.",
        f"- Both: the same weights and batches, constant lr, clipping at {r['grad_clip']}, fp32; two checked "
        f"steps then {r['warmup']} untimed warm-up step(s) each, then {r['rounds']} rounds x {r['steps']} "
        "step(s) alternating threefold, torch; per-round value = median of the round's step times on rank 0.",
        "",
        "Per-rank communication of one threefold step vs the analytic count, and model-state memory "
        "(parameters + gradients + optimizer state after the step) vs ZeRO's formula and FSDP2:",
        "",
        "| rank (dp, tp, pp) | TP bytes | TP analytic | ratio | DP bytes | DP analytic | ratio | "
        "memory B | formula B | FSDP2 B |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for q in r["ranks"]:
        c, an, mem = q["comm"], q["analytic"], q["memory"]
        dp_an = an["dp"]
        tp_ratio = f"{c['tp'] / an['tp']:.3f}" if an["tp"] else "-"
        dp_ratio = f"{c['dp'] / dp_an:.3f}" if dp_an else "-"
        lines.append(
            f"| {q['rank']} {q['coords']} | {c['tp']:,} | {an['tp']:,} | {tp_ratio} | {c['dp']:,} | "
            f"{dp_an:,} | {dp_ratio} | {mem['threefold']['measured']:,} | "
            f"{mem['threefold']['predicted']:,.0f} | {mem['torch']['measured']:,} |"
        )
    lines += [
        "",
        "TP analytic: 4 all-reduces of seq x micro-batch x hidden fp32 values per layer and micro-batch "
        "(2 forward, 2 backward), plus the vocab-parallel embedding (first stage) and head input gradient "
        "(last stage); the last stage's excess is the vocab-parallel cross-entropy's per-token statistics. "
        f"DP analytic (ZeRO {r['zero']}): " + DP_RULE[min(r["zero"], 3)] + " Memory formula: ZeRO's "
        f"{r['ranks'][0]['memory']['threefold']['formula']} (P: the rank's parameters, N: dp).",
    ]
    return "\n".join(lines)


DP_RULE = {
    0: "one all-reduce of the rank's P gradients.",
    1: "reduce-scatter of P gradients + all-gather of P parameters.",
    2: "reduce-scatter of P gradients + all-gather of P parameters.",
    3: "reduce-scatter of P gradients, each block all-gathered for every micro-batch's forward and again "
    "for its backward, the root (embedding, final norm, head) once per micro-batch (fewer when it is "
    "still gathered from the micro-batch before).",
}


def comm_ratios(r: dict) -> dict[str, float]:
    """Worst measured/analytic ratio of TP and DP bytes over ranks, and memory vs formula."""
    tp, dp, mem = [], [], []
    for q in r["ranks"]:
        an, m = q["analytic"], q["memory"]["threefold"]
        if an["tp"]:
            tp.append(q["comm"]["tp"] / an["tp"])
        if an["dp"]:
            dp.append(q["comm"]["dp"] / an["dp"])
        mem.append(m["measured"] / m["predicted"])
    out = {"memory / ZeRO formula (worst rank)": max(mem)}
    if tp:
        out["TP bytes / analytic (worst rank)"] = max(tp)
    if dp:
        out["DP bytes / analytic (worst rank)"] = max(dp)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES))
    ap.add_argument("--zero", type=int, default=3, choices=[0, 1, 2, 3])
    ap.add_argument("--rounds", type=int, default=9, help="rounds: one threefold block, one torch block")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per block")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="3 rounds of 1 step, no extra warm-up")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 3, 1, 0
    r = run(args.dp, args.tp, args.pp, args.schedule, args.zero, args.rounds, args.steps, args.warmup)
    print(markdown(r))
    return r


if __name__ == "__main__":
    main()
