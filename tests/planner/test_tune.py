"""`threefold tune`: the space, the loop's choices on a known landscape, failures that teach,
the cache, and the outputs; one real trial through `threefold train` at the end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from threefold.api import configure
from threefold.errors import UserError
from threefold.planner.tune import Space, TuneOptions, Tuner
from threefold.planner.tune import cache as tune_cache
from threefold.planner.tune.output import format_summary, write_outputs
from threefold.planner.tune.space import trial_config
from threefold.planner.tune.trials import TrialResult, classify_failure

SPACE = ["microbatches=2,4,8", "schedule=1f1b,interleaved", "zero=0,1"]


def _cfg(preset: str = "tiny"):
    return configure(None, ["--model.preset", preset, "--train.global_batch", "32"])


def test_space_collapses_knobs_that_cannot_matter_and_refuses_in_one_line():
    space = Space.parse(_cfg(), 4, SPACE)
    assert space.nominal == 6 * 3 * 2 * 2  # six (dp, tp, pp) triples of 4
    names = [c.name for c in space.candidates]
    assert len(names) == len(set(names)) == 35
    # No schedule at pp 1, no ZeRO at dp 1: one candidate each, not four.
    assert sum(n.startswith("dp1tp4pp1-") for n in names) == 3
    assert "dp4tp1pp1-m2-z1" in names and "dp2tp1pp2-m4-int2-z0" in names
    reasons = dict(space.refused)
    assert "cannot fill 4 pipeline stages" in reasons["dp1tp1pp4-m2-1f1b"]
    assert all("\n" not in why for why in reasons.values())
    with pytest.raises(UserError, match="unknown key 'micro'"):
        Space.parse(_cfg(), 4, ["micro=2"])
    with pytest.raises(UserError, match="schedule=zigzag is not valid"):
        Space.parse(_cfg(), 4, ["schedule=zigzag"])


CLUSTER = [("peak_tflops", 0.02), ("host_cores", 2)]  # fixed, so the landscape is the same on every host


def _prior(cand) -> float:
    from threefold.planner.model import model_shape
    from threefold.planner.predict import predict
    from threefold.planner.tune.loop import _cluster

    cfg = _cfg()
    return predict(model_shape(cfg.model), _cluster(CLUSTER, 4, True, cfg), cand.layout, 32, "fp32").tokens_per_s


def _memory(cand) -> float:
    from threefold.planner.memory import device_memory
    from threefold.planner.model import model_shape

    return device_memory(model_shape(_cfg().model), cand.layout, 32, "fp32").total


def _truth(cand) -> float:
    """A landscape the planner does not know: 4 pipeline stages run 40% faster than it thinks
    and every doubling of the micro-batches costs 10%, so its favourite is not the best."""
    return _prior(cand) * (1.4 if cand.layout.pp == 4 else 1.0) * 0.9 ** math.log2(cand.microbatches)


class FakeRunner:
    """Writes the run directory a trial would (run.json, metrics.jsonl) with the landscape's step
    time; `fail` maps a candidate-name prefix to a status for failure tests."""

    def __init__(self, fail: dict[str, str] | None = None, oom_over: float = float("inf")):
        self.calls: list[str] = []
        self.fail = fail or {}
        self.oom_over = oom_over
        """Trials whose planned memory is at least this run out of memory."""

    def __call__(self, cfg, cand, run_dir: Path, steps: int, timeout_s: float) -> TrialResult:
        self.calls.append(cand.name)
        run_dir.mkdir(parents=True, exist_ok=True)
        if _memory(cand) >= self.oom_over:
            return TrialResult(cand.name, "oom", str(run_dir), 0.1, "CUDA out of memory (injected)")
        for prefix, status in self.fail.items():
            if cand.name.startswith(prefix):
                return TrialResult(cand.name, status, str(run_dir), 0.1, f"{status} (injected)")
        trial = trial_config(cfg, cand.layout)
        lay = cand.layout
        info = {
            "config": trial.to_dict(),
            "layout": {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp},
            "hardware": {"device_type": "cpu", "logical_cores": 2},
            "extra": {"dtype": "torch.float32", "peak_flops_per_device": 2e10},
        }
        (run_dir / "run.json").write_text(json.dumps(info))
        step = cfg.train.global_batch * cfg.model.seq_len / _truth(cand)
        wobble = [1.0, 1.01, 0.99, 1.0, 1.005, 0.995]
        lines = [json.dumps({"step": i + 1, "step_time_s": step * w}) for i, w in enumerate(wobble[:steps])]
        (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        from threefold.planner.tune.trials import measure

        return measure(cand.name, run_dir, 0.1)


def _tune(tmp_path, runner, trials=0, cache="none", out="tune"):
    cfg = _cfg()
    space = Space.parse(cfg, 4, SPACE)
    opts = TuneOptions(out=str(tmp_path / out), trials=trials, steps=6, cache=cache, cluster_pairs=CLUSTER)
    return cfg, space, Tuner(cfg, 4, space, opts, runner=runner, log=lambda *_: None).run()


def test_the_loop_finds_the_best_of_a_landscape_the_planner_misranks_within_a_quarter(tmp_path):
    runner = FakeRunner()
    cfg, space, result = _tune(tmp_path, runner, trials=9)  # a quarter of the 35 candidates, rounded up
    best = max(space.candidates, key=_truth)
    assert result.best.name == best.name == "dp1tp1pp4-m4-1f1b"
    assert max(space.candidates, key=_prior).name != best.name  # the planner alone would miss it
    assert len(runner.calls) <= len(space.candidates) / 4
    assert result.stop_reason.startswith("no untried candidate")
    assert len(set(runner.calls)) == len(runner.calls)  # nothing measured twice
    journal = [json.loads(x) for x in (tmp_path / "tune" / "journal.jsonl").read_text().splitlines()]
    assert [e["name"] for e in journal] == runner.calls
    first = journal[0]
    assert first["planner_interval"][0] < first["planner_tokens_per_s"] < first["planner_interval"][1]
    assert "step" in first["residual"]  # spans-measured categories join it in a real trial
    assert first["measured_status"] == "ok" and first["measured_tokens_per_s"] > 0


def test_failures_teach_an_oom_caps_memory_and_a_failure_is_never_retried(tmp_path):
    space = Space.parse(_cfg(), 4, SPACE)
    memories = sorted(_memory(c) for c in space.candidates)
    # The upper third of the space (by planned memory) runs out of memory; every tp4 trial fails.
    limit = memories[2 * len(memories) // 3]
    runner = FakeRunner(fail={"dp1tp4pp1": "failed"}, oom_over=limit)
    cfg, space, result = _tune(tmp_path, runner, trials=10)
    trials = result.trials
    ooms = [t for t in trials if t["measured_status"] == "oom"]
    assert ooms, "the landscape's favourites are among the large ones: at least one must be tried"
    first = ooms[0]["trial"]
    # After the first OOM nothing planned to need as much memory is chosen: one OOM teaches.
    assert all(t["planner_memory_bytes"] < ooms[0]["planner_memory_bytes"] for t in trials[first:])
    assert len(runner.calls) == len(set(runner.calls))
    assert sum(t["measured_status"] == "failed" for t in trials) <= 1
    assert result.best is not None and _memory(result.best) < limit


def test_the_cache_starts_warm_and_a_version_change_invalidates_it(tmp_path, monkeypatch):
    first = FakeRunner()
    _, space, cold = _tune(tmp_path, first, trials=4, cache=str(tmp_path / "cache"), out="a")
    assert len(first.calls) == 4
    second = FakeRunner()
    _, _, warm = _tune(tmp_path, second, trials=4, cache=str(tmp_path / "cache"), out="b")
    cached = [t["name"] for t in warm.trials if t["cached"]]
    assert sorted(cached) == sorted(first.calls)
    assert not set(second.calls) & set(first.calls)  # cached candidates are not run again
    assert warm.cache_key == cold.cache_key

    real = tune_cache.key_parts

    def newer(cfg, world, steps):
        parts = real(cfg, world, steps)
        parts["versions"]["torch"] = "9.9.9"
        return parts

    monkeypatch.setattr("threefold.planner.tune.loop.key_parts", newer)
    third = FakeRunner()
    _, _, fresh = _tune(tmp_path, third, trials=2, cache=str(tmp_path / "cache"), out="c")
    assert fresh.cache_key != cold.cache_key
    assert not any(t["cached"] for t in fresh.trials) and len(third.calls) == 2
    assert any("other software versions" in n for n in fresh.notes)


def test_outputs_best_toml_runs_and_names_bands_and_the_sensitivity(tmp_path):
    cfg, space, result = _tune(tmp_path, FakeRunner(), trials=6)
    summary = write_outputs(result, cfg, tmp_path / "tune")
    best = configure(str(tmp_path / "tune" / "best.toml"))
    from threefold.validate import validate

    validate(best, 4)
    lay = result.best.layout
    assert (best.parallel.dp, best.parallel.tp, best.parallel.pp) == (lay.dp, lay.tp, lay.pp)
    assert best.train.micro_batch == lay.mbs and best.parallel.zero == lay.zero
    assert (tmp_path / "tune" / "report.html").is_file() and (tmp_path / "tune" / "tune.json").is_file()
    rows = {r["change"]: r for r in summary["sensitivity"]}
    assert rows and all(r["how"] in ("measured", "predicted") for r in rows.values())
    measured = [r for r in rows.values() if r["how"] == "measured"]
    assert all(r["loss"] <= 0.05 for r in measured)  # the winner is the best measured, up to noise
    assert "best: " + result.best.name in format_summary(summary)


def test_a_failed_trial_is_classified_from_its_stderr(tmp_path):
    assert classify_failure("boom\nRuntimeError: CUDA out of memory. Tried", tmp_path)[0] == "oom"
    status, why = classify_failure("threefold: error: parallel.vpp: 3 does not divide", tmp_path)
    assert status == "refused" and why.startswith("threefold: error:")
    assert classify_failure("Traceback\nValueError: x", tmp_path) == ("failed", "ValueError: x")


@pytest.mark.timeout(300)
def test_tune_command_runs_real_trials_through_threefold_train(tmp_path):
    out = tmp_path / "tune"
    cmd = [sys.executable, "-m", "threefold", "tune", "--model.preset", "tiny", "--model.layers", "2",
           "--model.seq_len", "32", "--train.global_batch", "4", "--nproc", "1",
           "--space", "microbatches=1,2", "--trials", "1", "--steps", "3",
           "--out", str(out), "--cache", "none"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "best: dp1tp1pp1-m" in proc.stdout
    journal = [json.loads(x) for x in (out / "journal.jsonl").read_text().splitlines()]
    assert len(journal) == 1 and journal[0]["measured_status"] == "ok"
    assert (Path(journal[0]["measured_path"]) / "spans.jsonl").is_file()
    best = configure(str(out / "best.toml"))
    assert best.log.bands and Path(best.log.bands).is_file()


def test_the_residual_process_moves_neighbours_more_than_strangers_and_ei_is_the_lognormal_mean():
    from threefold.planner.model import model_shape
    from threefold.planner.tune.loop import _cluster
    from threefold.planner.tune.surrogate import Surrogate

    cfg = _cfg()
    space = Space.parse(cfg, 4, SPACE)
    by = {c.name: c for c in space.candidates}
    sur = Surrogate(model_shape(cfg.model), _cluster(CLUSTER, 4, True, cfg), 32, "fp32")
    sur.errors = [0.4]
    seen, near, far = by["dp4tp1pp1-m2-z0"], by["dp4tp1pp1-m2-z1"], by["dp1tp2pp2-m8-int2"]
    measured = 1.5 * sur.planner(seen).tokens_per_s
    before = {c.name: b for c, b in zip(space.candidates, sur.beliefs(space.candidates, []))}
    after = {c.name: b for c, b in zip(space.candidates, sur.beliefs(space.candidates, [(seen, measured, 0.01)]))}
    shift = {n: after[n].mu - before[n].mu for n in (seen.name, near.name, far.name)}
    assert abs(shift[seen.name] - math.log(1.5)) < 0.02  # the measurement, almost exactly
    assert 0.4 * math.log(1.5) < shift[near.name] < shift[seen.name]  # one knob away: about half of it
    assert 0 <= shift[far.name] < 0.1 * shift[near.name]  # five knobs away: hardly
    assert after[seen.name].sigma < 0.1 < after[near.name].sigma < after[far.name].sigma
    # E[max(T - B, 0)] for log T ~ N(mu, sigma): against a Monte Carlo estimate.
    import numpy as np

    b = after[near.name]
    draws = np.exp(np.random.default_rng(0).normal(b.mu, b.sigma, 400_000))
    best = measured
    assert abs(b.expected_improvement(best) - np.maximum(draws - best, 0).mean()) < 0.01 * best
    assert abs(b.chance_above(best) - (draws > best).mean()) < 0.005


def test_a_win_inside_the_noise_goes_to_the_simpler_layout(tmp_path):
    cfg = _cfg()
    space = Space.parse(cfg, 4, SPACE)
    tuner = Tuner(cfg, 4, space, TuneOptions(out=str(tmp_path), cache="none", cluster_pairs=CLUSTER), log=print)
    by = {c.name: c for c in space.candidates}

    def result(name, tokens):
        return TrialResult(name, "ok", "", 1.0, tokens_per_s=tokens, step_time_s=1.0, noise=0.01, steps_used=5)

    tuner.results = {
        "dp4tp1pp1-m2-z1": result("dp4tp1pp1-m2-z1", 1010.0),
        "dp4tp1pp1-m2-z0": result("dp4tp1pp1-m2-z0", 1000.0),
    }
    assert tuner._top()[0] is by["dp4tp1pp1-m2-z1"]  # what the next trial has to beat
    assert tuner._best()[0] is by["dp4tp1pp1-m2-z0"]  # 1% is inside the 2% floor: ZeRO 0 wins
    tuner.results["dp4tp1pp1-m2-z1"] = result("dp4tp1pp1-m2-z1", 1100.0)
    assert tuner._best()[0] is by["dp4tp1pp1-m2-z1"]  # 10% is beyond it
