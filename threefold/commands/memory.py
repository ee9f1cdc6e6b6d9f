"""`threefold memory`: per-rank bytes of parameters, gradients, optimizer state and activations
for a run configuration, measured on one real training step and predicted by the formulas.

    threefold memory --model.preset small --parallel.dp 2 --parallel.zero 1 [--json]

It takes the same keys as `threefold train` (one step is run, nothing is saved). For a model
too large to run here, `threefold plan` predicts the same quantities for any cluster.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

USAGE = """threefold memory [--config FILE] [--section.key VALUE ...] [--json]
  runs one training step of the configuration and prints, per rank, measured and predicted
  bytes of parameters, gradients, optimizer state and peak activations, the peak tensor
  bytes of start-up (model built and initialized, engine and optimizer made), and what
  memory replicas (checkpoint.memory_interval) cost: host RAM held and a snapshot's stall"""

COLUMNS = ("params", "grads", "optimizer", "activations")


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_rows(rows: list[dict], title: str) -> str:
    lines = [
        title,
        "measured / predicted per rank; ratio = measured / predicted of the total",
        f"{'rank':>4} {'tp':>3} {'pp':>3} {'dp':>3}  "
        + "  ".join(f"{c:>23}" for c in COLUMNS)
        + f"  {'total':>23} {'ratio':>6} {'startup peak':>12}",
    ]
    for r in rows:
        meas, pred = r["measured"], r["predicted"]
        cells = [f"{_size(meas[c]):>10} / {_size(pred[c]):>10}" for c in COLUMNS]
        total_m = sum(meas[c] for c in COLUMNS)
        covered = [c for c in COLUMNS if pred[c] is not None]
        total_p = sum(pred[c] for c in covered)
        ratio = sum(meas[c] for c in covered) / total_p if total_p else float("nan")
        total_p_cell = _size(total_p) if len(covered) == len(COLUMNS) else "-"
        lines.append(
            f"{r['rank']:>4} {r['tp']:>3} {r['pp']:>3} {r['dp']:>3}  "
            + "  ".join(cells)
            + f"  {_size(total_m):>10} / {total_p_cell:>10} {ratio:>6.3f} {_size(r.get('startup_peak')):>12}"
        )
    zero3 = [r for r in rows if r.get("zero3_params")]
    for r in zero3:
        z = r["zero3_params"]
        lines.append(
            f"{r['rank']:>4} zero 3 parameters at their peak: {_size(z['measured'])} / {_size(z['predicted'])} "
            f"({z['formula']}; ratio {z['measured'] / z['predicted']:.3f})"
        )
    if any(r["predicted"]["activations"] is None for r in rows):
        lines.append("activations: '-' = no formula for MoE layers (measured only; ratio over the other columns)")
    lines.append("startup peak: most tensor bytes held at once while the model and engine were built (measured)")
    if any(r.get("replica") for r in rows):
        lines += replica_lines(rows)
    return "\n".join(lines)


def replica_lines(rows: list[dict]) -> list[str]:
    """Memory replicas per rank: the host RAM they hold and the loop's wait for one snapshot."""
    lines = ["memory replicas (checkpoint.memory_interval):"]
    lines.append(f"{'rank':>4} {'state':>10} {'RAM held':>10} {'own':>10} {'kept':>10} {'stall':>9}  second copy")
    for r in rows:
        m = r.get("replica") or {}
        if not m:
            continue
        lines.append(
            f"{r['rank']:>4} {_size(m['state']):>10} {_size(m['total']):>10} {_size(m['own']):>10} "
            f"{_size(m['held'] + m['staging']):>10} {m['stall_s'] * 1e3:>7.2f}ms  {m['copy']}"
        )
    lines.append(
        "RAM held: two slots of the rank's own state (own) and two of each state it keeps for a rank of another "
        "node (kept); stall: the loop's wait for one snapshot (its host copy), median of 5"
    )
    return lines


def memory_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="threefold memory", usage=USAGE)
    parser.add_argument("--config", help="TOML file with [model], [parallel], [train], ... tables")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args, rest = parser.parse_known_args(argv)
    from threefold.config import build_config, parse_overrides
    from threefold.distributed.launch import WorkersFailed
    from threefold.training.entry import start_workers

    cfg = build_config(args.config, parse_overrides(rest))
    cfg.train.steps = 1
    cfg.checkpoint.dir, cfg.checkpoint.resume, cfg.checkpoint.interval = "", "", 0
    cfg.checkpoint.memory_interval = cfg.checkpoint.memory_interval or 1  # its cost is measured too
    cfg.log.quiet = True
    with tempfile.TemporaryDirectory(prefix="threefold-memory-") as tmp:
        cfg.log.dir = tmp
        try:
            rows = start_workers(cfg, measure_memory=True)
        except WorkersFailed as err:
            print(f"threefold: {err}", file=sys.stderr)
            return err.exit_code
    if rows is None:  # a torchrun worker other than rank 0
        return 0
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    p = cfg.parallel
    title = (
        f"threefold memory: {cfg.model.preset}, tp {p.tp} x pp {p.pp} x dp {p.dp}"
        + (f" (ep {p.ep})" if p.ep > 1 else "")
        + (f" x cp {p.cp} ({p.cp_impl})" if p.cp > 1 else "")
        + f", zero {p.zero}"
        + (f" (prefetch {p.zero3_prefetch})" if p.zero == 3 else "")
        + f", schedule {p.schedule}, "
        f"micro-batches {p.microbatches} x {cfg.train.micro_batch}, recompute {cfg.train.recompute}"
    )
    print(format_rows(rows, title))
    return 0
