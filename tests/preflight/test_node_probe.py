"""The node probe (threefold/preflight/node_probe.py): a slowdevice drill on one rank of 4 is
named, and only that rank; clean runs name nothing; the comparison itself, by kind and against a
datasheet peak; the one-thread phase on CPU."""

from __future__ import annotations

import math
import os

import torch

from threefold.distributed.drills import parse
from threefold.distributed.grid import Grid
from threefold.preflight.node_probe import FIGURES, MAX_LINES, RECORD, compare, probe_node

CLEAN_RUNS = 10
SLOW_RUNS = 3
# The smallest slowdown named in every run on the 2-core host was 1.4 (30 of 30 at 4 ranks, 10 of
# 10 at 8; the margin 0.25 names ratios under 0.75, i.e. factors over 1.33, and 1.33 was named in
# 1 of 10); 1.5 was missed once in CI, whose host is noisier: the test injects 2x.
SLOW = "slowdevice:rank=3:factor=2"


def _probe_worker(spec: str) -> list[tuple[bool, list[str], dict]]:
    from threefold.distributed.grid import RankLayout
    from threefold.distributed.runtime import init_distributed, shutdown_distributed

    init_distributed(torch.device("cpu"), timeout_s=60)
    # Two ranks a node, so the line names the node as well as the rank.
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    rank = int(os.environ["RANK"])
    grid = Grid.build(RankLayout(dp=4))
    fault = parse(spec)[0]
    factor = fault.factor if fault.rank == rank else 1.0
    runs = []
    for slow_factor in [1.0] * CLEAN_RUNS + [factor] * SLOW_RUNS:
        report = probe_node(grid, torch.device("cpu"), torch.float32, slow_factor=slow_factor)
        runs.append((report.named, report.lines, report.record))
    shutdown_distributed()
    return runs


def test_slowdevice_is_named_and_clean_runs_name_nothing():
    from harness import run_ranks

    per_rank = run_ranks(_probe_worker, 4, SLOW, timeout=60)
    clean = [runs[:CLEAN_RUNS] for runs in per_rank]
    slow = [runs[CLEAN_RUNS:] for runs in per_rank]
    # A clean run names nothing unless something outside the test held one rank back through both
    # passes: CI on the 2-core host once read rank 3 at 0.65x of the median in GEMM and copy alike,
    # in both passes of one clean run (a correct verdict on that rank's host, not the probe's doing).
    # One such run in CLEAN_RUNS is the host; more is the probe.
    false_positives = [lines for named, lines, _ in clean[0] if lines]
    assert len(false_positives) <= 1 and all(len(lines) == 1 for lines in false_positives), false_positives
    assert sum(named for named, _, _ in clean[0]) == len(false_positives)
    assert all([named for named, _, _ in runs] == [named for named, _, _ in clean[0]] for runs in clean)
    for _, lines, record in slow[0]:
        # Named by the first pass, then confirmed by a second one.
        assert record["named"] == [3] and record["passes"] == 2 and 3 in record["first_pass_named"], lines
        assert len(lines) == 1 and lines[0].startswith("threefold: node: rank 3 (node 1) GEMM "), lines
        assert " GFLOP/s vs median " in lines[0] and " of 4 ranks (cpu); memory " in lines[0], lines
    assert all(named for runs in slow for named, _, _ in runs)


def _row(rank: int, gemm: float, copy: float, node: int = 0, kind: int = 1, device_type: int = 0, peak=math.nan):
    values = {f: math.nan for f in FIGURES} | {"gemm_flops": gemm, "copy_bytes_per_s": copy}
    values |= {"kind": kind, "device_type": device_type, "node": node, "peak_flops": peak, "threads": 1}
    assert set(values) == set(RECORD)
    return values


def test_compare_names_a_rank_below_its_kinds_median_only():
    # Ranks 0-3 on node 0, 4-7 on node 1; rank 6's memory is 40% below the median, rank 1's GEMM
    # 20% below (within the margin). Ranks 8-9 are a slower kind: compared with each other only.
    rows = [_row(r, 100e9, 20e9, node=r // 4) for r in range(8)]
    rows[6] = _row(6, 100e9, 12e9, node=1)
    rows[1] = _row(1, 80e9, 20e9)
    rows += [_row(r, 10e9, 5e9, node=2, kind=2) for r in (8, 9)]
    named, lines, kinds = compare(rows, margin=0.25)
    assert named == [6]
    assert lines == [
        "threefold: node: rank 6 (node 1) GEMM 100.0 GFLOP/s vs median 100.0 of 8 ranks (cpu kind 1); "
        "memory 12.0 GB/s vs median 20.0"
    ]
    assert kinds["cpu kind 2"]["ranks"] == "ranks 8-9 (node 2)" and kinds["cpu kind 1"]["peak_flops"] is None
    # A confirming pass names only the first pass's suspects.
    assert compare(rows, margin=0.25, suspects={1, 6})[0] == [6]
    assert compare(rows, margin=0.25, suspects={1, 2}) == ([], [], kinds)


def test_compare_names_a_cuda_kind_under_its_datasheet_peak_and_caps_the_lines():
    peak = 989e12
    rows = [_row(r, 150e12, 3000e9, node=r // 8, device_type=1, peak=peak) for r in range(16)]
    named, lines, kinds = compare(rows, margin=0.25)
    assert named == list(range(16))
    assert lines == [
        "threefold: node: ranks 0-15 (nodes 0-1) GEMM median 150.0 TFLOP/s of 16 ranks (cuda) is 15% of the "
        "datasheet peak 989.0 TFLOP/s (under 25%)"
    ]
    assert math.isclose(kinds["cuda"]["peak_fraction"], 150 / 989)
    many = [_row(r, 700e12 if r < 40 else 300e12, 3000e9, device_type=1, peak=peak) for r in range(60)]
    named, lines, _ = compare(many, margin=0.25)
    assert named == list(range(40, 60)) and len(lines) == MAX_LINES + 1
    assert lines[-1] == "threefold: node: and ranks 56-59 (node 0) below their kind's median by more than 25%"


def test_one_thread_phase_runs_and_restores_the_thread_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        report = probe_node(Grid.alone(), torch.device("cpu"), torch.float32)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    (only,) = report.record["ranks"]
    assert not report.named and report.lines == []
    assert only["threads"] == 2 and all(only[f] > 0 for f in FIGURES), only
    assert report.record["kinds"]["cpu"]["peak_flops"] is None
