"""The link probe's control plane at scale, simulated in one process with torch's fake process
group (tests/distributed/test_scale.py has the pattern): the fixed-size record each rank sends
rank 0, the broadcast of the slow groups and the hop records cost every rank the same bytes and
calls at 64 and 16,384 ranks; rank 0 receives one record per rank. The timed exchanges run too
(collectives return at once there): their calls and bytes per rank do not grow with the world."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import contextlib, json, sys
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from threefold.distributed import comm
from threefold.distributed.grid import Grid, RankLayout
from threefold.preflight import link_probe

# Count the probe's traffic (it keeps it out of the groups' stats, as training does not own it).
link_probe._unrecorded = lambda groups: contextlib.nullcontext()
real_gather, real_broadcast = comm.gather_dim0, comm.broadcast
results = []
for tp, pp, dp, rank, slow in json.loads(sys.argv[1]):
    dist.init_process_group("fake", rank=rank, world_size=tp * pp * dp, store=FakeStore())
    grid = Grid.build(RankLayout(tp=tp, pp=pp, dp=dp))

    def gather(x, group):  # fake receives hold whatever memory held: rank 0 analyses zeros
        out = real_gather(x, group)
        return None if out is None else out.zero_()

    def broadcast(x, group, src=0):  # `slow`: rank 0 suspects a pp pair and this rank's dp group
        out = real_broadcast(x, group, src)
        if slow and x.dim() == 2:  # the plan, not the verdict
            out[0, 0], out[0, 1], out[1, 0], out[1, 1] = 2, 1, link_probe.DIMS.index("dp"), grid.dp.ranks[0]
        return out

    link_probe.comm.gather_dim0, link_probe.comm.broadcast = gather, broadcast
    link_probe.probe_links(grid, torch.device("cpu"), reps=1)
    groups = {id(g): g for n, g in grid.groups.items() if n != "world"}.values()
    data = [sum(g.stats.total_calls for g in groups), sum(g.stats.total_bytes for g in groups)]
    results.append({"world": tp * pp * dp, "rank": rank, "slow": slow,
                    "control": grid.world.stats.snapshot(), "data": data})
    dist.destroy_process_group()
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def runs() -> dict:
    # Ranks 37 of tp2 pp4 dp8 and 9999 of tp8 pp16 dp128 are both on a middle pipeline stage.
    cases = [(2, 4, 8, 37, False), (8, 16, 128, 9999, False), (2, 4, 8, 37, True), (8, 16, 128, 9999, True)]
    cases += [(2, 4, 8, 0, False), (8, 16, 128, 0, False)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(cases)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {(r["world"], r["rank"], r["slow"]): r for r in json.loads(out.stdout.splitlines()[-1])}


def test_control_plane_per_rank_is_flat_in_the_world_size(runs):
    for slow in (False, True):
        small, large = runs[64, 37, slow], runs[16384, 9999, slow]
        assert small["control"] == large["control"], (small, large)
        assert small["data"] == large["data"], (small, large)  # the timed exchanges: fixed sizes, fixed count
    # One record to rank 0 and the broadcast of the suspects; suspects add the second measurement's
    # record (pp and one hop per dimension) and the verdict.
    assert runs[64, 37, False]["control"] == {"gather": [1, 128], "broadcast": [1, 144]}
    assert runs[64, 37, True]["control"] == {"gather": [2, 128 + 48], "broadcast": [2, 144 + 8]}
    assert runs[64, 37, True]["data"] > runs[64, 37, False]["data"]  # the re-measurement ran


def test_rank_0_receives_one_record_per_rank(runs):
    small, large = runs[64, 0, False]["control"]["gather"], runs[16384, 0, False]["control"]["gather"]
    assert small == [1, 64 * 128] and large == [1, 16384 * 128], (small, large)
