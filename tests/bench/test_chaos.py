"""bench/chaos.py's plumbing without running a job: the seeded schedule, its drill specs, the
failure classes and the prediction (no timing is asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench")]

import chaos  # noqa: E402

from threefold.training.faults import parse  # noqa: E402


def test_the_schedule_is_the_seeds_own_and_its_faults_are_apart_and_parse():
    a, b = chaos.draw(30, 0, 300), chaos.draw(30, 0, 300)
    assert a == b and a != chaos.draw(30, 1, 300)
    steps = [f["step"] for f in a]
    assert steps == sorted(steps) and all(y - x >= chaos.GAP for x, y in zip(steps, steps[1:]))
    assert 15 <= steps[0] and steps[-1] < 300 - 15
    assert {f["class"] for f in a} == set(chaos.CLASSES)  # 30 draws meet every class at seed 0
    faults = parse(",".join(chaos.spec(f) for f in a))
    assert [f.kind for f in faults] == [f["class"] for f in a]
    with pytest.raises(SystemExit, match="do not fit"):
        chaos.draw(40, 0, 300)


def test_a_rollback_without_a_recorded_cause_is_the_nan_streak_before_it():
    faults = [{"class": "nan", "step": 40, "rank": 0, "count": 3}, {"class": "kill", "step": 60, "rank": 1}]
    assert chaos.classify({"after_step": 42}, faults) == "nan"
    assert chaos.classify({"after_step": 60, "cause": "kill"}, faults) == "kill"
    assert chaos.classify({"after_step": 90}, faults) == "other"


def test_the_prediction_is_the_product_of_the_tiers_daly_goodput():
    good = {"productive_s": 90.0, "lost_s": 4.0, "skipped_s": 0.0, "checkpoint_s": 6.0}
    records = [{"ckpt_block_s": 0.1 if i % 10 == 9 else 0.0, "snapshot_block_s": 0.01} for i in range(100)]
    failures = [{"source": "memory", "mttr_s": 5.0}, {"source": "storage", "mttr_s": 7.0}]
    p = chaos.predict(good, records, failures, 1.0)
    assert p["memory"]["mtbf_s"] == p["storage"]["mtbf_s"] == pytest.approx(100.0)
    assert p["storage"]["interval_s"] == pytest.approx(10.0) and p["memory"]["interval_s"] == pytest.approx(1.0)
    assert p["goodput"] == pytest.approx(p["memory"]["goodput"] * p["storage"]["goodput"])
    assert 0.8 < p["goodput"] < 1.0
