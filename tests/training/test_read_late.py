"""Scalars read one step late (the CUDA loop, forced on CPU here): a step's loss, norm and health
vector are read after the next step is queued, except on report, evaluation and save steps; the
run's records are those of the loop that reads every step at once, rollbacks included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from threefold.training.trainer import Trainer

from dp_checks import make_cfg, make_grid

# Fields that are the same values whichever loop produced them (the others are times).
SAME = ("step", "loss", "grad_norm", "lr", "tokens", "step_skipped", "steps_skipped", "nonfinite_steps", "lost_steps")


def _run(data: str, root: Path, lag: int, **extra) -> tuple[list[dict], list[tuple[str, int]]]:
    cfg = make_cfg(
        data,
        **{
            "train.steps": 12,
            "log.interval": 5,
            "log.dir": str(root / "log"),
            "checkpoint.dir": str(root / "ckpt"),
            "checkpoint.interval": 4,
            **extra,
        },
    )
    trainer = Trainer(cfg, make_grid(), torch.device("cpu"), log=lambda *args: None)
    trainer.read_lag = lag
    calls = []
    queue_step, read_step = trainer.queue_step, trainer.read_step

    def queue(step, *args, **kwargs):
        calls.append(("queue", step))
        return queue_step(step, *args, **kwargs)

    def read(q, *args, **kwargs):
        calls.append(("read", q.step))
        return read_step(q, *args, **kwargs)

    trainer.queue_step, trainer.read_step = queue, read
    trainer.train()
    rows = [json.loads(line) for line in (root / "log" / "metrics.jsonl").read_text().splitlines()]
    return rows, calls


def _same(rows: list[dict]) -> list[dict]:
    return [{k: r.get(k) for k in SAME} for r in rows]


def test_late_reads_come_after_the_next_step_is_queued_and_change_no_record(data, tmp_path):
    at_once, calls0 = _run(data, tmp_path / "at_once", 0)
    late, calls1 = _run(data, tmp_path / "late", 1)
    assert calls0 == [(kind, s) for s in range(12) for kind in ("queue", "read")]
    # Steps 0-based: saves after 4, 8 (and the last), reports after 5, 10 and the last step.
    at_once_steps = {3, 4, 7, 9, 11}
    order = []
    for s in range(12):
        order.append(("queue", s))
        if s - 1 >= 0 and s - 1 not in at_once_steps:
            order.append(("read", s - 1))
        if s in at_once_steps:
            order.append(("read", s))
    assert calls1 == order
    assert _same(late) == _same(at_once)
    assert [r["step"] for r in late] == list(range(1, 13))
    # A late step's time runs from the previous read: the times never overlap or leave a gap
    # larger than the loop's own bookkeeping.
    assert all(r["step_time_s"] > 0 for r in late)


def test_late_reads_roll_back_after_the_same_steps(data, tmp_path):
    nan = {"train.faults": "nan:step=5:count=2", "train.nan_rollback_after": 2}
    at_once, _ = _run(data, tmp_path / "at_once", 0, **nan)
    late, calls = _run(data, tmp_path / "late", 1, **nan)
    steps = [r["step"] for r in late]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8, 9, 10, 11, 12]
    assert _same(late) == _same(at_once)
    assert [r["step_skipped"] for r in late[5:7]] == [True, True]
    # The step queued before the rollback was found (index 7) is queued again after it.
    assert calls.count(("queue", 7)) == 2 and calls.count(("read", 7)) == 1


@pytest.mark.parametrize("lag", [0, 1])
def test_last_record_is_complete(data, tmp_path, lag):
    rows, calls = _run(data, tmp_path, lag, **{"train.steps": 3, "checkpoint.interval": 0, "log.interval": 10})
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert calls[-1] == ("read", 2)
