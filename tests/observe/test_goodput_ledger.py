"""The goodput ledger (observe/goodput.py): a failure's recovery in parts that add up to it, one
goodput.jsonl per run that every attempt appends to, and the report's reading and plot of it."""

from __future__ import annotations

import json

import pytest

from threefold.analysis.rundir import load_run
from threefold.analysis.summary import LEDGER, ledger_seconds, summarize
from threefold.observe.goodput import LEDGER as LEDGER_FILE
from threefold.observe.goodput import PARTS, Goodput, record_fault, recovery_parts


@pytest.mark.parametrize(
    "detected,start",
    [
        (100.3, {"process_start": 101.0, "preflight_s": 0.5, "load_start": 104.0, "load_end": 104.5}),
        (None, {"process_start": 101.0, "preflight_s": 0.5, "load_start": 104.0, "load_end": 104.5}),
        (100.3, {"process_start": 99.0, "load_start": 104.0, "load_end": 104.5}),  # a clock that ran early
        (None, {}),  # a rollback: no new process
    ],
)
def test_recovery_parts_add_up_to_the_recovery(detected, start):
    parts = recovery_parts(100.0, detected, start, 105.0)
    assert set(parts) == set(PARTS) and all(v >= 0 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(5.0)
    if detected and start.get("process_start", 0) > detected:
        assert parts["detect_s"] == pytest.approx(0.3) and parts["preflight_s"] == 0.5


def _record(step, now, segment, **extra):
    return {"step": step, "time": now, "step_time_s": 0.5, "segment": segment, **extra}


def test_every_attempt_appends_to_one_ledger_that_the_report_reads(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"config": {"log": {"interval": 2}}}))
    records = []
    book = Goodput(tmp_path, enabled=True, continuing=False)
    start = {
        "process_start": book.started,
        "preflight_s": 0.2,
        "load_start": book.started + 1,
        "load_end": book.started + 1,
    }
    now = book.started + 1.0
    for step in range(1, 5):
        now += 0.5
        rec = _record(step, now, "a", **({"attempt_start": start} if step == 1 else {}))
        rec.update(book.update(rec))
        records.append(rec)
        if step % 2 == 0:
            book.progress()
    # The next attempt (a new process): it resumes at step 2, after a failure at now + 0.1.
    failed, now = now + 0.1, now + 4.0
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "failures.jsonl").write_text(json.dumps({"time": failed + 0.2, "kind": "peer"}) + "\n")
    record_fault(tmp_path, 1, "kill", 4, time=failed)
    book = Goodput(tmp_path, enabled=True, continuing=True)
    start = {"process_start": failed + 1.0, "preflight_s": 0.3, "load_start": failed + 2.5, "load_end": failed + 2.9}
    start["source"] = "memory"
    for step in range(3, 7):
        now += 0.5
        rec = _record(step, now, "b", **({"attempt_start": start} if step == 3 else {}))
        rec.update(book.update(rec))
        records.append(rec)
        if step % 2 == 0:
            book.progress()
    lines = [json.loads(line) for line in (tmp_path / LEDGER_FILE).read_text().splitlines()]
    assert [line["event"] for line in lines] == ["attempt", "progress", "progress", "attempt", "progress", "progress"]
    failure = lines[3]["failure"]
    assert failure["source"] == "memory" and failure["lost_steps"] == 2
    assert failure["detect_s"] == pytest.approx(0.2) and failure["preflight_s"] == pytest.approx(0.3)
    assert failure["load_s"] == pytest.approx(0.4)
    assert sum(failure[k] for k in PARTS) == pytest.approx(failure["mttr_s"] - 0.5)
    for line in lines:
        if line["event"] == "progress":
            assert sum(ledger_seconds(line).values()) == pytest.approx(line["wall_s"])
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = load_run(tmp_path)
    ledger = summarize(run)["ledger"]
    assert ledger["attempts"] == 2 and set(ledger["seconds"]) == set(LEDGER)
    assert ledger["seconds"]["preflight"] == pytest.approx(0.5)  # both attempts'
    from threefold.analysis import plots

    if plots.have_matplotlib():
        assert plots.goodput_plot(run, tmp_path / "goodput.png").stat().st_size > 0
