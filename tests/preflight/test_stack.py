"""The stack fingerprint and its comparison across ranks (threefold/preflight/fingerprint.py,
stack.py): one 4-process gloo group runs every multi-rank case, the rest is plain functions."""

from __future__ import annotations

import json
import os
import types

import pytest
import torch

from threefold.preflight import fingerprint as fingerprint_mod
from threefold.preflight.fingerprint import apply_stack_drill, digest, fingerprint, kind_of, mapped_library
from threefold.preflight.stack import MAX_STACKS, Census, condition_holds, describe_change, known_bad

CPU = torch.device("cpu")


def _cases() -> dict:
    """Each case a check_stack over the same 4 ranks: what every rank returns."""
    from threefold.distributed.grid import Grid, RankLayout
    from threefold.distributed.runtime import init_distributed, shutdown_distributed
    from threefold.preflight.stack import check_stack

    os.environ.pop("NCCL_DEBUG", None)
    init_distributed(CPU, timeout_s=60)
    grid = Grid.build(RankLayout(dp=4), device=CPU)
    rank = grid.global_rank
    out = {}

    def check(name, fp):
        before = grid.world.stats.snapshot()
        report = check_stack(grid, CPU, fp)
        json.dumps(report.record)  # preflight.json takes it as it is
        after = grid.world.stats.snapshot()
        sent = {k: (c - before.get(k, (0, 0))[0], b - before.get(k, (0, 0))[1]) for k, (c, b) in after.items()}
        out[name] = {"hard": report.hard, "soft": report.soft, "lines": report.lines, "record": report.record}
        out[name]["sent"] = sent

    check("clean", fingerprint(CPU))
    drilled = (("nccl", "2.28.9"),)
    check("drill", apply_stack_drill(fingerprint(CPU), drilled if rank == 1 else ()))
    if rank == 2:
        os.environ["NCCL_DEBUG"] = "INFO"
    check("env", fingerprint(CPU))
    os.environ.pop("NCCL_DEBUG", None)
    check("known bad", apply_stack_drill(fingerprint(CPU), (("nccl", "2.25.1"),)))
    shutdown_distributed()
    return out


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    from harness import run_ranks

    return run_ranks(_cases, 4, timeout=90)


def test_a_clean_group_names_nothing(cases):
    # The ranks differ in pid and device only: per-host keys, left out of the digests.
    assert all(not r["clean"]["hard"] and not r["clean"]["soft"] for r in cases)
    assert cases[0]["clean"]["lines"] == [] and cases[0]["clean"]["record"]["differences"] == []
    assert cases[0]["clean"]["record"]["distinct"] == {"hard": 1, "soft": 1}
    # Nobody differs: no rank sends its fingerprint, every rank pays the same three collectives.
    assert all("send_bytes" not in r["clean"]["sent"] for r in cases)
    assert cases[1]["clean"]["sent"] == cases[3]["clean"]["sent"] == {"gather": (1, 40), "broadcast": (2, 272)}


def test_a_stack_drill_on_one_rank_is_hard_on_every_rank_and_named_in_one_line(cases):
    assert all(r["drill"]["hard"] for r in cases)
    assert cases[0]["drill"]["lines"] == ["threefold: stack: rank 1 (node 0) loads NCCL 2.28.9 while 3 ranks have none"]
    (difference,) = cases[0]["drill"]["record"]["differences"]
    assert difference == {
        "kind": "hard",
        "key": "nccl",
        "value": "2.28.9",
        "majority": None,
        "ranks": "1",
        "nodes": "0",
    }
    # Only the differing rank sent its fingerprint.
    assert [("send_bytes" in r["drill"]["sent"]) for r in cases] == [False, True, False, False]


def test_an_environment_difference_is_soft_only(cases):
    assert all(r["env"]["soft"] and not r["env"]["hard"] for r in cases)
    assert cases[0]["env"]["lines"] == [
        "threefold: stack: rank 2 (node 0) sets NCCL_DEBUG=INFO while 3 ranks leave it unset"
    ]


