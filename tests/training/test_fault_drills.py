"""Drills that fire once per run (faults.jsonl remembers them across attempts), and a full disk:
a failed storage save is one line and training goes on (training/faults.py, resilience.py)."""

from __future__ import annotations

import errno
import json

import threefold.training.faults as faults_module
from threefold.checkpoint import list_checkpoints
from threefold.training.faults import FaultInjector, parse

from harness import CALM_LR, run_training


def test_a_fault_fires_once_per_elastic_run_whatever_the_attempt(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-a")
    faults = parse("nan:step=3,enospc:rank=0:step=5")
    first = FaultInjector(faults, 0, restart_count=0, run=str(tmp_path))
    first.step_begins(3)
    assert first._poison and first.save_error(5).errno == errno.ENOSPC
    records = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"], r["run"]) for r in records] == [("nan", 3, "run-a"), ("enospc", 5, "run-a")]
    # The agent's next attempt (another process: nothing remembered in memory) replays steps 3
    # and 5: nothing fires again ...
    monkeypatch.setattr(faults_module, "_FIRED", set())
    again = FaultInjector(faults, 0, restart_count=1, run=str(tmp_path))
    again.step_begins(3)
    assert not again._poison and again.save_error(5) is None
    # ... while a fault the first attempt never reached (step 9) still fires in a later one.
    later = FaultInjector(parse("nan:step=9"), 0, restart_count=2, run=str(tmp_path))
    later.step_begins(9)
    assert later._poison
    # Another elastic run in the same log directory fires its own.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-b")
    other = FaultInjector(faults, 0, restart_count=0, run=str(tmp_path))
    other.step_begins(3)
    assert other._poison


def test_a_full_disk_at_one_save_costs_that_checkpoint_not_the_run(tmp_path, cache_dir, capsys):
    """The save after step 4 fails with ENOSPC on the writing rank: every rank gets the same one
    line, the run trains on, and the next saves are complete (4 is missing, 2 and 6 are there)."""
    ckpt = tmp_path / "ckpt"
    rows = run_training(
        {
            "train.steps": 6,
            "train.lr": CALM_LR,
            "checkpoint.dir": ckpt,
            "checkpoint.interval": 2,
            "checkpoint.keep": 0,
            "train.faults": "enospc:rank=0:step=3",
        },
        tmp_path / "log",
        cache_dir,
    )
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if "not saved" in line]
    assert len(lines) == 1 and "No space left on device" in lines[0] and "training goes on" in lines[0], lines
    assert [d.name for d in list_checkpoints(ckpt)] == ["step_00000006", "step_00000002"]


def test_a_save_fault_with_a_window_acts_on_its_first_save_only(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-w")
    faults = parse("enospc:rank=0:step=4:count=50")
    first = FaultInjector(faults, 0, restart_count=0, run=str(tmp_path))
    assert first.save_error(3) is None and first.save_error(9) is not None and first.save_error(19) is None
    monkeypatch.setattr(faults_module, "_FIRED", set())  # a later attempt's process
    assert FaultInjector(faults, 0, restart_count=1, run=str(tmp_path)).save_error(29) is None  # nor later


def test_a_resume_after_a_skipped_step_continues_bit_for_bit(tmp_path, cache_dir):
    """A NaN step is skipped (AdamW's step count does not move); the checkpoint of step 4
    records the updates applied (3), so a run resumed from it continues with the same bias
    correction as the uninterrupted one, bit for bit."""
    base = {"train.steps": 8, "train.lr": CALM_LR, "checkpoint.interval": 4, "train.faults": "nan:step=1"}
    straight = run_training({**base, "checkpoint.dir": tmp_path / "ckpt"}, tmp_path / "a", cache_dir)
    assert [r["step_skipped"] for r in straight[:3]] == [False, True, False]
    resumed = run_training(
        {**base, "train.faults": "", "checkpoint.resume": tmp_path / "ckpt" / "step_00000004"},
        tmp_path / "b",
        cache_dir,
    )
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[4:]]
