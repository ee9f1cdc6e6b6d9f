"""The slow-link detector's traffic at scale, simulated in one process with torch's fake process
group (tests/distributed/test_scale.py has the pattern): on a report step every rank sends rank 0
one fixed-width row, the same bytes at 64 and at 16,384 ranks, and its per-group and per-neighbour
columns are a fixed few of them; rank 0 receives one row per rank, linear in the world with no
constant. Rank 0's detector then finds one slow pipeline pair among 16,384 ranks' rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys, time
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from threefold.config import Config, LogConfig
from threefold.distributed import comm
from threefold.distributed.grid import Grid, RankLayout
from threefold.observe import links
from threefold.observe.observer import GROUPS, StepObserver

real_gather = comm.gather_dim0

def gather(x, group):  # fake receives hold whatever memory held: rank 0 reads zeros
    out = real_gather(x, group)
    return None if out is None else out.zero_()

comm.gather_dim0 = gather
real_send, sent = comm.send, []

def send(x, group, peer):  # the hop probe's round trips (unrecorded in the groups' stats)
    sent.append(x.numel() * x.element_size())
    return real_send(x, group, peer)

comm.send = send
root, results = sys.argv[1], []
for tp, pp, dp, rank in json.loads(sys.argv[2]):
    world = tp * pp * dp
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    grid = Grid.build(RankLayout(tp=tp, pp=pp, dp=dp))
    log = LogConfig(dir=f"{root}/{world}_{rank}", spans=True, trace_steps="")
    observer = StepObserver(log, grid, torch.device("cpu"), is_logger=rank == 0)
    steps = []
    for step in range(2):  # a plain step, then a report step
        observer.begin_step(step)
        comm.all_reduce(torch.zeros(4), grid.dp)  # some traffic on the groups the links time
        comm.all_reduce(torch.zeros(4), grid.tp)
        comm.wait_all(comm.batch_send_recv([("send", torch.zeros(4), 1 - grid.pp.rank % 2)], grid.pp), grid.pp)
        before = grid.world.stats.snapshot()
        sent.clear()
        observer.end_step(report=step == 1)
        after = grid.world.stats.snapshot()
        steps.append({k: [c - before.get(k, (0, 0))[0], b - before.get(k, (0, 0))[1]] for k, (c, b) in after.items()
                      if (c, b) != before.get(k, (0, 0))})
        if sent:
            steps[-1]["probe"] = [len(sent), sum(sent)]
    rings = len({tuple(g.ranks) for g in (grid.tp, grid.dp) if g.size > 2})
    result = {"world": world, "rank": rank, "steps": steps, "columns": observer.links.width, "rings": rings}
    if rank == 0:  # every rank's row as rank 0 holds it; one pair slow: stage 0 -> 1 of the last replica
        view = observer.report_view({})
        a = grid.layout.rank_of(tp=tp - 1, dp=dp - 1, pp=0)
        b = grid.layout.rank_of(tp=tp - 1, dp=dp - 1, pp=1)
        for row in view.ranks:
            row["time_s"]["forward"] = 0.05
            row["links"]["pp_next_s"] = 0.2 if row["rank"] == a else 0.02 * (row["links"]["pp_next"] is not None)
            row["links"]["pp_prev_s"] = 0.2 if row["rank"] == b else 0.02 * (row["links"]["pp_prev"] is not None)
            row["links"]["hop_s"] = {"dp": 0.05 if row["rank"] == a else 0.0003}  # and one slow dp hop
        cfg = Config()
        cfg.log.spans = True
        detector = links.detector(cfg, grid)
        detector.on_report(view)  # a candidate is named on its second report in a row
        t0 = time.perf_counter()
        found = detector.on_report(view)
        ring = grid.layout.group_of(a, ("dp",))
        hop = f"dp {a}->{ring[(ring.index(a) + 1) % len(ring)]}"
        found = sorted(f.key for f in found)
        result.update(detect_s=time.perf_counter() - t0, found=found, pair=f"pp {a}->{b}", hop=hop)
    results.append(result)
    dist.destroy_process_group()
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    # Ranks 37 of tp2 pp4 dp8 and 9999 of tp8 pp16 dp128 both sit on a middle pipeline stage.
    cases = [(2, 4, 8, 37), (8, 16, 128, 9999), (2, 4, 8, 0), (8, 16, 128, 0)]
    root = tmp_path_factory.mktemp("link_scale")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-c", SCRIPT, str(root), json.dumps(cases)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return {(r["world"], r["rank"]): r for r in json.loads(out.stdout.splitlines()[-1])}


ROW = 58 * 8
"""Bytes of one rank's row: 7 head values (ZeRO's gather replay and waits among them), 16
categories, bytes and calls of 9 groups, and the links' 17 columns (9 groups' collective
seconds, the two pipeline neighbours' waits, 6 ring groups' hop round trips), float64."""


def test_a_report_costs_every_rank_the_same_bytes_at_any_world_size(runs):
    small, large = runs[64, 37], runs[16384, 9999]
    assert small["columns"] == large["columns"] == 9 + 2 + 6  # the links' share of the row: 136 bytes
    assert small["steps"][0] == large["steps"][0] == {}  # a plain step: the observer sends nothing
    report = [{k: v for k, v in r["steps"][1].items() if k != "probe"} for r in (small, large)]
    assert report[0] == report[1] == {"gather": [1, ROW]}, (small, large)
    # The hop probe: three round trips of one float32 per ring group of more than two (as the
    # pinger of its own hop and the responder of its predecessor's), at any world size.
    assert (small["rings"], large["rings"]) == (1, 2)  # dp 8; tp 8 and dp 128
    for r in (small, large):
        assert r["steps"][1]["probe"] == [6 * r["rings"], 6 * 4 * r["rings"]], r


def test_rank_0_receives_one_row_per_rank(runs):
    small, large = runs[64, 0]["steps"][1]["gather"], runs[16384, 0]["steps"][1]["gather"]
    assert small == [1, 64 * ROW] and large == [1, 16384 * ROW], (small, large)
    per_rank = (large[1] - small[1]) / (16384 - 64)
    assert per_rank == ROW  # linear with no constant
    print(f"rank 0 receives {per_rank:.0f} bytes per rank on a report step ({17 * 8} of them the links')")


def test_rank_0_names_the_one_slow_pair_and_hop_among_16384_ranks(runs):
    big = runs[16384, 0]
    assert big["found"] == sorted([big["pair"], big["hop"]]), big["found"]
    assert big["detect_s"] < 10.0, big["detect_s"]  # O(world log world), report steps only: 1-5 s here
    print(f"rank 0's link detector over 16,384 ranks' rows: {big['detect_s']:.2f} s")
