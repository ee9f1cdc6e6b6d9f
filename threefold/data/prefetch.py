"""Prepare the next batches on a background thread while the current step computes.

`get` reports how long it blocked: that is the data-wait time of the step, the number that
says whether the input pipeline (not the model) is the bottleneck.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
_POLL_S = 0.05  # how often a blocked put/get re-checks for close() or a dead producer


class Prefetcher(Generic[T]):
    """Items produce(step) for start_step <= step < end_step, consumed strictly in order."""

    def __init__(self, produce: Callable[[int], T], start_step: int, end_step: int, depth: int = 2):
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        self._produce, self._next, self._end = produce, start_step, end_step
        self._stop = threading.Event()
        self._thread = None
        if depth > 0 and start_step < end_step:
            self._queue: queue.Queue = queue.Queue(depth)
            self._thread = threading.Thread(
                target=self._run, args=(start_step,), name="threefold-prefetch", daemon=True
            )
            self._thread.start()

    def _run(self, step: int) -> None:
        while step < self._end and not self._stop.is_set():
            try:
                entry = (step, self._produce(step), None)
            except BaseException as e:  # handed to the consumer, which re-raises it
                entry = (step, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(entry, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if entry[2] is not None:
                return
            step += 1

    def get(self, step: int) -> tuple[T, float]:
        """(item for `step`, seconds spent blocked waiting for it)."""
        if self._stop.is_set():
            raise RuntimeError("Prefetcher.get after close()")
        if step != self._next:
            raise RuntimeError(
                f"Prefetcher: asked for step {step}, expected {self._next} (steps must be consumed in order)"
            )
        if not step < self._end:
            raise RuntimeError(f"Prefetcher: step {step} is past the end step {self._end}")
        t0 = time.perf_counter()
        if self._thread is None:  # depth 0: produce inline, all of it counts as waiting
            item = self._produce(step)
            self._next += 1
            return item, time.perf_counter() - t0
        while True:
            try:
                got, item, err = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("Prefetcher: producer thread exited unexpectedly") from None
        wait = time.perf_counter() - t0
        if err is not None:
            self.close()
            raise err
        assert got == step, (got, step)  # the producer emits steps in order by construction
        self._next += 1
        return item, wait

    def close(self, timeout: float = 5.0) -> None:
        """Stop the producer. It finishes the item it is making (a produce call cannot be
        interrupted) and is then joined; a daemon thread never blocks interpreter exit."""
        self._stop.set()
        if self._thread is not None:
            while True:  # free a slot so a blocked put notices the stop at once
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            if self._thread is not threading.current_thread():
                self._thread.join(timeout)

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
