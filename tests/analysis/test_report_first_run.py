"""The report of the README's first run, one process with the defaults: every line says something
(a lone process sends nothing, and the bytes line says why instead of printing nothing), and one
late report step is traced, so the report has its per-rank timeline."""

from __future__ import annotations

import json

import pytest

from threefold.cli import main
from threefold.config import build_config
from threefold.observe.trace import check_trace
from threefold.validate import validate

from harness import run_training

STEPS = 12  # the README's first run is 300 steps; the rest is its defaults (log.interval 10)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, cache_dir):
    path = tmp_path_factory.mktemp("first-run")
    run_training({"train.steps": STEPS}, path, cache_dir)
    return path


def test_one_process_report_says_it_sent_no_bytes(first_run, capsys):
    capsys.readouterr()
    assert main(["report", str(first_run), "--no-plots"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  bytes per step per rank: none (one process)" in lines, "\n".join(lines)


def test_the_default_traces_the_last_report_step_before_the_last(first_run):
    doc = json.loads((first_run / "trace.json").read_text())
    assert check_trace(doc) == []
    traced = {e["args"]["step"] for e in doc["traceEvents"] if e.get("ph") == "X"}
    assert traced == {10}


@pytest.mark.parametrize(
    ("overrides", "traced"),
    [
        ([("train.steps", "300")], "290"),  # the README's first run (log.interval 10)
        ([("train.steps", "12")], "10"),
        ([("train.steps", "12"), ("log.interval", "1")], "11"),
        ([("train.steps", "10")], "10"),  # no report step before the last: the last
        ([("train.steps", "1")], "1"),  # a one-step run traces its only step
        ([("train.steps", "12"), ("log.spans", "false")], ""),  # nothing to trace, and no error
        ([("train.steps", "12"), ("log.trace_steps", "")], ""),  # '' still turns tracing off
        ([("train.steps", "12"), ("log.trace_steps", "5,6")], "5,6"),
    ],
)
def test_auto_trace_steps_resolve_against_train_steps(overrides, traced):
    assert validate(build_config(None, overrides)).log.trace_steps == traced


def test_auto_traces_nothing_past_a_few_nodes():
    """Every rank's spans gather to rank 0 into one file: at thousands of ranks that is opt-in."""
    at = [("train.steps", "12"), ("train.global_batch", "128"), ("train.micro_batch", "1")]
    assert validate(build_config(None, [*at, ("parallel.dp", "0")]), world_size=64).log.trace_steps == "10"
    assert validate(build_config(None, [*at, ("parallel.dp", "0")]), world_size=128).log.trace_steps == ""
    explicit = [*at, ("parallel.dp", "0"), ("log.trace_steps", "5")]
    assert validate(build_config(None, explicit), world_size=128).log.trace_steps == "5"
