"""Start-up at scale, simulated in one process: torch's fake process group lets this process play
rank r of a world of 16,384 (collectives return at once). `new_group` is collective over the
whole job, so every rank creates every communicator; the grid creates each distinct group of two
or more ranks once, and none for a group of one rank. Then real training steps at that scale: the
per-step control plane (what every rank agrees on) costs the same at 64 and 16,384 ranks, and
per-rank detail reaches rank 0 on report steps only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys, time
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from threefold.distributed import comm
from threefold.distributed.grid import Grid, RankLayout

real_new_group = comm.new_group
results = []
for tp, pp, dp, ep, rank, split, cp in json.loads(sys.argv[1]):
    dist.init_process_group("fake", rank=rank, world_size=tp * pp * dp * cp, store=FakeStore())
    calls, splits = [], []

    def new_group(ranks, timeout=None, backend=None):
        calls.append(tuple(ranks))
        return real_new_group(ranks, timeout=timeout, backend=backend)

    def split_group(lists, timeout=None):  # NCCL's one-call split, played by new_group of our list
        splits.append(len(lists))
        assert sum(map(len, lists)) == len({r for g in lists for r in g})  # disjoint, as NCCL needs
        mine = [g for g in lists if rank in g]
        return real_new_group(mine[0]) if mine else None

    comm.new_group, comm.split_group, comm.can_split = new_group, split_group, lambda: split
    layout = RankLayout(tp=tp, pp=pp, dp=dp, ep=ep, cp=cp)
    t0 = time.perf_counter()
    grid = Grid.build(layout)
    build_s = time.perf_counter() - t0
    every = layout.group_lists()
    distinct = {tuple(g) for lists in every.values() for g in lists if 1 < len(g) < tp * pp * dp * cp}
    groups = {n: g for n, g in grid.groups.items() if n != "world"}
    results.append({
        "calls": len(calls), "distinct": len(distinct), "repeated": len(calls) - len(set(calls)),
        "splits": splits,
        "build_s": build_s,
        "members_ok": all(g.ranks in every[n] and rank in g.ranks for n, g in groups.items()),
        "singletons_without_handle": all(g.pg is None for g in groups.values() if g.size == 1),
        "handles_ok": all(g.pg is not None for g in groups.values() if g.size > 1),
        "dp_cp_is_dp": grid.dp_cp is grid.dp,
        "dp_cp_size": grid.dp_cp.size,
    })
    dist.destroy_process_group()
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def runs() -> dict:
    cases = {
        "64": (2, 4, 8, 1, 37, False, 1),
        "16384": (8, 16, 128, 1, 9999, False, 1),
        "16384 ep4": (8, 16, 128, 4, 4321, False, 1),
        "16384 split": (8, 16, 128, 4, 4321, True, 1),
        "16384 cp2": (8, 16, 64, 4, 4321, False, 2),
        "16384 cp2 split": (8, 16, 64, 4, 4321, True, 2),
    }
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(list(cases.values()))], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return dict(zip(cases, json.loads(out.stdout.splitlines()[-1])))


@pytest.mark.parametrize("case", ["64", "16384", "16384 ep4", "16384 cp2"])
def test_each_distinct_group_is_created_once_and_no_group_of_one(runs, case):
    run = runs[case]
    assert run["calls"] == run["distinct"] and run["repeated"] == 0, run
    assert run["members_ok"] and run["singletons_without_handle"], run


def test_where_the_backend_splits_each_dimension_is_one_call(runs):
    run = runs["16384 split"]
    # tp, pp, dp, ep, edp, expert_dp, embed less those equal to another: one call each, and none
    # of new_group; every group of the rank still gets its communicator from its dimension's split.
    assert run["calls"] == 0 and 1 <= len(run["splits"]) <= 7 and sum(run["splits"]) == runs["16384 ep4"]["distinct"]
    assert run["members_ok"] and run["singletons_without_handle"] and run["handles_ok"], run


def test_dp_cp_is_the_dp_group_without_cp_and_one_more_split_with_it(runs):
    # cp 1: the gradient replicas are the dp group itself (no communicator, no split of its own).
    assert all(runs[case]["dp_cp_is_dp"] for case in ("64", "16384", "16384 ep4", "16384 split"))
    cp2 = runs["16384 cp2 split"]
    assert not cp2["dp_cp_is_dp"] and cp2["dp_cp_size"] == 64 * 2
    # cp and dp_cp add one split each: still one call per dimension, whatever the world size.
    assert cp2["calls"] == 0 and len(cp2["splits"]) <= 9 and sum(cp2["splits"]) == runs["16384 cp2"]["distinct"]
    assert cp2["members_ok"] and cp2["handles_ok"], cp2


def test_grid_build_at_16384_ranks(runs):
    # Every group of every name, singletons included, was 37,136 calls and 2.1-2.4 s here.
    assert runs["16384"]["calls"] == 2048 + 1024 + 128 + 16 + 1024  # tp, pp, dp, expert_dp, embed
    assert runs["16384"]["build_s"] < 10.0  # a bound against O(world^2) work, not a speed test: 0.9-3 s here


STEP_SCRIPT = """
import json, sys, time
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from threefold.config import build_config
from threefold.distributed.grid import Grid
from threefold.training.trainer import Trainer
from threefold.distributed.runtime import layout_of
from threefold.validate import validate

