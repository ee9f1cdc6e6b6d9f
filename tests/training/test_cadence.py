"""checkpoint.interval auto (training/cadence.py): Young's interval from the run's measured save
stall and its own failures, re-chosen as they come; fixed intervals as before."""

from __future__ import annotations

import math

from threefold.config import build_config
from threefold.distributed import comm
from threefold.observe.goodput import Goodput
from threefold.training.cadence import Cadence

STEP_S, STALL_S, PRIOR_H = 0.1, 0.5, 1.0


class _Grid:
    world = comm.Group("world", [0], None)  # one rank: the broadcast is a no-op


def _cadence(tmp_path, **keys):
    pairs = [("checkpoint.dir", str(tmp_path / "ckpt")), ("train.steps", "100000"), ("log.dir", str(tmp_path))]
    pairs += [(f"checkpoint.{k}", str(v)) for k, v in keys.items()]
    cfg = build_config(None, pairs)
    book = Goodput(tmp_path, enabled=True, continuing=False)
    lines = []
    return Cadence(cfg, _Grid(), book, lines.append, 0, memory=False), book, lines


class _Run:
    """Steps of STEP_S s and a storage save stalling STALL_S every interval; a failure ends the
    attempt, and the next one resumes one step back, as goodput sees it in metrics.jsonl."""

    def __init__(self, tmp_path, cadence, book, start: float):
        self.dir, self.cadence, self.book = tmp_path, cadence, book
        self.now, self.step, self.segment, self.attempts = start, 0, 0, 0

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.now += STEP_S
            rec = {"step": self.step + 1, "time": self.now, "step_time_s": STEP_S, "segment": str(self.segment)}
            if self.cadence.storage_due(self.step):
                self.cadence.saved("storage", self.step, STALL_S)
                rec["ckpt_block_s"] = STALL_S
                self.now += STALL_S
            self.cadence.observe(rec)
            self.book.update(rec)
            self.step += 1

    def fail(self) -> None:
        self.now += 2.0  # restart: the next record is the next attempt's (a new segment)
        self.segment += 1
        self.step -= 1


def _young_steps(mtbf_s: float) -> float:
    return math.sqrt(2 * STALL_S * mtbf_s) / STEP_S


def test_short_mtbf_from_injected_failures_moves_the_interval_toward_youngs(tmp_path):
    """A failure every 20 s: the estimate (prior + T) / (1 + n) falls toward 20 s, and the chosen
    storage interval with it, toward Young's interval for the observed MTBF, one line per change."""
    cadence, book, lines = _cadence(tmp_path, interval="auto", mtbf_h=PRIOR_H)
    run = _Run(tmp_path, cadence, book, book.started)
    chosen, distance = [], []
    for _ in range(60):
        run.steps(200)  # 20 s of steps and saves
        run.fail()
        cadence.rechoose(run.step)
        chosen.append(cadence.every["storage"])
        m = cadence.model["storage"]
        distance.append(abs(chosen[-1] - _young_steps(20.0)))
        assert (
            abs(m["mtbf_s"] - (PRIOR_H * 3600 + book.summary(book.prev["time"])["wall_s"]) / (1 + m["failures"])) < 1e-6
        )
    assert chosen[0] > 3 * chosen[-1]  # from the prior's long interval ...
    assert distance[-1] < 0.35 * distance[0]  # ... toward Young's for a 20 s MTBF
    assert all(b <= a for a, b in zip(chosen, chosen[1:]))  # only ever shorter
    assert lines and all(line.startswith("threefold: checkpoint.interval auto: every ") for line in lines)
    assert len(lines) == len({10, *chosen}) - 1  # one line per change (log.interval's 10 at first)
    assert book.summary()["checkpoint_model"]["intervals"]["storage"] == chosen[-1]
    assert 0 < book.summary()["checkpoint_model"]["predicted_goodput"] < 1


def test_long_mtbf_moves_the_interval_away(tmp_path):
    """No failure: the estimate grows with the run, and the interval with it."""
    cadence, book, _ = _cadence(tmp_path, interval="auto", mtbf_h=0.01)
    run = _Run(tmp_path, cadence, book, book.started)
    chosen = []
    for _ in range(30):
        run.steps(200)
        cadence.rechoose(run.step)
        chosen.append(cadence.every["storage"])
    assert chosen[-1] > 2 * chosen[0] and all(b >= a for a, b in zip(chosen, chosen[1:]))
    m = cadence.model["storage"]
    assert abs(chosen[-1] - _young_steps(m["mtbf_s"])) <= 0.25 * chosen[-1] + 1


def test_fixed_intervals_save_every_n_steps(tmp_path):
    cadence, _, _ = _cadence(tmp_path, interval=4)
    assert [s for s in range(12) if cadence.storage_due(s)] == [3, 7, 11]
    assert not cadence.any_auto and cadence.next_storage_save(4) == 7


def test_auto_is_a_word_the_interval_keys_take_and_others_are_one_line():
    import pytest

    from threefold.errors import ConfigError
    from threefold.validate import validate

    cfg = build_config(None, [("checkpoint.interval", "auto"), ("checkpoint.memory_interval", "auto")])
    assert (cfg.checkpoint.interval, cfg.checkpoint.memory_interval) == ("auto", "auto")
    validate(cfg, 1)
    with pytest.raises(ConfigError, match=r"checkpoint.interval: 'often' is not a valid int \(valid: a number or auto"):
        build_config(None, [("checkpoint.interval", "often")])
    with pytest.raises(ConfigError, match="checkpoint.memory_interval: must be >= 0 or auto"):
        validate(build_config(None, [("checkpoint.memory_interval", "-1")]), 1)
    with pytest.raises(ConfigError, match="checkpoint.replicas"):
        build_config(None, [("checkpoint.replicas", "2")])
