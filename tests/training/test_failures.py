"""Failures say what happened, on gloo as they would on NCCL: a rank that NCCL's watchdog aborts
is named in failures.jsonl and in the restart's one line, a rank that dies of a Python exception
is named by that exception, a worker leaves no process group behind, and the long host phases
(start-up, the first step, saves) wait train.startup_timeout_s while the rest waits
train.timeout_s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import failure_drills
import pytest

from threefold.distributed import failures
from threefold.errors import ConfigError

from harness import CALM_LR, resolved_config, run_ranks

TESTS = Path(__file__).resolve().parents[1]  # the helpers (failure_drills.py) live in tests/
CRASH = "'ExpertDataParallel' object has no attribute 'time_serial_comm'"


def _drilled(tmp_path: Path, data: str, overrides: dict, drills: list[dict], timeout: float = 150):
    """`threefold train` of a small model at dp 2 with `drills` (tests/failure_drills.py) in its
    workers, on the `data` fixture's token file."""
    overrides = {
        "data.path": data,
        "data.vocab": 256,
        "model.layers": 2,
        "model.seq_len": 64,
        "parallel.dp": 2,
        "train.steps": 4,
        "train.global_batch": 4,
        "train.micro_batch": 2,
        "train.lr": CALM_LR,
        "train.preempt_grace_s": 1,  # a torn-down rank that hangs is killed after 1 s
        "log.dir": str(tmp_path / "log"),
        "log.quiet": True,
        "data.cache_dir": str(Path(data).parent),
        **overrides,
    }
    code = (
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); import failure_drills; "
        "sys.exit(failure_drills.main(sys.argv[1:]))"
    )
    cmd = [sys.executable, "-c", code, json.dumps(overrides), json.dumps(drills)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for line in (log / failures.FAILURES).read_text().splitlines()]


def test_a_rank_the_nccl_watchdog_aborted_is_recorded_and_named_by_the_restart(tmp_path, data):
    """Rank 1 hangs after step 3; rank 0's collective times out and the watchdog aborts it (its
    line on stderr, then SIGABRT: no Python runs). The agent records rank 0 from its stderr before
    it restarts the workers, and the restarted rank 0's one line names both, as on gloo."""
    out = _drilled(
        tmp_path,
        data,
        {"train.max_restarts": 1, "checkpoint.dir": str(tmp_path / "ckpt"), "checkpoint.interval": 2},
        [{"what": "watchdog", "rank": 0, "step": 3}, {"what": "hang", "rank": 1, "step": 3}],
    )
    console = out.stdout + out.stderr
    assert out.returncode == 0, console[-3000:]
    restarts = [line for line in out.stdout.splitlines() if line.startswith("threefold: restart")]
    assert restarts == [
        "threefold: restart 1 of 1 after rank 1 hung or died (rank 0: NCCL's watchdog aborted it: ALLREDUCE "
        "timed out after 5 s (a peer is hung or dead)); resumed at step 2 from step_00000002"
    ], console[-3000:]
    (record,) = [r for r in _records(tmp_path / "log") if r["attempt"] == 0]
    assert (record["rank"], record["kind"]) == (0, failures.PEER) and record["run"].startswith("threefold-")
    # The aborted worker's stderr reached the console as it was written, and its file is kept.
    assert "Watchdog caught collective operation timeout" in out.stderr
    (stderr,) = (tmp_path / "log" / "workers").glob("*/attempt_0/rank_0.stderr")
    assert "Watchdog caught collective operation timeout" in stderr.read_text()


def test_a_python_exception_names_the_failure_in_the_one_line(tmp_path, data):
    """Rank 1 dies of an AttributeError after step 2 (as a traced MoE step did): the agent gives
    up and the one line names the exception, not only the exit code."""
    out = _drilled(tmp_path, data, {}, [{"what": "raise", "rank": 1, "step": 2, "message": CRASH}])
    assert out.returncode == 1, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("threefold:")]
    assert lines == [
        f"threefold: rank 1: AttributeError: {CRASH}; giving up (train.max_restarts is 0; "
        f"the agent's log: {tmp_path / 'log'}/agent.log)"
    ], out.stderr[-3000:]
    assert "Traceback" not in out.stderr  # the traceback is in agent.log
    assert f"AttributeError: {CRASH}" in (tmp_path / "log" / "agent.log").read_text()