def test_a_known_bad_stack_on_every_rank_is_named_once(cases):
    # Every rank alike: no difference, one known-bad line for all of them (a soft entry).
    assert all(r["known bad"]["soft"] and not r["known bad"]["hard"] for r in cases)
    (line,) = cases[0]["known bad"]["lines"]
    assert line.startswith("threefold: stack: ranks 0-3 (node 0) match known-bad nccl-2.25.1-abort-hang (nccl 2.25.1")
    assert "source: https://github.com/pytorch/pytorch/issues/149153" in line
    assert cases[0]["known bad"]["record"]["known_bad"][0]["ranks"] == "0-3"


def test_one_process_alone_is_checked_against_the_known_bad_table():
    from threefold.distributed.grid import Grid
    from threefold.preflight.stack import check_stack

    report = check_stack(Grid.alone(), CPU, apply_stack_drill(fingerprint(CPU), (("nccl", "2.29.2"),)))
    assert report.soft and not report.hard and report.fingerprint["nccl"] == "2.29.2"
    (line,) = report.lines
    assert line.startswith("threefold: stack: rank 0 (node 0) match known-bad nccl-2.29.2-hang (nccl 2.29.2, soft)")
    assert report.record["majority"]["nccl"] == "2.29.2" and "pid" not in report.record["majority"]


def _judged(fps: list[dict], nodes: list[int]):
    """Rank 0's verdict on these fingerprints, one per rank, as check_stack reaches it."""
    rows = [[*digest(fp, "hard"), *digest(fp, "soft"), node] for fp, node in zip(fps, nodes)]
    census = Census(rows, list(range(len(fps))))
    return census.judge({i: fps[i] for i in [0, *census.wanted()]}, known_bad())


