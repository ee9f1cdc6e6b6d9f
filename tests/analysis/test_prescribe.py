"""`threefold report RUN` prescribes: on constructed pathologies, the first prescription names the
knob (or the rank) that relieves the biggest cost on the critical path. Real short CPU runs where
they are cheap (one or two processes), constructed span records where a real run would be slow
(four pipeline stages) or the machine cannot show the pathology reliably (bucket sizes on 2 cores)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from threefold.analysis.compare import compare
from threefold.analysis.prescribe import best_knob, diagnose
from threefold.analysis.rundir import load_run
from threefold.analysis.summary import summarize
from threefold.cli import main
from threefold.observe.spans import CATEGORIES
from threefold.planner.predict import RunPredictor

from harness import resolved_config, run_training

BASE = {"model.preset": "tiny", "log.spans": "true", "log.interval": 1, "train.warmup_steps": 1}
CPU = {"device_type": "cpu", "logical_cores": 64, "device_name": "cpu"}


def first(path) -> tuple:
    """(the first finding, its best knob's changes or None) of a run directory."""
    run = load_run(path)
    found = diagnose(summarize(run), run.config, RunPredictor(run.info))
    assert found, "no prescription"
    best = best_knob(found[0])
    return found[0], (best.changes if best else None)


def write_run(
    path: Path, overrides: dict, ranks: list[dict], steps: int = 6, tokens_per_s=None, hardware=CPU, **fields
) -> Path:
    """A run directory as `threefold train` writes it, with constructed span records: `ranks`
    gives each rank's {category: seconds} (and "calls"/"bytes" per group); `fields` go into
    every step's metrics (dp_comm_serial_s, as a traced step has it)."""
    cfg = resolved_config({**BASE, **overrides}, path, "")
    path.mkdir(parents=True, exist_ok=True)
    world = len(ranks)
    info = {"config": cfg, "layout": {}, "hardware": hardware, "extra": {"peak_flops_per_device": 2e10}}
    (path / "run.json").write_text(json.dumps(info))
    p = cfg["parallel"]
    coords = [{"tp": 0, "pp": r // (world // p["pp"]), "dp": r % p["dp"], "ep": 0} for r in range(world)]
    metrics, spans = [], []
    for step in range(1, steps + 1):
        rows = []
        for r, row in enumerate(ranks):
            times = {c: row.get(c, 0.0) for c in CATEGORIES}
            rows.append(
                {"rank": r, **coords[r], "wall_s": sum(times.values()), "time_s": times,
                 "comm_bytes": row.get("bytes", {}), "comm_calls": row.get("calls", {})}
            )  # fmt: skip
        wall = max(x["wall_s"] for x in rows)
        mean = {c: sum(x["time_s"][c] for x in rows) / world for c in CATEGORIES}
        tps = tokens_per_s[step - 1] if tokens_per_s else 1000 / wall
        metrics.append(
            {"step": step, "loss": 5.0, "step_time_s": wall, "tokens_per_s": tps, "mfu": 0.1,
             "time_s": {"mean": mean, "max": mean}, "span_step_s": {"mean": wall, "max": wall}, **fields}
        )  # fmt: skip
        spans.append({"step": step, "steps": 1, "ranks": rows})
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (path / "spans.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    return path


def work(fwd=0.1, bwd=0.2, **more) -> dict:
    return {"forward": fwd, "backward": bwd, "optimizer": 0.005, "sync": 0.002, **more}


def test_too_few_microbatches_for_pp4_prescribes_more(tmp_path, capsys):
    # pp 4, m 4, 1F1B: theory says 3/7 of the step idles; every stage shows it.
    over = {"parallel.pp": 4, "train.global_batch": 32, "train.micro_batch": 8}
    path = write_run(tmp_path / "pp4", over, [work(pp_bubble=0.23, pp_p2p=0.01) for _ in range(4)])
    finding, changes = first(path)
    assert finding.category == "pp_bubble" and 0.4 < finding.share < 0.5
    assert changes is not None and changes["parallel.microbatches"] > 4, finding.text()
    assert main(["report", str(path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "1. pipeline bubble 4" in out and "`--parallel.microbatches " in out and "predicted +" in out


def test_fewer_microbatches_than_stages_are_priced_and_prescribed(tmp_path):
    # pp 4, m 2: the planner's search never proposes it, but a run that did it gets a prescription
    # priced by the planner (the run's own layout is predicted as it ran).
    over = {"parallel.pp": 4, "train.global_batch": 32, "train.micro_batch": 16}
    path = write_run(tmp_path / "pp4m2", over, [work(pp_bubble=0.45, pp_p2p=0.01) for _ in range(4)])
    finding, changes = first(path)
    assert finding.category == "pp_bubble", finding.text()
    assert changes is not None and changes["parallel.microbatches"] > 2, finding.text()
    knob = best_knob(finding)
    assert knob.source == "planner" and knob.gain > 0.1, finding.text()


@pytest.mark.parametrize("cores", [2, 64])
def test_latency_bound_buckets_on_shared_cores_save_their_replayed_work(tmp_path, cores):
    # 170 calls of 26 KiB whose waits overlap hid (20 ms exposed). On 2 cores for 2 ranks their
    # work ran on backward's cores: fewer calls save their share of the traced step's replay
    # (100 ms alone). With cores to spare only the exposed wait is saved.
    dp = {"calls": {"dp": 170.0}, "bytes": {"dp": 170 * 26 * 1024.0}}
    over = {"parallel.dp": 2, "parallel.bucket_mb": 0.002, "train.global_batch": 8}
    ranks = [work(dp_exposed=0.02, **dp) for _ in range(2)]
    hardware = {**CPU, "logical_cores": cores}
    path = write_run(tmp_path / "few", over, ranks, hardware=hardware, dp_comm_serial_s=0.1)
    finding, changes = first(path)
    knob = best_knob(finding)
    assert finding.category == "dp_exposed" and changes["parallel.bucket_mb"] == 1.1, finding.text()
    wall = sum(v for k, v in ranks[0].items() if k not in ("calls", "bytes"))
    saved = 0.1 * (170 - 4) / 170 if cores == 2 else 0.02
    assert knob.gain == pytest.approx(wall / (wall - saved) - 1, rel=1e-6), finding.text()


def test_latency_bound_buckets_prescribe_a_bigger_bucket(tmp_path):
    # 400 buckets of 8 KiB per step: each call pays the cpu profile's ~6.5 ms fixed cost.
    dp = {"calls": {"dp": 400.0}, "bytes": {"dp": 400 * 8192.0}}
    over = {"parallel.dp": 2, "parallel.bucket_mb": 0.008, "train.global_batch": 8}
    path = write_run(tmp_path / "small", over, [work(dp_exposed=0.25, **dp) for _ in range(2)])
    finding, changes = first(path)
    assert finding.category == "dp_exposed", finding.text()
    assert changes is not None and changes["parallel.bucket_mb"] > 0.008 * 4, finding.text()


@pytest.mark.parametrize("cores", [2, 64])
def test_one_huge_bucket_prescribes_a_smaller_one(tmp_path, cores):
    # One bucket holds every gradient: its all-reduce starts when backward ends. With no core to
    # spare for it, overlapping hides its wait but not its work: the estimate says it bounds.
    dp = {"calls": {"dp": 1.0}, "bytes": {"dp": 3.4 * 2**20}}
    over = {"parallel.dp": 2, "parallel.bucket_mb": 1000, "train.global_batch": 8}
    ranks = [work(dp_exposed=0.25, **dp) for _ in range(2)]
    path = write_run(tmp_path / "big", over, ranks, hardware={**CPU, "logical_cores": cores})
    finding, changes = first(path)
    assert finding.category == "dp_exposed", finding.text()
    assert changes is not None and changes["parallel.bucket_mb"] < 3.4, finding.text()
    assert ("upper bound" in finding.text()) == (cores == 2), finding.text()


def test_a_saturated_link_is_not_recoverable_by_a_knob(tmp_path):
    # 16 buckets of 16 MiB at the cpu profile's 1 GB/s: 2 (N-1)/N * 256 MiB = 0.27 s on the wire.
    dp = {"calls": {"dp": 16.0}, "bytes": {"dp": 256.0 * 2**20}}
    over = {"parallel.dp": 2, "parallel.bucket_mb": 16, "train.global_batch": 8}
    path = write_run(tmp_path / "wire", over, [work(dp_exposed=0.3, **dp) for _ in range(2)])
    finding, changes = first(path)
    assert finding.category == "dp_exposed" and changes is None
    assert "not recoverable by a knob" in finding.text() and "GB/s" in finding.text()


def test_slowed_data_without_prefetch_prescribes_prefetch(tmp_path, cache_dir, monkeypatch):
    # One process (in this one): the sampler sleeps 300 ms a step, so data_wait is most of the step.
    import time

    from threefold.training.trainer import Trainer

    batches = Trainer.batches
    monkeypatch.setattr(Trainer, "batches", lambda self, step: (time.sleep(0.3), batches(self, step))[1])
    over = {**BASE, "train.steps": 5, "data.prefetch": 0, "train.global_batch": 4, "train.micro_batch": 4}
    steps = run_training(over, tmp_path / "data", cache_dir)
    finding, changes = first(tmp_path / "data")
    assert finding.category == "data_wait" and changes == {"data.prefetch": 2}, finding.text()
    # The wait is part of the step: tokens/s and MFU of a data-starved run show it.
    for r in steps:
        assert r["data_wait_s"] >= 0.3 and r["step_time_s"] > r["data_wait_s"], r


def test_full_recompute_that_memory_does_not_need_prescribes_none(tmp_path, cache_dir):
    over = {**BASE, "train.steps": 5, "train.recompute": "full", "train.global_batch": 8, "train.micro_batch": 4}
    run_training(over, tmp_path / "recompute", cache_dir)
    finding, changes = first(tmp_path / "recompute")
    assert finding.category == "recompute" and changes == {"train.recompute": "none"}, finding.text()
    gain = finding.knobs[0].gain
    assert finding.knobs[0].source == "planner" and gain is not None and gain > 0


def test_full_recompute_is_kept_when_memory_needs_it(tmp_path):
    over = {"train.recompute": "full", "train.global_batch": 64, "train.micro_batch": 64}
    path = write_run(tmp_path / "tight", over, [work(recompute=0.1)])
    run = load_run(path)
    # memory_gib just above what full recompute needs on this one device: none does not fit.
    need = RunPredictor(run.info).memory({})[0] / 2**30
    found = diagnose(summarize(run), run.config, RunPredictor(run.info, [("memory_gib", 0.5 + need * 1.02)]))
    finding = next(f for f in found if f.category == "recompute")
    assert not finding.knobs and "does not fit" in finding.text(), finding.text()


def test_a_slowed_rank_is_named(tmp_path, cache_dir):
    over = {**BASE, "train.steps": 5, "parallel.dp": 2, "train.global_batch": 8, "train.faults": "slow:rank=1:factor=3"}
    run_training(over, tmp_path / "slow", cache_dir)
    finding, changes = first(tmp_path / "slow")
    assert finding.category == "straggler" and finding.rank == 1 and changes is None, finding.text()
    assert "rank 1 (tp0 pp0 dp1)" in finding.text()


@pytest.mark.parametrize("shift, verdict", [(1.0, "within the per-step noise"), (0.7, "beyond the per-step noise")])
def test_report_a_b_tells_a_change_from_noise(tmp_path, shift, verdict):
    noisy = [1000, 1100, 950, 1050, 990, 1020, 1080, 960]
    ranks = [work()]
    a = write_run(tmp_path / "a", {}, ranks, steps=8, tokens_per_s=noisy)
    b = write_run(tmp_path / "b", {}, ranks, steps=8, tokens_per_s=[shift * x for x in reversed(noisy)])
    ra, rb = load_run(a), load_run(b)
    text, found = compare(summarize(ra), summarize(rb), ra.config, rb.config, ra, rb)
    line = next(s for s in text.splitlines() if s.startswith("tokens/s B/A"))
    assert verdict in line, text
    assert found["tokens_per_s_ratio"].lo <= shift <= found["tokens_per_s_ratio"].hi


def test_exposed_cp_communication_is_named(tmp_path):
    # cp 2: the ring's transfers left waiting are the biggest cost; the planner does not model cp,
    # so no knob is offered with an invented gain.
    over = {"parallel.cp": 2, "train.global_batch": 8}
    path = write_run(tmp_path / "cp2", over, [work(cp_comm=0.2) for _ in range(2)])
    finding, changes = first(path)
    assert finding.category == "cp_comm" and 0.3 < finding.share < 0.5, finding.text()
    assert changes is None and "not hidden behind attention" in finding.text()


@pytest.mark.parametrize("waits, recoverable", [(0.04, True), (0.004, False)])
def test_zero3_gather_waits_prescribe_a_deeper_prefetch_when_it_can_hide_them(tmp_path, waits, recoverable):
    # ZeRO 3, 4 blocks, one micro-batch: each pass leaves its first block's gather exposed (2.5 ms
    # each alone: a 20 ms replay over 8 gathers) and a block computes 37.5 ms per pass, so a
    # prefetch deeper by one leaves 5 ms. Waits of 40 ms are mostly late gathers it absorbs; 4 ms
    # are the first blocks', which no depth hides.
    over = {"parallel.dp": 2, "parallel.zero": 3, "model.layers": 4, "train.global_batch": 8, "train.micro_batch": 4}
    ranks = [work(dp_exposed=waits + 0.02) for _ in range(2)]  # and 20 ms of reduce-scatters
    path = write_run(tmp_path / "z3", over, ranks, zero3_gather_wait_s=waits, dp_gather_serial_s=0.02)
    run = load_run(path)
    found = [f for f in diagnose(summarize(run), run.config, RunPredictor(run.info)) if f.category == "dp_exposed"]
    assert found and found[0].knobs[0].changes == {"parallel.zero3_prefetch": 2}, found
    wall = sum(ranks[0].values())
    saved = waits - 0.005 if recoverable else 0.0
    assert found[0].recoverable == recoverable
    assert found[0].knobs[0].gain == pytest.approx(wall / (wall - saved) - 1, rel=1e-6), found[0].text()