def test_a_worker_names_its_exception_and_leaves_no_process_group(tmp_path, data, capfd, monkeypatch):
    """In-process (no launcher: as under torchrun the worker says it itself): a RuntimeError that
    is no peer's failure is printed in one line, recorded, raised on, and the group is gone."""
    import torch.distributed as dist

    from threefold.training.callbacks import Callbacks
    from threefold.training.worker import run_worker

    from dp_checks import make_cfg

    def boom(step, trainer):
        raise RuntimeError("boom in a callback\nsecond line")

    monkeypatch.delenv(failures.QUIET_ENV, raising=False)  # an earlier launch() in this process set it
    cfg = make_cfg(data, **{"train.steps": 2, "log.dir": str(tmp_path)})
    with pytest.raises(RuntimeError, match="boom in a callback"):
        run_worker(cfg.to_dict(), callbacks=Callbacks(on_step_end=boom))
    assert not dist.is_initialized()
    assert "threefold: rank 0: RuntimeError: boom in a callback\n" in capfd.readouterr().err
    assert failures.summary(tmp_path, 0, 1, run="") == "rank 0: RuntimeError: boom in a callback"


def test_left_behind_files_name_the_ranks_and_an_exception_names_the_failure(tmp_path):
    """The agent's reading of a dead attempt's files (failures.record_left_behind), when it
    restarts or gives up: the watchdog's line, an error file; a rank that left a record is not
    read again, another run's records in the same log.dir do not count."""
    failures.record(tmp_path, 0, 3, "a peer closed its connection (a worker or node died)", run="r")
    failures.record(tmp_path, 0, 2, "a stale record of another run", failures.CRASH, run="old")
    for rank in range(4):
        stderr, error_file = failures.worker_files(tmp_path, "r", 0, rank)
        stderr.parent.mkdir(parents=True, exist_ok=True)
        stderr.write_text(failure_drills.WATCHDOG_LINE.format(rank=rank) if rank in (0, 3) else "warming up\n")
    failures.record_left_behind(tmp_path, "r", 0)
    assert failures.summary(tmp_path, 0, 4, run="r") == (
        "ranks 1, 2 hung or died (rank 3: a peer closed its connection (a worker or node died); "
        "rank 0: NCCL's watchdog aborted it: ALLREDUCE timed out after 5 s (a peer is hung or dead))"
    )
    error_file = failures.worker_files(tmp_path, "r", 1, 1)[1]
    error_file.parent.mkdir(parents=True)
    error_file.write_text(json.dumps({"message": {"message": f"AttributeError: {CRASH}", "extraInfo": {}}}))
    failures.worker_files(tmp_path, "r", 1, 1)[0].write_text("")
    failures.record_left_behind(tmp_path, "r", 1)
    assert failures.summary(tmp_path, 1, 4, run="r") == f"rank 1: AttributeError: {CRASH}"


def test_startup_timeout_is_validated_in_one_line():
    from threefold.config import build_config
    from threefold.validate import validate

    assert build_config(None, []).train.startup_timeout_s >= build_config(None, []).train.timeout_s
    with pytest.raises(ConfigError, match=r"^train.startup_timeout_s: 60 is shorter than train.timeout_s \(300\)"):
        validate(build_config(None, [("train.startup_timeout_s", "60")]))
    with pytest.raises(ConfigError, match="train.startup_timeout_s: must be > 0"):
        validate(build_config(None, [("train.startup_timeout_s", "0"), ("train.timeout_s", "1")]))


@pytest.mark.parametrize("startup_s", [3, 60])
def test_long_host_phases_wait_startup_timeout_s(tmp_path, data, cache_dir, startup_s):
    """train.timeout_s 3: rank 1 spends 6 s before its first step (a compilation) and rank 0 6 s
    in the save (dp rank 0 writes alone at ZeRO 0) while the peer waits in collectives it issued.
    With train.startup_timeout_s 60 the run finishes; with 3 its first step times out. (After
    the first step train.timeout_s holds: test_faults.py's hung rank fails within it.)"""
    overrides = {
        "data.path": data,
        "data.vocab": 256,
        "model.layers": 2,
        "model.seq_len": 64,
        "parallel.dp": 2,
        "train.steps": 2,
        "train.global_batch": 4,
        "train.micro_batch": 2,
        "train.timeout_s": 3,
        "train.startup_timeout_s": startup_s,
        "checkpoint.dir": str(tmp_path / "ckpt"),  # saved after step 2, the last
    }
    cfg = resolved_config(overrides, tmp_path / "log", cache_dir, world=2)
    if startup_s == 60:
        rows = run_ranks(failure_drills.slow_phases, 2, cfg, 6.0, 6.0, timeout=120)
        assert [r["step"] for r in rows] == [2, 2]
        assert [p.name for p in (tmp_path / "ckpt").glob("step_*")] == ["step_00000002"]
        return
    with pytest.raises(AssertionError, match="SystemExit: 1"):
        run_ranks(failure_drills.slow_phases, 2, cfg, 6.0, 0.0, timeout=120)
    whys = {r["rank"]: r["why"] for r in _records(tmp_path / "log")}
    assert whys[0] == "a collective timed out after train.startup_timeout_s = 3 s (a peer is hung or dead)"
