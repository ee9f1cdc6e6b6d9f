"""A device-aware interval timer: the seconds a stretch of work took on the device it ran on.

    timer = DeviceTimer(device)
    with timer:             # or token = timer.start(); ...; timer.stop(token)
        launch_kernels()
    step_part = timer.take()  # the intervals so far, unread; `timer` starts again from zero
    step_part.seconds       # CPU: summed perf_counter intervals; CUDA: summed event pairs

On CPU the host is the device: an interval is two perf_counter() reads, exactly what the
callers measured before this timer existed. On CUDA the host returns from a kernel launch, a
non-blocking copy or NCCL's wait() (which only makes the stream wait) long before the device is
done, so host time around them measures launches. There each interval is a pair of
torch.cuda.Events recorded on the current stream; nothing synchronizes while they are recorded.

Reading `seconds` is a host read: on CUDA its first read after an interval waits for the
interval's last event (one synchronize), then sums the pairs; reads after that are free until
the next interval is recorded. So read a timer only where the host waits for the device anyway,
once it is past the timed work: a training step hands its timers over unread (`take()`, or the
timer object itself) in its QueuedStep, and read_step reads them after the step's scalars. A
read in the middle of a step would drain the device's queue before the rest of the step is
launched.
"""

from __future__ import annotations

import time

import torch


class DeviceTimer:
    """Accumulated seconds of the intervals between start() and stop() on `device`."""

    def __init__(self, device: torch.device | str | None = None):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self._seconds = 0.0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self):
        """Open an interval; returns the token stop() closes it with."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, token) -> None:
        if not self.cuda:
            self._seconds += time.perf_counter() - token
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((token, end))

    def add(self, seconds: float) -> None:
        """Count host-measured seconds too (e.g. a blocking call that is host time on any device)."""
        self._seconds += seconds

    def take(self) -> DeviceTimer:
        """The intervals recorded so far, moved unread to a new timer; this one starts again from
        zero (a step carries its share to where it is read while the next step records here)."""
        taken = DeviceTimer()
        taken.cuda, taken._seconds, taken._pending = self.cuda, self._seconds, self._pending
        self._seconds, self._pending = 0.0, []
        return taken

    def __enter__(self) -> DeviceTimer:
        self._token = self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop(self._token)

    @property
    def seconds(self) -> float:
        """The summed seconds: a host read (on CUDA it waits for the last interval's end)."""
        for begin, end in self._pending:
            end.synchronize()  # the first wait drains the queue; the rest return at once
            self._seconds += begin.elapsed_time(end) / 1e3
        self._pending.clear()
        return self._seconds

    def reset(self) -> None:
        self._seconds = 0.0
        self._pending.clear()
