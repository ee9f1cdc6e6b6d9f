"""Unit tests of span recording (threefold.observe.spans), traces and the report's pieces, in one
process: no training."""

from __future__ import annotations

import json
import time

import pytest
import torch

from threefold.analysis.compare import biggest_change, config_diff
from threefold.cli import main
from threefold.distributed.pipeline.schedules import build_schedule
from threefold.model.recompute import recompute_module
from threefold.observe.observer import parse_trace_steps
from threefold.observe.spans import CATEGORIES, SpanRecorder, resolve
from threefold.observe.trace import check_trace, gantt_rows, metadata_events, step_events


def _sleep(s=0.002):
    time.sleep(s)


def test_exclusive_times_partition_the_step():
    rec = SpanRecorder("cpu")
    rec.begin_step()
    _sleep()
    with rec.span("forward", "F0c0"):
        _sleep()
        with rec.span("tp_comm"):
            _sleep()
        _sleep()
    rec.phase("optimizer")
    _sleep()
    rec.phase("other")
    timeline = rec.end_step()
    s = timeline.seconds
    assert set(s) == set(CATEGORIES)
    assert sum(s.values()) == pytest.approx(timeline.wall_s, rel=1e-9)
    # tp_comm is carved out of forward: forward holds its own two sleeps only
    assert s["tp_comm"] >= 0.002 and s["forward"] >= 0.004 and s["optimizer"] >= 0.002
    assert s["forward"] < timeline.wall_s - s["tp_comm"] - s["optimizer"]
    assert s["other"] >= 0.002
    assert timeline.events == []  # not traced


def test_steps_read_late_come_one_step_after_and_all_of_them_on_a_flush():
    """The CUDA mode (events read at the end of the next step), played with host clocks."""
    rec = SpanRecorder("cpu")
    rec.late = True
    lengths = []
    for step, flush in enumerate([False, False, True, False, True]):
        rec.begin_step(trace=step == 4)
        with rec.span("forward"):
            time.sleep(0.001 * (step + 1))
        lengths.append([round(t.seconds["forward"], 3) for t in rec.end_step_late(flush)])
    # Step 1 comes out with step 2; a flush returns the held step and its own.
    assert [len(x) for x in lengths] == [0, 1, 2, 0, 2]
    assert [x >= 0.001 * (i + 1) for i, x in enumerate(sum(lengths, []))] == [True] * 5
    assert sum(lengths, []) == sorted(sum(lengths, []))  # in step order
    rec.late = False
    rec.begin_step()
    assert len(rec.end_step_late(False)) == 1


def test_traced_step_keeps_nested_events_with_labels():
    rec = SpanRecorder(torch.device("cpu"))
    rec.begin_step(trace=True)
    with rec.span("backward", build_schedule("1f1b", 2, 2)[0][-1]):
        with rec.record("recompute"):
            pass
    with rec.span("pp_bubble", tuple(a for a in build_schedule("1f1b", 2, 2)[1] if a.is_comm)[:1]):
        pass
    events = rec.end_step().events
    names = [(e[0], e[1], e[4]) for e in events]
    assert names[0] == ("other", "step", 0)
    assert ("backward", "B1c0", 1) in names and ("recompute", "recompute", 2) in names
    assert any(cat == "pp_bubble" and name.startswith("pp_bubble RECV_F0c0<-0") for cat, name, _ in names)


def test_unknown_category_and_bad_nesting_are_refused():
    with pytest.raises(ValueError, match="unknown"):
        resolve(
            [
                (True, "other", None, 0.0),
                (True, "gpu_magic", None, 0.1),
                (False, "gpu_magic", None, 0.2),
                (False, "other", None, 0.3),
            ],
            [0.0, 0.1, 0.2, 0.3],
            False,
        )
    with pytest.raises(RuntimeError, match="nest"):
        resolve(
            [(True, "other", None, 0.0), (True, "forward", None, 0.1), (False, "other", None, 0.2)],
            [0.0, 0.1, 0.2],
            False,
        )


def test_spans_outside_a_step_are_not_recorded():
    rec = SpanRecorder("cpu")
    with rec.span("forward"):
        pass
    rec.begin_step()
    assert len(rec._marks) == 1  # only the step's own opening mark


def test_recompute_rerun_is_timed_only_in_backward():
    block = torch.nn.Linear(4, 4)
    recompute_module(block)
    rec = SpanRecorder("cpu")
    block.spans = rec
    rec.begin_step(trace=True)
    with rec.span("forward"):
        out = block(torch.randn(2, 4, requires_grad=True)).sum()
    with rec.span("backward"):
        out.backward()
    events = rec.end_step().events
    rec_events = [e for e in events if e[0] == "recompute"]
    assert len(rec_events) == 1 and rec_events[0][4] == 2  # inside backward, once


def test_trace_steps_parse():
    assert parse_trace_steps("5, 6,") == {5, 6}
    assert parse_trace_steps("") == set()
    for bad in ("x", "0", "-2"):
        with pytest.raises(ValueError):
            parse_trace_steps(bad)


