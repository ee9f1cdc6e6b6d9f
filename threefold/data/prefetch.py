"""Prepare the next batches on a background thread while the current step computes.

`get` reports how long it blocked: that is the data-wait time of the step, the number that
says whether the input pipeline (not the model) is the bottleneck.

With a CUDA `device` every tensor of an item is copied into pinned (page-locked) host memory on
the producer thread: a `.to(device, non_blocking=True)` from pinned memory is a DMA that returns
at once, while from pageable memory the copy is staged and the host waits for it. torch's
pinned allocator keeps a block alive until the copies reading it have run, so the batch may be
dropped right after its copy is queued.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")
_POLL_S = 0.05  # how often a blocked put/get re-checks for close() or a dead producer


def pinned(item: Any) -> Any:
    """`item` with every tensor in it (nested in tuples, lists and dicts) in pinned host memory."""
    if isinstance(item, torch.Tensor):
        return item if item.is_pinned() else item.pin_memory()
    if isinstance(item, (list, tuple)):
        return type(item)(pinned(x) for x in item)
    if isinstance(item, dict):
        return {k: pinned(v) for k, v in item.items()}
    return item


class Prefetcher(Generic[T]):
    """Items produce(step) for start_step <= step < end_step, consumed strictly in order;
    pinned for copying to `device` when it is a CUDA device."""

    def __init__(
        self,
        produce: Callable[[int], T],
        start_step: int,
        end_step: int,
        depth: int = 2,
        device: torch.device | str | None = None,
    ):
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        if device is not None and torch.device(device).type == "cuda":
            produce = _pinning(produce)
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


def _pinning(produce: Callable[[int], T]) -> Callable[[int], T]:
    def produce_pinned(step: int) -> T:
        return pinned(produce(step))

    return produce_pinned
