"""Per-rank activation memory under tensor/sequence parallelism and recomputation, measured
next to the formulas (threefold/model/activations.py, derived in docs/tensor_parallel.md).

Measured = bytes of the tensors autograd saves during one forward on rank 0, each storage
once, parameters excluded, attributed to the layer that saved them (SavedTensorMeter); mean
over the layers. Predicted = this model's per-layer formula. The Korthikanti et al. 2022 column
is the paper's GPT-layer formula as published (16-bit, dropout), for scale.

    python bench/tp_memory.py [--seq 512] [--batch 2] [--hidden 256] [--tp 1 2 4] [--attention flash math]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from harness import run_ranks  # noqa: E402

MODES = ("none", "selective", "full")


def shape_overrides(args) -> dict:
    return {
        "model.hidden": args.hidden,
        "model.heads": args.heads,
        "model.kv_heads": args.kv_heads,
        "model.ffn_hidden": args.ffn,
        "model.seq_len": args.seq,
        "model.layers": args.layers,
        "model.vocab": args.vocab,
    }


def measure_worker(world: int, shape: dict, batch: int, attentions: list[str]) -> list[dict]:
    """Every rank runs each forward (the collectives need them all); rank 0 reports."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from threefold.config import build_config
    from threefold.distributed.grid import Grid, RankLayout
    from threefold.distributed.parallelize import build_model
    from threefold.distributed.runtime import init_distributed, shutdown_distributed
    from threefold.model.activations import SavedTensorMeter
    from threefold.model.layers import rope_tables

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
    init_distributed(torch.device("cpu"), timeout_s=300)
    grid = Grid.build(RankLayout(tp=world))
    rows = []
    for sp in (False, True) if world > 1 else (False,):
        for mode in MODES:
            pairs = [(k, str(v)) for k, v in shape.items()]
            pairs += [("parallel.tp", str(world)), ("parallel.sp", str(sp)), ("train.recompute", mode)]
            cfg = build_config(None, pairs)
            m = cfg.model
            model = build_model(cfg, grid, torch.device("cpu"))
            torch.manual_seed(0)
            tokens = torch.randint(0, m.vocab, (batch, m.seq_len))
            for attention in attentions:
                tables = rope_tables(m.seq_len, m.head_dim, m.rope_theta, torch.device("cpu"))
                meter = SavedTensorMeter(model, exclude=list(tables))
                with sdpa_kernel([backends[attention]]):
                    with meter:
                        loss = model(tokens, tokens)
                    loss.backward()  # inside the kernel choice: selective recompute reruns the core
                model.zero_grad(set_to_none=True)
                rows.append(
                    {
                        "tp": world,
                        "sp": sp,
                        "recompute": mode,
                        "attention": attention,
                        "per_layer": meter.per_layer(),
                        "other": meter.by_scope.get("other", 0),
                    }
                )
    shutdown_distributed()
    return rows


def predicted(shape: dict, batch: int, row: dict) -> tuple[float, float]:
    from threefold.model.activations import korthikanti_layer_bytes, layer_activation_elements

    s, h, a = shape["model.seq_len"], shape["model.hidden"], shape["model.heads"]
    ours = 4 * layer_activation_elements(
        s,
        batch,
        h,
        a,
        shape["model.kv_heads"],
        shape["model.ffn_hidden"],
        row["tp"],
        row["sp"],
        row["recompute"],
        row["attention"],
    )
    paper = korthikanti_layer_bytes(s, batch, h, a, row["tp"], row["sp"], row["recompute"])
    return ours, paper


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--attention", nargs="+", default=["flash", "math"], choices=["flash", "math"])
    args = ap.parse_args(argv)
    shape = shape_overrides(args)
    rows = []
    for t in args.tp:
        rows += run_ranks(measure_worker, t, t, shape, args.batch, args.attention, timeout=900)[0]
    mib = 1 / 2**20
    print(
        f"Activation memory per layer per rank (fp32), s={args.seq} b={args.batch} h={args.hidden} "
        f"a={args.heads} kv={args.kv_heads} f={args.ffn}, {args.layers} layers\n"
    )
    print(
        "| attention | tp | sp | recompute | measured MiB | predicted MiB | measured/predicted "
        "| Korthikanti (16-bit GPT) MiB | rest of model MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in sorted(rows, key=lambda r: (r["attention"], r["tp"], r["sp"], MODES.index(r["recompute"]))):
        ours, paper = predicted(shape, args.batch, row)
        row.update(predicted=ours, korthikanti=paper, ratio=row["per_layer"] / ours)
        print(
            f"| {row['attention']} | {row['tp']} | {'on' if row['sp'] else 'off'} | {row['recompute']} "
            f"| {row['per_layer'] * mib:.2f} | {ours * mib:.2f} | {row['ratio']:.3f} | {paper * mib:.2f} "
            f"| {row['other'] * mib:.2f} |"
        )
    return rows


if __name__ == "__main__":
    main()
