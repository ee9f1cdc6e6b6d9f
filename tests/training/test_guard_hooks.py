"""RunGuard's hook points as the training loop calls them (training/loop.py, resilience.py): as
each step begins, while a read step's record is made, once it is written, and once at the end;
read one step late, a step's record hooks come after the next step began. Without a fault drill
no step calls the fault injector."""

from __future__ import annotations

from pathlib import Path

import pytest

from threefold.training.faults import FaultInjector
from threefold.training.trainer import Trainer

from dp_checks import quiet_trainer

STEPS = 4
HOOKS = ("before_step", "after_step", "after_record", "close")


def _trainer(data: str, root: Path, **extra) -> Trainer:
    return quiet_trainer(data, root, STEPS, **extra)


def _hook_calls(trainer: Trainer) -> list[tuple]:
    """The guard's hook calls during trainer.train(): (hook, step), step None for close."""
    calls, guard = [], trainer.guard
    for name in HOOKS:
        hook = getattr(guard, name)

        def called(*args, _name=name, _hook=hook, **kwargs):
            calls.append((_name, args[0] if _name != "close" else None))
            return _hook(*args, **kwargs)

        setattr(guard, name, called)
    trainer.train()
    return calls


@pytest.mark.parametrize("lag", [0, 1])
def test_the_loop_calls_the_hook_points_in_order(data, tmp_path, lag):
    trainer = _trainer(data, tmp_path)
    trainer.read_lag = lag
    calls = _hook_calls(trainer)
    record = lambda s: [("after_step", s), ("after_record", s)]  # noqa: E731
    if lag == 0:
        expected = [c for s in range(STEPS) for c in [("before_step", s), *record(s)]]
    else:  # steps 0-2 are read once the next one began; the last (a report step) at once
        expected = [("before_step", 0)]
        for s in range(1, STEPS):
            expected += [("before_step", s), *record(s - 1)]
        expected += record(STEPS - 1)
    assert calls == [*expected, ("close", None)]


def test_no_step_calls_the_fault_injector_without_a_drill(data, tmp_path, monkeypatch):
    called = []
    monkeypatch.setattr(FaultInjector, "step_begins", lambda self, step, on_fault: called.append(("begins", step)))
    monkeypatch.setattr(FaultInjector, "slow", lambda self, step, compute_s: called.append(("slow", step)) or 0.0)
    _trainer(data, tmp_path / "plain").train()
    assert called == []
    _trainer(data, tmp_path / "drill", **{"train.faults": "slow:rank=0:factor=1"}).train()
    assert called == [(kind, s) for s in range(STEPS) for kind in ("begins", "slow")]
