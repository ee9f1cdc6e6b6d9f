"""A device-aware interval timer: the seconds a stretch of work took on the device it ran on.

    timer = DeviceTimer(device)
    with timer:             # or token = timer.start(); ...; timer.stop(token)
        launch_kernels()
    timer.seconds           # CPU: summed perf_counter intervals; CUDA: summed event pairs

On CPU the host is the device: an interval is two perf_counter() reads, exactly what the
callers measured before this timer existed. On CUDA the host returns from a kernel launch, a
non-blocking copy or NCCL's wait() (which only makes the stream wait) long before the device is
done, so host time around them measures launches. There each interval is a pair of
torch.cuda.Events recorded on the current stream; nothing synchronizes while they are recorded.
The first read of `seconds` waits for the last recorded event (one synchronize, which the step
pays anyway when it reads its loss) and sums the pairs; reads after that are free until the
next interval is recorded. Read it once per step, after the step's work is launched.
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

    def __enter__(self) -> DeviceTimer:
        self._token = self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop(self._token)

    @property
    def seconds(self) -> float:
        for begin, end in self._pending:
            end.synchronize()  # the first wait drains the queue; the rest return at once
            self._seconds += begin.elapsed_time(end) / 1e3
        self._pending.clear()
        return self._seconds

    def reset(self) -> None:
        self._seconds = 0.0
        self._pending.clear()
