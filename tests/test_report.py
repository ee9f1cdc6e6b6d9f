"""Spans, traces and reports on real multi-process CPU runs (tiny model, few steps)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import run_training, run_training_many

from threefold.cli import main
from threefold.distributed.grid import RankLayout
from threefold.distributed.pipeline.schedules import build_schedule
from threefold.observe.compare import compare
from threefold.observe.rundir import load_run
from threefold.observe.spans import CATEGORIES
from threefold.observe.summary import summarize
from threefold.observe.trace import check_trace, gantt_rows

STEPS = 3
BASE = {"train.steps": STEPS, "model.preset": "tiny", "log.spans": "true", "train.warmup_steps": 1}


@pytest.fixture(scope="module")
def run3d(tmp_path_factory, cache_dir):
    """tp2 x pp2 x dp2 (8 processes), 1F1B over 4 micro-batches, step 3 traced."""
    path = tmp_path_factory.mktemp("tp2pp2dp2")
    metrics = run_training({**BASE, "parallel.tp": 2, "parallel.pp": 2, "parallel.dp": 2, "parallel.microbatches": 4,
                            "train.global_batch": 16, "log.trace_steps": "3"}, path, cache_dir, timeout=400)
    return path, metrics


def test_categories_sum_to_the_step_time_on_every_rank(run3d):
    path, metrics = run3d
    spans = [json.loads(line) for line in (path / "spans.jsonl").read_text().splitlines()]
    assert [s["step"] for s in spans] == [1, 2, 3] and all(len(s["ranks"]) == 8 for s in spans)
    for record, line in zip(metrics[1:], spans[1:]):
        step_time = record["step_time_s"]
        for rank in line["ranks"]:
            parts = rank["time_s"]
            assert set(parts) == set(CATEGORIES)
            assert sum(parts.values()) == pytest.approx(step_time, rel=0.05), (rank["rank"], parts, step_time)
            assert parts["forward"] > 0 and parts["backward"] > 0 and parts["tp_comm"] > 0
            assert parts["other"] < 0.2 * step_time  # the named spans cover the step
        for group in ("tp", "pp", "dp"):
            assert min(r["comm_bytes"][group] for r in line["ranks"]) > 0
        mean = record["time_s"]["mean"]
        assert mean["pp_bubble"] == pytest.approx(sum(r["time_s"]["pp_bubble"] for r in line["ranks"]) / 8)


def test_trace_is_valid_and_follows_the_schedule(run3d):
    path, _ = run3d
    doc = json.loads((path / "trace.json").read_text())
    assert check_trace(doc) == []
    step, rows = gantt_rows(doc)
    assert step == 3 and sorted(rows) == list(range(8))
    layout = RankLayout(tp=2, pp=2, dp=2)
    schedule = build_schedule("1f1b", 2, 4)
    for rank, events in rows.items():
        order = [name for cat, name, *_ in events if cat in ("forward", "backward")]
        expected = [str(a) for a in schedule[layout.coords(rank)["pp"]] if not a.is_comm]
        assert order == expected, rank
        assert any(cat == "pp_bubble" for cat, *_ in events)


def test_report_of_one_run_writes_text_plots_and_page(run3d, capsys):
    path, _ = run3d
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "MFU" in out and "HFU" in out and "pipeline bubble: measured" in out and "theory 20.0%" in out
    assert "exposed communication" in out and "straggler" in out and "dp gradient communication" in out
    pytest.importorskip("matplotlib")
    for name in ("loss.png", "timeline.png", "breakdown.png", "report.html"):
        assert (path / "report" / name).stat().st_size > 1000
    assert (path / "report" / "report.html").read_text().count("data:image/png;base64") == 3


def test_compare_names_the_bubble_change_between_1f1b_and_interleaved(tmp_path, cache_dir):
    # Two micro-batches on two stages: the bubble is a third of the step (a fifth interleaved), and
    # eight layers keep the stages' compute above the transfers' cost on gloo.
    pipe = {**BASE, "train.steps": 4, "model.layers": 8, "parallel.pp": 2, "parallel.microbatches": 2,
            "train.global_batch": 8}
    run_training_many({"onefoneb": {**pipe, "parallel.schedule": "1f1b"},
                       "interleaved": {**pipe, "parallel.schedule": "interleaved", "parallel.vpp": 2}},
                      tmp_path, cache_dir, world=2)
    a, b = load_run(tmp_path / "onefoneb"), load_run(tmp_path / "interleaved")
    text, found = compare(summarize(a), summarize(b), a.config, b.config)
    assert found["biggest_waiting"][0] == "pp_bubble" and found["biggest_waiting"][1] < 0, text
    assert "(theory 33.3%) -> B" in text and "(theory 20.0%)" in text
    assert "parallel.schedule: '1f1b' -> 'interleaved'" in text and "parallel.vpp: 1 -> 2" in text


def test_compare_names_the_dp_communication_change(tmp_path, cache_dir, capsys):
    # Same work per rank (two micro-batches of 4): the dp2 run adds the gradient all-reduce.
    one = run_training({**BASE, "train.global_batch": 8}, tmp_path / "dp1", cache_dir)
    two = run_training({**BASE, "train.global_batch": 16, "parallel.dp": 2}, tmp_path / "dp2", cache_dir)
    assert len(one) == len(two) == STEPS
    assert main(["report", str(tmp_path / "dp1"), str(tmp_path / "dp2")]) == 0
    text = capsys.readouterr().out
    assert "biggest communication/idle change: dp_exposed +" in text, text
    assert "dp 0 B -> " in text and "parallel.dp: 1 -> 2" in text
