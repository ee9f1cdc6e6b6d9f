"""Start-up at scale, simulated in one process: torch's fake process group lets this process play
rank r of a world of 16,384 (collectives return at once). `new_group` is collective over the
whole job, so every rank creates every communicator; the grid creates each distinct group of two
or more ranks once, and none for a group of one rank."""

from __future__ import annotations

import json
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
for tp, pp, dp, ep, rank in json.loads(sys.argv[1]):
    dist.init_process_group("fake", rank=rank, world_size=tp * pp * dp, store=FakeStore())
    calls = []

    def new_group(ranks, timeout=None, backend=None):
        calls.append(tuple(ranks))
        return real_new_group(ranks, timeout=timeout, backend=backend)

    comm.new_group = new_group
    layout = RankLayout(tp=tp, pp=pp, dp=dp, ep=ep)
    t0 = time.perf_counter()
    grid = Grid.build(layout)
    build_s = time.perf_counter() - t0
    every = layout.group_lists()
    distinct = {tuple(g) for lists in every.values() for g in lists if 1 < len(g) < tp * pp * dp}
    groups = {n: g for n, g in grid.groups.items() if n != "world"}
    results.append({
        "calls": len(calls), "distinct": len(distinct), "repeated": len(calls) - len(set(calls)),
        "build_s": build_s,
        "members_ok": all(g.ranks in every[n] and rank in g.ranks for n, g in groups.items()),
        "singletons_without_handle": all(g.pg is None for g in groups.values() if g.size == 1),
    })
    dist.destroy_process_group()
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def runs() -> dict:
    cases = {"64": (2, 4, 8, 1, 37), "16384": (8, 16, 128, 1, 9999), "16384 ep4": (8, 16, 128, 4, 4321)}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(list(cases.values()))], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return dict(zip(cases, json.loads(out.stdout.splitlines()[-1])))


@pytest.mark.parametrize("case", ["64", "16384", "16384 ep4"])
def test_each_distinct_group_is_created_once_and_no_group_of_one(runs, case):
    run = runs[case]
    assert run["calls"] == run["distinct"] and run["repeated"] == 0, run
    assert run["members_ok"] and run["singletons_without_handle"], run


def test_grid_build_at_16384_ranks(runs):
    # Every group of every name, singletons included, was 37,136 calls and 2.1-2.4 s here.
    assert runs["16384"]["calls"] == 2048 + 1024 + 128 + 16 + 1024  # tp, pp, dp, expert_dp, embed
    assert runs["16384"]["build_s"] < 2.0
