"""Restarts from memory replicas (checkpoint.memory_interval): a killed rank whose node lost its RAM
comes back from its buddy's copy without opening the storage checkpoint, bit for bit; with the
buddy's node gone too the run reads storage; a replica set loads into another layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from threefold.checkpoint import open_checkpoint
from threefold.checkpoint.consolidate import consolidated
from threefold.distributed.host_memory import run_root

from harness import CALM_LR, PARITY, assert_parity, resolved_config, run_ranks, run_training

STEPS = 10
LAYOUT = {"parallel.dp": 2, "parallel.pp": 2, "parallel.devices_per_node": 2}
BASE = {**LAYOUT, "train.steps": STEPS, "train.seed": 0, "train.lr": CALM_LR, "checkpoint.interval": 4}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache_dir):
    """The uninterrupted run: its losses and final weights."""
    root = tmp_path_factory.mktemp("straight")
    rows = run_training({**BASE, "checkpoint.dir": root / "ckpt"}, root / "log", cache_dir)
    return rows, _weights(root / "ckpt")


def _weights(ckpt) -> dict[str, torch.Tensor]:
    directory, manifest = open_checkpoint(ckpt / f"step_{STEPS:08d}")
    return consolidated(directory, manifest, prefix="")


def _run(tmp_path, cache_dir, fault: str):
    from open_watch import watch_opens

    log, ckpt = tmp_path / "log", tmp_path / "ckpt"
    env = watch_opens(tmp_path, ckpt, {**os.environ, "THREEFOLD_FAULT": fault, "OMP_NUM_THREADS": "1"})
    args = [f"--{k}={v}" for k, v in BASE.items()]
    args += ["--checkpoint.memory_interval=1", "--train.max_restarts=1", f"--checkpoint.dir={ckpt}"]
    args += [f"--log.dir={log}", f"--data.cache_dir={cache_dir}", "--log.quiet=true"]
    out = subprocess.run(
        [sys.executable, "-m", "threefold", "train", *args], capture_output=True, text=True, timeout=240, env=env
    )
    console = out.stdout + out.stderr
    assert out.returncode == 0, console[-3000:]
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    restart = [line for line in console.splitlines() if line.startswith("threefold: restart 1")]
    assert len(restart) == 1, console[-3000:]
    return rows, restart[0], ckpt


def _storage_reads(tmp_path) -> list[str]:
    """Files of the storage checkpoint of step 4 (the newest when the rank died) that the
    restarted attempt opened for reading."""
    from open_watch import opened

    return [path for attempt, path in opened(tmp_path) if attempt == "1" and "step_00000004" in path]


def _same_after_restart(rows, straight_rows, weights, straight_weights):
    final = {r["step"]: r["loss"] for r in rows}  # the restarted attempt's lines win
    assert [final[s] for s in range(1, STEPS + 1)] == [r["loss"] for r in straight_rows]  # bitwise
    assert weights.keys() == straight_weights.keys()
    assert all(torch.equal(weights[k].view(torch.uint8), straight_weights[k].view(torch.uint8)) for k in weights)


def test_a_killed_rank_whose_node_lost_its_ram_restarts_from_its_buddy_not_from_storage(straight, tmp_path, cache_dir):
    """dp2 x pp2 on two nodes of two ranks: rank 1 dies at step 7 and its node's RAM is gone
    (ramloss): ranks 0 and 1 load their state from the copies kept on node 1, ranks 2 and 3
    from their own; no file of the storage checkpoint (step 4) is opened, and the run ends with
    the uninterrupted run's losses and weights, bit for bit."""
    rows, restart, ckpt = _run(tmp_path, cache_dir, "kill:rank=1:step=6,ramloss:rank=1:step=6")
    assert "from memory replicas" in restart, restart
    resumed = int(restart.rsplit("resumed at step ", 1)[1].split()[0])
    assert resumed > 4  # newer than the storage checkpoint: it cannot have come from there
    assert _storage_reads(tmp_path) == []
    _same_after_restart(rows, straight[0], _weights(ckpt), straight[1])
    good = json.loads((tmp_path / "log" / "goodput.json").read_text())
    assert [f["source"] for f in good["failures"]] == ["memory"]
    assert not run_root("", str(tmp_path / "log")).exists()  # nothing left in shared memory


def test_with_the_buddys_node_lost_too_the_restart_reads_storage(straight, tmp_path, cache_dir):
    """The same failure with node 1's RAM gone as well: no copy of ranks 0 and 1 is left, every
    rank reads the storage checkpoint of step 4 (the open count sees it), still bit for bit."""
    rows, restart, ckpt = _run(tmp_path, cache_dir, "kill:rank=1:step=6,ramloss:rank=1:step=6,ramloss:rank=3:step=6")
    assert restart.endswith("resumed at step 4 from step_00000004"), restart
    assert _storage_reads(tmp_path)  # the counter works, and storage was read
    _same_after_restart(rows, straight[0], _weights(ckpt), straight[1])


def test_replicas_of_one_layout_load_into_another(tmp_path, cache_dir, monkeypatch):
    """tp2 x pp2 snapshots every 3 steps and stops at step 7 without cleaning up (as a failed job
    does); a dp4 job of the same run restarts from those replicas through the resharding path and
    trains on with the losses of an uninterrupted dp4 run."""
    from failure_drills import train_then_stop

    log = tmp_path / "log"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "reshard")
    common = {"train.steps": STEPS, "train.seed": 0, "train.lr": CALM_LR, "parallel.devices_per_node": 2}
    common.update({"checkpoint.dir": "", "checkpoint.memory_interval": 3})
    first = resolved_config({**common, "parallel.tp": 2, "parallel.pp": 2}, log, cache_dir, 4)
    run_ranks(train_then_stop, 4, first, 7, timeout=180)
    assert run_root("reshard", str(log)).exists()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = resolved_config({**common, "parallel.dp": 4}, log, cache_dir, 4)
    from threefold.training.worker import run_worker

    run_ranks(run_worker, 4, second, timeout=180)
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in rows if r.get("attempt_start")][-1]
    assert resumed["attempt_start"]["source"] == "memory" and resumed["step"] == 7  # the snapshot of step 6
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    reference = run_training({**common, "parallel.dp": 4, "checkpoint.memory_interval": 0}, tmp_path / "ref", cache_dir)
    assert_parity("tp2 pp2 replicas -> dp4 vs uninterrupted dp4, loss", rows[-(STEPS - 6) :], reference[6:], PARITY)
