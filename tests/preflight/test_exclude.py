"""train.preflight_exclude (threefold/preflight/run.py, training/worker.py): the node the node probe
names is left out at start by the lost-node path, and the job goes on smaller on the rest."""

from __future__ import annotations

import json
import os

import pytest

from threefold.config import build_config
from threefold.errors import ConfigError
from threefold.preflight.node_probe import NodeReport
from threefold.preflight.run import node_to_exclude

from harness import run_agents

SLOW_LINE = "threefold: node: rank 1 (node 1) GEMM 1.0 GFLOP/s vs median 2.0 of 2 ranks (cpu)"


def _report(named: list[int], nodes: list[int]) -> NodeReport:
    ranks = [{"rank": rank, "node": node} for rank, node in enumerate(nodes)]
    lines = [SLOW_LINE] if named else []
    return NodeReport(bool(named), lines, {"named": named, "ranks": ranks})


def test_rank_0_excludes_one_named_node_once_and_only_with_room_to_shrink():
    one_slow = _report([2, 3], [0, 0, 1, 1])
    node, line = node_to_exclude(one_slow, rank=0, first_attempt=True, can_shrink=True)
    assert node == 1 and "excluding node 1, named by the node probe" in line and "of ranks 2-3 (node 1)" in line, line
    assert "GEMM 1.0 GFLOP/s" in line, line  # why: the node probe's finding
    # Other ranks only learn the node from rank 0's broadcast.
    assert node_to_exclude(one_slow, rank=1, first_attempt=True, can_shrink=True) == (-1, "")
    # The restarted, smaller world never excludes again: no loop.
    node, line = node_to_exclude(one_slow, rank=0, first_attempt=False, can_shrink=True)
    assert node == -1 and "after a restart" in line
    node, line = node_to_exclude(one_slow, rank=0, first_attempt=True, can_shrink=False)
    assert node == -1 and "--nnodes MIN:MAX" in line
    # Named ranks on two nodes (or a whole kind under its peak) are not one bad machine.
    node, line = node_to_exclude(_report([1, 3], [0, 0, 1, 1]), rank=0, first_attempt=True, can_shrink=True)
    assert node == -1 and "[0, 1]" in line
    assert node_to_exclude(_report([], [0, 1]), rank=0, first_attempt=True, can_shrink=True) == (-1, "")


def test_preflight_exclude_needs_the_probes():
    from threefold.validate import validate

    with pytest.raises(ConfigError, match="train.preflight_exclude: needs the node probe"):
        validate(build_config(None, [("train.preflight", "off"), ("train.preflight_exclude", "true")]))
    validate(build_config(None, [("train.preflight", "auto"), ("train.preflight_exclude", "true")]))


def test_a_slow_node_is_excluded_at_start_and_the_rest_trains_with_a_smaller_dp(tmp_path, data, cache_dir):
    """Two one-process "nodes" under torchrun --nnodes 1:2 (rendezvous store hosted here, as in
    the lost-node test of tests/training/test_faults.py); node 1's rank runs the slowdevice drill
    at 3x. The node probe names it, rank 0 tells every rank, node 1 ends whole (agent and worker),
    and node 0's agent re-forms the job alone: dp 0 resolves to 1 and the run finishes."""
    env = {
        **os.environ,
        "THREEFOLD_FAULT": "slowdevice:rank=1:factor=3",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
    }
    log = tmp_path / "run"
    train = ["-m", "threefold", "train", "--parallel.dp", "0", "--train.steps", "2", "--train.global_batch", "4"]
    train += ["--train.micro_batch", "1", "--train.preflight", "on", "--train.preflight_exclude", "true"]
    train += ["--data.path", data, "--data.vocab", "256", "--data.cache_dir", cache_dir, "--log.dir", str(log)]
    train += ["--log.quiet", "true"]
    # last_call_timeout: how long the first round waits for the second node, and the re-formed
    # round for a node that will not come back.
    codes, outs = run_agents([env, env], train, "1:2", "is_host=false,last_call_timeout=8", ["--max-restarts", "1"])
    said = outs[0] + outs[1]
    assert sorted(codes) == [-9, 0], outs[0][-3000:] + outs[1][-3000:]
    excluded = [line for line in said.splitlines() if line.startswith("threefold: preflight: excluding")]
    assert len(excluded) == 1, said[-3000:]
    assert "excluding node 1" in excluded[0] and "rank 1 (node 1)" in excluded[0] and "GEMM" in excluded[0]
    assert json.loads((log / "run.json").read_text())["layout"]["dp"] == 1
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # The restarted world probed again (it writes preflight.json anew) and excluded nothing more.
    assert json.loads((log / "preflight.json").read_text())["node"]["named"] == []