def test_one_node_loading_another_nccl_is_one_line_naming_the_node_and_library():
    # marin #7344: the metadata said 2.30.7, one node's ranks loaded 2.28.9 from elsewhere.
    good = {"torch": "2.11.0", "nccl": "2.30.7", "nccl_path": "/venv/nvidia/nccl/lib/libnccl.so.2"}
    good["nccl_sha256"] = "a" * 64
    bad = {**good, "nccl": "2.28.9", "nccl_path": "/usr/lib/x/libnccl.so.2", "nccl_sha256": "b" * 64}
    fps = [dict(bad if 8 <= r < 16 else good, pid=str(r)) for r in range(64)]
    found = _judged(fps, [r // 8 for r in range(64)])
    assert found.hard and found.soft  # the path is a soft key: its line is implied by the version's
    assert found.lines == [
        "threefold: stack: ranks 8-15 (node 1) load NCCL 2.28.9 from /usr/lib/x/libnccl.so.2 while 56 ranks load 2.30.7"
    ]
    assert {d["key"] for d in found.record["differences"]} == {"nccl", "nccl_sha256", "nccl_path"}


def test_more_distinct_stacks_than_rank_0_fetches_are_counted_in_one_line():
    fps = [{"torch": f"2.{r}.0"} for r in range(MAX_STACKS + 4)] + [{"torch": "2.0.0"}] * 20
    found = _judged(fps, [0] * len(fps))
    assert found.hard and len(found.lines) == MAX_STACKS  # 15 versions named, and the rest counted
    assert found.lines[0].startswith("threefold: stack: rank 1 (node 0) runs torch 2.1.0 while 21 ranks run 2.0.0")
    assert found.lines[-1].startswith("threefold: stack: ranks 16-19 (node 0) hold 4 more hard stacks")


def test_describe_change_names_each_changed_key_and_ignores_per_host_ones():
    old = {"torch": "2.5.1", "nccl": "2.21.5", "host": "a", "pid": "1", "OMP_NUM_THREADS": "8"}
    new = {"torch": "2.6.0", "nccl": "2.21.5", "host": "b", "pid": "2", "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "8"}
    assert describe_change(old, new) == "the stack changed: hard: torch 2.5.1 -> 2.6.0; soft: NCCL_DEBUG unset -> INFO"
    assert describe_change(old, {**old, "host": "c", "pid": "9"}) is None
    assert describe_change(old, dict(old)) is None


def test_the_known_bad_table_matches_by_version_range_and_value():
    entries = {e.id: e for e in known_bad()}
    assert entries and all(e.severity in ("hard", "soft") and e.source.startswith("https://") for e in entries.values())

    def matched(fp):
        return sorted(e.id for e in entries.values() if e.matches(fp))

    assert matched({"nccl": "2.25.1"}) == ["nccl-2.25.1-abort-hang"]
    assert matched({"nccl": "2.16.5", "CUDA_LAUNCH_BLOCKING": "1"}) == ["nccl-hang-with-cuda-launch-blocking"]
    assert matched({"nccl": "2.16.5"}) == [] and matched({"CUDA_LAUNCH_BLOCKING": "1"}) == []
    assert matched({"nccl": "2.17.1", "CUDA_LAUNCH_BLOCKING": "1"}) == ["nccl-2.17.1-abort-hang"]
    assert matched({"nccl": "2.12.10", "CUDA_LAUNCH_BLOCKING": "1"}) == []
    assert matched({"nccl": "2.26.2", "torch": "2.7.0"}) == []
    assert condition_holds(">=2.13,<2.17.1", "2.13.0-1") and not condition_holds(">=2.13,<2.17.1", "2.17.1")
    assert condition_holds("1", "1") and not condition_holds("1", "0") and not condition_holds("==2.1", "unknown")


def test_the_fingerprint_classifies_its_keys_and_digests_only_comparable_ones(monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setenv("UNRELATED_SETTING", "x")
    fp = fingerprint(CPU)
    assert fp["torch"] == torch.__version__ and len(fp["threefold_source"]) == 64
    assert fp["NCCL_ALGO"] == "Ring" and "UNRELATED_SETTING" not in fp
    assert [kind_of(k) for k in ("torch", "nccl", "threefold_source", "NCCL_ALGO", "pid", "CUDA_VISIBLE_DEVICES")] == [
        "hard",
        "hard",
        "hard",
        "soft",
        "host",
        "host",
    ]
    assert digest(fp, "hard") == digest({**fp, "pid": "0", "host": "elsewhere"}, "hard")
    assert digest(fp, "hard") != digest({**fp, "torch": "0.0"}, "hard")
    assert digest(fp, "soft") != digest({**fp, "NCCL_ALGO": "Tree"}, "soft")


def test_nccl_is_found_by_the_library_mapped():
    maps = (
        "7f00-7f10 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n"
        "7f20-7f30 r-xp 00000000 08:01 13 /venv/nvidia/nccl/lib/libnccl.so.2\n"
        "7f40-7f50 rw-p 00000000 00:00 0 [heap]\n"
    )
    assert mapped_library(maps, ("libnccl", "librccl")) == "/venv/nvidia/nccl/lib/libnccl.so.2"
    assert mapped_library(maps, ("libcudart",)) is None
    assert fingerprint_mod.nccl_version_text((2, 21, 5)) == "2.21.5"
    assert fingerprint_mod.nccl_version_text(22105) == "2.21.5" and fingerprint_mod.nccl_version_text(2708) == "2.7.8"


def test_nvml_keys_read_what_nvml_supports():
    class NVMLError(Exception):
        pass

    def unsupported(*_):
        raise NVMLError

    fake = types.SimpleNamespace(
        NVMLError=NVMLError,
        NVML_CLOCK_SM=1,
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByPciBusId=lambda bus: bus,
        nvmlDeviceGetMaxClockInfo=lambda handle, clock: 1980,
        nvmlDeviceGetApplicationsClock=unsupported,
        nvmlDeviceGetEccMode=lambda handle: (1, 1),
        nvmlDeviceGetEnforcedPowerLimit=lambda handle: 700000,
    )
    keys = fingerprint_mod.nvml_keys(fake, "00000000:19:00.0")
    assert keys == {"gpu_sm_clock_max": "1980 MHz", "gpu_ecc": "on", "gpu_power_limit": "700 W"}
    assert all(kind_of(k) == "soft" for k in keys)