cache, root, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
results = []
for tp, pp, dp, rank in cases:
    world = tp * pp * dp
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    pairs = {
        "model.preset": "tiny", "model.layers": pp, "model.heads": 8, "model.kv_heads": 8, "model.hidden": 64,
        "model.ffn_hidden": 128, "model.seq_len": 16, "parallel.tp": tp, "parallel.pp": pp, "parallel.dp": dp,
        "train.global_batch": dp, "train.micro_batch": 1, "train.steps": 4, "train.straggler_steps": 2,
        "train.nan_rollback_after": 0,  # received tensors hold whatever memory held: NaN, at times
        "log.interval": 2, "log.spans": "true", "log.dir": f"{root}/{world}_{rank}", "log.quiet": "true",
        "log.trace_steps": "",  # a traced step gathers every rank's spans once: not the per-step cost measured here
        "data.cache_dir": cache, "data.prefetch": 0, "checkpoint.dir": "",
    }
    cfg = validate(build_config(None, [(k, str(v)) for k, v in pairs.items()]), world)
    t0 = time.perf_counter()
    grid = Grid.build(layout_of(cfg))
    build_s = time.perf_counter() - t0
    trainer = Trainer(cfg, grid, torch.device("cpu"))
    marks = []
    step = trainer.queue_step

    def marked(*args, **kwargs):
        marks.append((grid.world.stats.total_calls, grid.world.stats.total_bytes))
        return step(*args, **kwargs)

    trainer.queue_step = marked
    trainer.train()
    marks.append((grid.world.stats.total_calls, grid.world.stats.total_bytes))
    # What one step's control plane costs the host at this world size (collectives are instant here).
    norm, loss = torch.ones(()), torch.ones((), dtype=torch.float64)
    t0 = time.perf_counter()
    for _ in range(20):
        trainer.guard.agree(norm, loss, 0.1, trainer.engine, (1.0, 0.0, 0.0, 0.0))
        trainer.guard.settle(trainer.guard.take_pending().tolist())
    agree_s = (time.perf_counter() - t0) / 20
    trainer.guard.health._times = [0.1] * cfg.log.interval
    t0 = time.perf_counter()
    trainer.guard.health.report()
    report_s = time.perf_counter() - t0
    results.append({
        "world": world, "rank": rank, "build_s": build_s, "agree_s": agree_s, "report_s": report_s,
        "steps": [[b[0] - a[0], b[1] - a[1]] for a, b in zip(marks, marks[1:])],
    })
    dist.destroy_process_group()
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def control(tmp_path_factory, cache_dir) -> dict:
    """Four training steps (log.interval 2: steps 2 and 4 report) of a real Trainer with spans on,
    as rank 0 and as another rank, at world 64 (tp2 pp4 dp8) and 16,384 (tp8 pp16 dp128)."""
    cases = [(2, 4, 8, 0), (2, 4, 8, 37), (8, 16, 128, 0), (8, 16, 128, 9999)]
    root = tmp_path_factory.mktemp("control")
    args = [sys.executable, "-c", STEP_SCRIPT, cache_dir, str(root), json.dumps(cases)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return {(r["world"], r["rank"]): r for r in json.loads(out.stdout.splitlines()[-1])}


AGREE_BYTES = 8 * 8  # the step's one world collective: health.py's MAX of 8 fp64


def test_control_plane_per_step_is_flat_in_the_world_size(control):
    # A plain step: the MAX of 8 fp64 values (two flags, five worst values, a stop signal) over
    # the world, on every rank and at every world size; the loss rides the norm's dp and pp sums.
    for key, run in control.items():
        assert [run["steps"][i] for i in (0, 2)] == [[1, AGREE_BYTES], [1, AGREE_BYTES]], (key, run["steps"])
    # A report step adds the gathers to rank 0 (compute times, spans): the same few bytes from
    # every other rank at 64 and at 16,384 ranks.
    assert control[64, 37]["steps"][1] == control[16384, 9999]["steps"][1] == control[16384, 9999]["steps"][3]
    calls, sent = control[16384, 9999]["steps"][1]
    assert calls == 3 and sent < AGREE_BYTES + 1024, control[16384, 9999]["steps"]


def test_rank_0_gathers_in_linear_bytes_only_on_report_steps(control):
    small, large = control[64, 0]["steps"][1][1] - AGREE_BYTES, control[16384, 0]["steps"][1][1] - AGREE_BYTES
    per_rank = (large - small) / (16384 - 64)
    assert small == 64 * per_rank and per_rank < 1024, (small, large)  # linear, no constant
    print(f"rank 0 gathers {per_rank:.0f} bytes per rank on a report step")


def test_control_plane_time_at_16384_ranks(control):
    big = control[16384, 0]
    # Measured here: Grid.build 0.9-1.6 s, agree + settle ~0.1 ms, a report on rank 0 ~0.3 s.
    assert big["build_s"] < 10.0 and big["agree_s"] < 0.05 and big["report_s"] < 10.0, big