def test_trace_events_pass_the_schema_check_and_broken_ones_fail():
    events = metadata_events([(0, {"tp": 0, "pp": 0}), (1, {"tp": 0, "pp": 1})])
    events += step_events(
        3,
        0.0,
        [
            (0, [("other", "step", 0.0, 0.01, 0), ("forward", "F0c0", 0.001, 0.002, 1)]),
            (1, [("other", "step", 0.0, 0.01, 0), ("backward", "B0c0", 0.004, 0.003, 1)]),
        ],
    )
    doc = json.loads(json.dumps({"traceEvents": events}))
    assert check_trace(doc) == []
    step, rows = gantt_rows(doc)
    assert step == 3 and [e[1] for e in rows[0]] == ["F0c0"] and rows[1][0][2] == pytest.approx(4.0)
    assert check_trace({"events": []})
    bad = dict(events[-1], ts="soon", pid="0")
    assert len(check_trace({"traceEvents": [bad]})) == 2


def test_biggest_change_and_config_diff():
    a = dict.fromkeys(CATEGORIES, 0.0) | {"forward": 1.0, "pp_bubble": 0.5, "pp_p2p": 0.5}  # shares .5 .25 .25
    b = dict.fromkeys(CATEGORIES, 0.0) | {"forward": 2.0, "pp_bubble": 0.4, "pp_p2p": 1.4}  # .526 .105 .368
    assert biggest_change(a, b) == ("pp_bubble", pytest.approx(0.4 / 3.8 - 0.25))  # p2p: more ms, less share
    slower = {c: 3 * v for c, v in a.items()}  # the same run on a busier machine: no share changes
    assert biggest_change(a, slower)[1] == pytest.approx(0.0)
    diff = config_diff(
        {"parallel": {"pp": 2, "schedule": "1f1b"}, "log": {"dir": "a"}},
        {"parallel": {"pp": 2, "schedule": "interleaved"}, "log": {"dir": "b"}},
    )
    assert diff == [("parallel.schedule", "1f1b", "interleaved")]


@pytest.mark.parametrize(
    "make, expect",
    [
        (lambda d: None, "does not exist"),
        (lambda d: d.mkdir(), "has no run.json"),
        (lambda d: (d.mkdir(), (d / "run.json").write_text('{"config": {}}')), "has no metrics.jsonl"),
        (
            lambda d: (
                d.mkdir(),
                (d / "run.json").write_text('{"config": {}}'),
                (d / "metrics.jsonl").write_text('{"st'),
            ),
            "has no complete step",
        ),
        (lambda d: (d.mkdir(), (d / "run.json").write_text('{"conf')), "is not valid JSON"),
    ],
)
def test_report_on_a_missing_or_half_written_run_dir_is_one_line(tmp_path, capsys, make, expect):
    run = tmp_path / "run"
    make(run)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert expect in err and "\n" not in err and err.startswith("threefold: error: report:")


def test_report_drops_a_half_written_last_line_and_says_so(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"config": {"model": {}, "parallel": {"pp": 1}}}))
    lines = [
        json.dumps({"step": i, "loss": 5.0 - i, "step_time_s": 0.1, "tokens_per_s": 10.0, "mfu": None}) for i in (1, 2)
    ]
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 3, "lo')
    assert main(["report", str(run), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "2 steps" in out and "half-written" in out and "log.spans true" in out


def test_tensorboard_flattening():
    from threefold.observe.tensorboard import flatten

    flat = flatten({"step": 3, "loss": 1.5, "time_s": {"mean": {"forward": 0.1}}, "step_skipped": False, "x": None})
    assert flat == {"step": 3.0, "loss": 1.5, "time_s/mean/forward": 0.1}


def test_tensorboard_scalars_are_written(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from threefold.observe import MetricsWriter

    with MetricsWriter(tmp_path, enabled=True, append=False, tensorboard=True) as w:
        for step in (1, 2):
            w.write({"step": step, "loss": 3.0 / step, "time_s": {"mean": {"forward": 0.5}}})
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([3.0, 1.5])
    assert "time_s/mean/forward" in acc.Tags()["scalars"]


def test_log_knobs_are_validated():
    from threefold.config import build_config
    from threefold.errors import ConfigError
    from threefold.validate import validate

    with pytest.raises(ConfigError, match="log.trace_steps: needs log.spans"):
        validate(build_config(None, [("log.spans", "false"), ("log.trace_steps", "2")]))
    with pytest.raises(ConfigError, match="not a list of step numbers"):
        validate(build_config(None, [("log.spans", "true"), ("log.trace_steps", "two")]))
    with pytest.raises(ConfigError, match="past train.steps"):
        validate(build_config(None, [("log.spans", "true"), ("log.trace_steps", "9"), ("train.steps", "3")]))


def test_summary_hfu_counts_recompute():
    from threefold.analysis.summary import hfu_ratio

    model = dict(
        arch="llama",
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn_hidden=128,
        vocab=100,
        seq_len=16,
        tie_embeddings=False,
    )
    assert hfu_ratio({"model": model, "train": {"recompute": "none"}}) == 1.0
    full = hfu_ratio({"model": model, "train": {"recompute": "full"}, "parallel": {"pp": 1}})
    assert full == pytest.approx((493824 + 151808) / 493824)
    half = hfu_ratio({"model": model, "train": {"recompute": "full", "recompute_layers": 1}, "parallel": {"pp": 1}})
    assert half == pytest.approx(1 + (full - 1) / 2)
