"""The stack check's exchange at scale, simulated in one process with torch's fake process group
(collectives return at once; its gather hands rank 0 copies of rank 0's own record, so the
simulated world is one where every rank matches). A rank rank 0 asks for its fingerprint is
played by making the plan's broadcast name it, as rank 0 would.

At world 64 and 16,384, each rank's collectives and bytes are the same; only rank 0's gather
grows, by one fixed-size record per rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys, time
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from threefold.distributed import comm
from threefold.distributed.grid import Grid, RankLayout
from threefold.preflight import stack
from threefold.preflight.fingerprint import apply_stack_drill, fingerprint

cpu = torch.device("cpu")
real_broadcast = comm.broadcast
asked = []


def broadcast(x, group, src=0):
    out = real_broadcast(x, group, src)
    if asked and x.numel() == stack.PLAN:  # rank 0's plan names this rank
        x.fill_(-1)
        x[0] = asked[0]
    return out


comm.broadcast = broadcast
results = []
for world, rank, differs in json.loads(sys.argv[1]):
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    grid = Grid.build(RankLayout(dp=world), device=cpu)
    fp = fingerprint(cpu)
    asked[:] = [rank] if differs else []
    if differs:
        fp = apply_stack_drill(fp, (("nccl", "2.28.9"),))
    before = grid.world.stats.snapshot()
    t0 = time.perf_counter()
    report = stack.check_stack(grid, cpu, fp)
    seconds = time.perf_counter() - t0
    after = grid.world.stats.snapshot()
    sent = {k: [c - before.get(k, (0, 0))[0], b - before.get(k, (0, 0))[1]] for k, (c, b) in after.items()}
    results.append({"world": world, "rank": rank, "differs": differs, "sent": sent, "seconds": seconds,
                    "lines": report.lines, "hard": report.hard})
    dist.destroy_process_group()
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def runs() -> dict:
    cases = [(world, rank, differs) for world in (64, 16384) for rank, differs in ((0, False), (37, False), (5, True))]
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {(r["world"], r["rank"]): r for r in json.loads(out.stdout.splitlines()[-1])}


def test_every_rank_but_0_pays_the_same_at_64_and_16384_ranks(runs):
    # A matching rank: its 40-byte record, the plan and the verdict; no fingerprint sent.
    assert runs[64, 37]["sent"] == runs[16384, 37]["sent"] == {"gather": [1, 40], "broadcast": [2, 272]}
    # A differing rank adds one send of its fingerprint, the same few bytes at either size.
    differing = runs[64, 5]["sent"]
    assert differing == runs[16384, 5]["sent"]
    assert differing["gather"] == [1, 40] and differing["broadcast"] == [2, 272]
    calls, sent = differing["send_bytes"]
    assert calls == 1 and 0 < sent < 8192, differing


def test_only_rank_0s_gather_grows_one_record_per_rank(runs):
    small, large = runs[64, 0]["sent"], runs[16384, 0]["sent"]
    assert {k: v[0] for k, v in small.items()} == {k: v[0] for k, v in large.items()} == {"gather": 1, "broadcast": 2}
    assert small["broadcast"] == large["broadcast"] == [2, 272]
    assert small["gather"][1] == 40 * 64 and large["gather"][1] == 40 * 16384  # linear, no constant
    assert runs[16384, 0]["lines"] == [] and not runs[16384, 0]["hard"]
    assert runs[16384, 0]["seconds"] < 5.0  # a bound against O(world^2) work on rank 0, not a speed test
