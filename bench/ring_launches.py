"""Kernel launches of one ring-attention layer on CPU: the aten ops of one forward + backward.

    python bench/ring_launches.py                                   # this tree
    python bench/ring_launches.py --before /tmp/issue32/base        # that tree, then this one
    python bench/ring_launches.py --seq 16384 --cp 4 --batch 2

The default is the attention of bench/before_after.py's cp2-ring-4k case: the tiny model's
layer (4 heads, 2 kv heads, head dim 32) at micro-batch 1, seq 4096 over cp 2 (2 gloo
processes), fp32. torch.profiler records one forward + backward of context_parallel_attention
after a warm-up, and counts aten ops at the top level (an op run inside another aten op is part
of it): `ops` all of them, views included; `launches` those that compute something, i.e. the op
or one of its children is not a view, a reshape without a copy or an allocation. On a GPU each
such op is at least one kernel launch. Every rank's counts are printed (the zigzag layout gives
them the same work; their views differ). Each tree runs in its own interpreter with itself
first on PYTHONPATH; the line names the threefold package it imported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Ops that move no data: views, metadata and allocations (an allocation is not a launch).
NO_COMPUTE = {
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::slice", "aten::select",
    "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::as_strided", "aten::transpose", "aten::permute",
    "aten::t", "aten::unbind", "aten::split", "aten::chunk", "aten::narrow", "aten::alias", "aten::detach",
    "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::empty", "aten::empty_like",
    "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided", "aten::to",
}  # fmt: skip


def _computes(event) -> bool:
    """The op or one of its children moves data (aten::to that copies has a copy_ child)."""
    if event.name.startswith("aten::") and event.name not in NO_COMPUTE:
        return True
    return any(_computes(child) for child in event.cpu_children)


def count_ops(events) -> dict:
    """Top-level aten ops among profiler events, and those of them that compute. Left out: the
    gradient accumulation into the benchmark's leaf inputs (in a model, q, k and v are no
    leaves: their gradients flow on into the projections)."""
    top = []
    for event in events:
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::") and "AccumulateGrad" not in parent.name:
            parent = parent.cpu_parent
        if parent is None:
            top.append(event)
    return {"ops": len(top), "launches": sum(_computes(e) for e in top)}


def _worker(seq: int, batch: int, heads: int, kv_heads: int, hd: int, dtype: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import threefold
    from threefold.distributed import comm
    from threefold.distributed.comm import Group
    from threefold.distributed.context_parallel import context_parallel_attention, shard_sequence
    from threefold.distributed.runtime import init_distributed, shutdown_distributed

    init_distributed(torch.device("cpu"), timeout_s=600)
    cp = comm.world_size()
    group = Group("cp", list(range(cp)), comm.world_handle(), device=torch.device("cpu"), span_category="cp_comm")
    g = torch.Generator().manual_seed(0)
    kind = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    shapes = [(batch, heads, seq, hd), (batch, kv_heads, seq, hd), (batch, kv_heads, seq, hd), (batch, heads, seq, hd)]
    q, k, v, w = (shard_sequence(torch.randn(s, generator=g).to(kind), 2, cp, group.rank) for s in shapes)

    def layer(mine):
        context_parallel_attention(*mine, group, "ring").backward(w)

    layer([x.clone().requires_grad_() for x in (q, k, v)])  # warm-up: lazy initialisation stays out
    mine = [x.clone().requires_grad_() for x in (q, k, v)]
    comm.barrier(group)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        layer(mine)
    counts = count_ops(prof.events())
    shutdown_distributed()
    return {**counts, "threefold": str(Path(threefold.__file__).parent)}


def measure(args) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from harness import run_ranks

    shape = (args.seq, args.batch, args.heads, args.kv_heads, args.hd, args.dtype)
    ranks = run_ranks(_worker, args.cp, *shape, timeout=args.timeout)
    return {**ranks[0], "launches": [r["launches"] for r in ranks], "ops": [r["ops"] for r in ranks]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="", help="another source tree, counted first (PYTHONPATH=it)")
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096, help="global sequence length")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--hd", type=int, default=32)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)  # one tree, for the parent
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.json_only:
        print(json.dumps(measure(args)))
        return
    print(
        f"ring attention, one layer forward + backward: cp {args.cp}, seq {args.seq}, batch {args.batch}, "
        f"heads {args.heads}/{args.kv_heads} kv, head dim {args.hd}, {args.dtype}"
    )
    trees = [("before", args.before)] if args.before else []
    for label, tree in trees + [("this tree", str(ROOT))]:
        keys = ("cp", "seq", "batch", "heads", "kv_heads", "hd", "dtype", "timeout")
        argv = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
        path = os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        script = str(Path(__file__).resolve())
        done = subprocess.run(
            [sys.executable, script, *argv, "--json-only"],
            env=dict(os.environ, PYTHONPATH=path),
            capture_output=True,
            text=True,
            cwd=tree,
        )
        if done.returncode:
            print(f"  {label}: failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
            continue
        got = json.loads(done.stdout.strip().splitlines()[-1])
        launches, ops = ("/".join(map(str, got[k])) for k in ("launches", "ops"))
        print(f"  {label:>9}: {launches} launches, {ops} aten ops (rank 0/1/..)   ({got['threefold']})")


if __name__ == "__main__":
    main()
