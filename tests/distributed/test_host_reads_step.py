"""Nothing inside Trainer.queue_step makes the host wait for the device (issue 32): the step's
data-parallel and ZeRO-3 timers travel unread in its QueuedStep and read_step reads them, the
straggler check takes the newest read step's schedule figures, and reading one step late
(forced on CPU here, with the fused AdamW CUDA runs) keeps the device's queue full. On CPU
nothing waits, so the calls themselves are counted (tests/host_reads.py): a value read to the
host, or a DeviceTimer read, which on CUDA synchronizes on its events."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from host_reads import FakeCudaEvent, HostReads

from threefold.distributed import timer as timer_mod
from threefold.distributed.timer import DeviceTimer
from threefold.training.trainer import Trainer

from dp_checks import make_cfg, make_grid
from harness import run_ranks

STEPS = 4  # the last is read at once (a report step), the others one step late


def _train_counting(data: str, log_dir: str, dp: int = 1, **extra) -> tuple[list[dict], list[dict], list[float]]:
    """Trainer.train() read one step late on this rank; returns each queue_step's host reads, by
    name, rank 0's metrics records, and the seconds of each step's own exposed-reduction timer
    (the one its finish() made, read after the run)."""
    cfg = make_cfg(
        data,
        **{
            "train.steps": STEPS,
            "log.interval": 100,
            "log.dir": log_dir,
            "checkpoint.dir": "",
            "parallel.dp": dp,
            **extra,
        },
    )
    grid = make_grid(list(range(dp)), dist.group.WORLD) if dp > 1 else make_grid()
    trainer = Trainer(cfg, grid, torch.device("cpu"), log=lambda *args: None)
    trainer.read_lag = 1  # the CUDA loop
    for part in trainer.engine.parts:
        part.optimizer.fused = True  # CUDA's AdamW: the skip is decided on the device
    counts, queue_step = [], trainer.queue_step
    grads, finished = trainer.engine.grads, []
    finish = grads.finish

    def finish_and_keep() -> None:
        finish()
        finished.append(grads.exposed)

    grads.finish = finish_and_keep

    def counted(*args, **kwargs):
        with HostReads() as reads:
            queued = queue_step(*args, **kwargs)
        counts.append(dict(reads.calls))
        return queued

    trainer.queue_step = counted
    trainer.train()
    metrics = Path(log_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if grid.global_rank == 0 else []
    return counts, rows, [t.seconds for t in finished]


def test_queue_step_reads_nothing_on_the_host_at_dp1(data, tmp_path):
    counts, rows, exposed = _train_counting(data, str(tmp_path / "log"))
    assert counts == [{}] * STEPS, counts
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # Still measured: each record has its own step's timer, though the next step ran before
    # a late step was read.
    assert [r["dp_exposed_s"] for r in rows] == exposed


def _dp2_worker(data: str, root: str) -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {}
    for zero in (0, 3):
        out[zero] = _train_counting(data, f"{root}/zero{zero}-rank{rank}", dp=2, **{"parallel.zero": zero})
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_queue_step_reads_nothing_on_the_host_at_dp2_and_zero3(data, tmp_path):
    results = run_ranks(_dp2_worker, 2, data, str(tmp_path), timeout=600)
    for rank, res in enumerate(results):
        for zero, (counts, _, _) in res.items():
            assert counts == [{}] * STEPS, f"rank {rank} zero {zero}: {counts}"
    (_, zero0, exposed0), (_, zero3, exposed3) = results[0][0], results[0][3]
    assert [r["step"] for r in zero3] == list(range(1, STEPS + 1))
    # The step's own exposed reduction (waits on gloo: more than zero), and ZeRO 3's gather
    # wait once per step, read with the step's scalars.
    assert [r["dp_exposed_s"] for r in zero0 + zero3] == exposed0 + exposed3 and min(exposed0 + exposed3) > 0
    assert all(r["zero3_gather_wait_s"] >= 0 for r in zero3) and all("zero3_gather_wait_s" not in r for r in zero0)


def _interval(timer: DeviceTimer, width: float) -> None:
    token = timer.start()
    FakeCudaEvent.clock += width
    timer.stop(token)
    FakeCudaEvent.clock += 10.0


def test_a_taken_timer_keeps_its_intervals_unread_and_the_next_ones_go_to_the_timer(monkeypatch):
    """What a queued step carries on CUDA: its own event pairs, resolved when read, none of the
    intervals recorded after it was queued (the next step's), and no wait before the read."""
    monkeypatch.setattr(timer_mod.torch.cuda, "Event", FakeCudaEvent)
    FakeCudaEvent.clock, FakeCudaEvent.syncs = 0.0, 0
    timer = DeviceTimer(torch.device("cuda", 0))
    _interval(timer, 0.25)
    _interval(timer, 0.5)
    step = timer.take()
    _interval(timer, 2.0)  # the next step's
    assert FakeCudaEvent.syncs == 0
    assert step.seconds == pytest.approx(0.75) and FakeCudaEvent.syncs >= 1
    assert timer.seconds == pytest.approx(2.0)
    assert timer.take().seconds == pytest.approx(2.0) and timer.seconds == 0.0
