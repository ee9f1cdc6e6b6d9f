"""Ctrl-C and SIGTERM on a running `threefold train`: every rank stops after the same step, saves,
one line is printed, the exit code is the signal's, no worker outlives the agent, and the run
resumes from that checkpoint exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from threefold.training.signals import INTERRUPT, TERMINATE, Stopped, StopSignals

from harness import CALM_LR

STEPS = 40


def _cmd(root: Path, cache_dir: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "threefold", "train", "--parallel.dp", "2", "--train.steps", str(STEPS),
        "--train.lr", str(CALM_LR), "--train.seed", "0", "--log.quiet", "true", "--log.dir", str(root / "log"),
        "--checkpoint.dir", str(root / "ckpt"), "--checkpoint.interval", "100", "--data.cache_dir", cache_dir,
        *extra,
    ]  # fmt: skip


def _rows(root: Path) -> list[dict]:
    path = root / "log" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _alive(session: int) -> list[str]:
    """Processes of the run's session that are still running (zombies waiting for init excluded)."""
    out = subprocess.run(["ps", "-o", "stat=,pid=,cmd=", "-s", str(session)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip() and not line.strip().startswith("Z")]


def _signalled(root: Path, cache_dir: str, sig: int, to_group: bool) -> tuple[int, str]:
    """Start a dp2 run, signal it once three steps are recorded (the whole process group, as a
    terminal's Ctrl-C does, or the agent alone, as `kill` does); returns (exit code, stderr)."""
    proc = subprocess.Popen(
        _cmd(root, cache_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 180
        while len(_rows(root)) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, f"the run ended before it was signalled: {proc.stderr.read()}"
        (os.killpg if to_group else os.kill)(proc.pid, sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(proc.pid), f"workers outlived the agent: {_alive(proc.pid)}"
    return proc.returncode, err


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("straight")
    subprocess.run(_cmd(root, cache_dir), check=True, timeout=300, capture_output=True)
    return _rows(root)


def test_ctrl_c_saves_says_one_line_exits_130_and_resumes_exactly(straight, tmp_path, cache_dir):
    code, err = _signalled(tmp_path, cache_dir, signal.SIGINT, to_group=True)
    stopped = _rows(tmp_path)
    step = stopped[-1]["step"]
    assert code == 130
    assert err.splitlines() == [
        f"threefold: interrupted at step {step}; checkpoint step_{step:08d}; resume with --checkpoint.resume auto"
    ]
    assert (tmp_path / "ckpt" / f"step_{step:08d}").is_dir()
    # Every record up to the stop is the uninterrupted run's, and so is every one after resuming.
    done = subprocess.run(
        _cmd(tmp_path, cache_dir, "--checkpoint.resume", "auto"), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows] == [r["loss"] for r in straight]


def test_sigterm_to_the_agent_saves_and_exits_143(tmp_path, cache_dir):
    code, err = _signalled(tmp_path, cache_dir, signal.SIGTERM, to_group=False)
    step = _rows(tmp_path)[-1]["step"]
    assert code == 143
    assert err.splitlines() == [
        f"threefold: terminated (SIGTERM) at step {step}; checkpoint step_{step:08d}; "
        "resume with --checkpoint.resume auto"
    ]
    assert (tmp_path / "ckpt" / f"step_{step:08d}").is_dir()


def test_handlers_flag_and_a_second_press_is_one_only_when_it_comes_later(monkeypatch):
    stop = StopSignals()
    stop._handle(signal.SIGINT, None)
    stop._handle(signal.SIGINT, None)  # the agent's forward of the same press
    assert stop.requested == INTERRUPT
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    stop.received_at -= 5.0
    stop.speaks = False
    stop._handle(signal.SIGINT, None)
    assert exits == [130]
    stop._handle(signal.SIGTERM, None)
    assert stop.requested == TERMINATE
    assert Stopped(7, TERMINATE, None).exit_code == 143
    assert Stopped(7, INTERRUPT, None).line() == (
        "threefold: interrupted at step 7; nothing saved (checkpoint.dir is not set)"
    )


@pytest.mark.parametrize("settles", [False, True])
def test_a_sigterm_in_a_step_that_then_hangs_exits_when_the_step_is_stuck(monkeypatch, settles):
    # The elastic agent SIGTERMs every worker once a peer failed and waits 30 s for each: a rank
    # hung in its step must not wait out that grace. One whose step settles (its agreement
    # returned: what follows may be the stop's save) is left to finish.
    import threefold.training.signals as signals

    monkeypatch.setattr(signals, "STUCK_S", 0.3)
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    stop = StopSignals(speaks=False)
    stop.boundary()
    stop._handle(signal.SIGTERM, None)  # in-step for ~0 s: deferred, not stuck yet
    assert stop.requested == TERMINATE and exits == []
    if settles:
        stop.settled()
    stop._watch.join(timeout=5)
    assert not stop._watch.is_alive()
    assert exits == ([] if settles else [143])


class _QueuedEvent:
    """A device event as completion_event records it: done once the device got there."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


@pytest.mark.parametrize("completes", [False, True])
def test_a_step_settles_when_its_agreements_event_completes_not_when_it_is_queued(monkeypatch, completes):
    # On CUDA the agreement's all-reduce is only queued when the call returns, and the host runs
    # on into the next step (reads one step late): a rank whose device is hung in that
    # collective is stuck, whatever the host did meanwhile. The watch polls the event.
    import threefold.training.signals as signals

    monkeypatch.setattr(signals, "STUCK_S", 0.3)
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    stop = StopSignals(speaks=False)
    stop.boundary()
    event = _QueuedEvent()
    stop.settled(event)  # queued, not done
    stop._handle(signal.SIGTERM, None)
    assert stop._watch is not None and stop._watch.is_alive()
    stop.boundary()  # the host moves on to the next step
    if completes:
        event.done = True
    stop._watch.join(timeout=5)
    assert not stop._watch.is_alive()
    assert exits == ([] if completes else [143])
    assert signals.completion_event(__import__("torch").device("cpu")) is None  # the CPU's call returned done


@pytest.mark.parametrize("lag", [0, 1])
def test_every_rank_stops_after_the_step_whose_read_shows_the_signal(data, tmp_path, lag):
    """In-process, the loop read at once (CPU) and one step late (CUDA): the signal seen at step 6's
    agreement stops the run after step 6, or after step 7 when step 6 is read once 7 is queued;
    the checkpoint holds the state of the step it is named for (resuming gives the straight run)."""
    import torch

    from threefold.training.trainer import Trainer

    from dp_checks import make_cfg, make_grid

    def trainer(root: Path, **extra) -> Trainer:
        cfg = make_cfg(
            data,
            **{"train.steps": 10, "log.dir": str(root / "log"), "checkpoint.dir": str(root / "ckpt"), **extra},
        )
        stop = StopSignals()
        made = Trainer(cfg, make_grid(), torch.device("cpu"), log=lambda *args: None, stop=stop)
        made.read_lag = lag
        return made

    straight = trainer(tmp_path / "straight")
    straight.train()
    expected = _rows(tmp_path / "straight")
    run = trainer(tmp_path / "run")
    queue = run.queue_step

    def queue_step(step, *args, **kwargs):
        if step == 5:
            run.stop.requested = INTERRUPT
        return queue(step, *args, **kwargs)

    run.queue_step = queue_step
    with pytest.raises(Stopped) as stopped:
        run.train()
    last = 6 + lag
    assert stopped.value.step == last and stopped.value.saved.endswith(f"step_{last:08d}")
    assert [r["loss"] for r in _rows(tmp_path / "run")] == [r["loss"] for r in expected[:last]]
    # One save, of the step the run stopped after (a step read late is past the state: never saved).
    assert sorted(p.name for p in (tmp_path / "run" / "ckpt").glob("step_*")) == [f"step_{last:08d}"]
    again = trainer(tmp_path / "run", **{"checkpoint.resume": "auto"})
    assert again.start_step == last
    again.train()
    assert [r["loss"] for r in _rows(tmp_path / "run")] == [r["loss"] for r in expected]
