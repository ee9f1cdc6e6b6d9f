"""Ctrl-C and a scheduler's SIGTERM, turned into a stop at a step boundary that every rank agrees on.

    stop = StopSignals.install()     # in each worker's main thread, before training
    stop.requested                   # 0, INTERRUPT (SIGINT) or TERMINATE (SIGTERM): this rank's
    ...                              # the trainer puts it into the step's MAX all-reduce, so every
                                     # rank stops after the same step, saves, and raises Stopped

A first SIGINT finishes the step, saves (when checkpoint.dir is set) and exits 130; a second one,
pressed later, exits at once with one line. SIGTERM (Slurm's warning before its kill) saves at
the next step boundary and exits 143; `train.preempt_grace_s` is how long the elastic agent lets
the workers take before it kills them. The handlers only set a flag: the collective and the save
happen in the loop, never inside a signal handler.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch

INTERRUPT, TERMINATE = 1, 2
EXIT_CODE = {INTERRUPT: 128 + signal.SIGINT, TERMINATE: 128 + signal.SIGTERM}
STUCK_S = 10.0
"""A SIGTERM that finds this rank in a step (or a save) longer than this and than 3x the longest
one so far treats the rank as hung (the elastic agent tears down a group whose peer failed with
SIGTERM and waits 30 s for each process): it exits at once rather than wait for a boundary it
will not reach. One that comes sooner is watched: if the step outlasts that bound before the
next boundary, the rank exits then."""
SAME_PRESS_S = 1.0
"""A terminal's Ctrl-C reaches a worker directly and again through the elastic agent, which
forwards what it received: two SIGINTs this close together are one press."""


class Stopped(Exception):
    """Every rank stopped after `step` (counted from 1) on `kind`; `saved`: the checkpoint
    directory written for it, or None."""

    def __init__(self, step: int, kind: int, saved: str | None):
        super().__init__(f"stopped at step {step}")
        self.step, self.kind, self.saved = step, kind, saved

    @property
    def exit_code(self) -> int:
        return EXIT_CODE[self.kind]

    def line(self) -> str:
        what = "interrupted" if self.kind == INTERRUPT else "terminated (SIGTERM)"
        if self.saved is None:
            return f"threefold: {what} at step {self.step}; nothing saved (checkpoint.dir is not set)"
        return (
            f"threefold: {what} at step {self.step}; checkpoint {os.path.basename(self.saved)}; "
            "resume with --checkpoint.resume auto"
        )


def completion_event(device: torch.device):
    """An event recorded now on `device`'s current stream: it completes once the work queued there
    so far has (on CUDA a collective's call returns when it is queued, not done). None on the
    CPU, where the call returned with its work done."""
    if device.type == "cpu":
        return None
    event = torch.Event(device=device)
    event.record(torch.accelerator.current_stream(device))
    return event


class StopSignals:
    def __init__(self, speaks: bool = True):
        self.speaks = speaks  # one rank says it, not every one
        self.requested = 0
        self.received_at: float | None = None
        self._boundary: float | None = None  # when the loop last finished a step
        self._longest = 0.0
        self._previous: dict = {}
        self._watch: threading.Thread | None = None
        # The boundary of the last step whose agreement was issued, and the event that completes
        # with it (None: it had completed when settled() was called).
        self._settled: tuple[float | None, object] = (None, None)

    @classmethod
    def install(cls, speaks: bool = True) -> StopSignals:
        """Handlers for SIGINT and SIGTERM in this (main) thread; uninstall() restores the old ones."""
        stop = cls(speaks)
        for sig in (signal.SIGINT, signal.SIGTERM):
            stop._previous[sig] = signal.signal(sig, stop._handle)
        return stop

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def boundary(self) -> None:
        """The loop is between two steps (called before each one and after the last)."""
        now = time.monotonic()
        if self._boundary is not None:
            self._longest = max(self._longest, now - self._boundary)
        self._boundary = now

    def settled(self, done=None) -> None:
        """This step's agreement (the collective that carries the stop flag) was issued. `done`:
        an event recorded after it on the run's device (completion_event), or None where the call
        returned with the collective complete (CPU/gloo). Once it has completed the rank is not
        hung in this step, and what follows in it may be the stop's save."""
        self._settled = (self._boundary, done)

    def _agreed_since(self, began: float) -> bool:
        """Whether the agreement of the step that began at `began`, or of a later one, completed."""
        boundary, done = self._settled
        if boundary is None or boundary < began:
            return False
        try:
            return done is None or bool(done.query())
        except RuntimeError:  # the device or its communicator failed: not settled
            return False

    def _stuck_after(self) -> float:
        """Seconds in one step (or save) after which the rank counts as hung."""
        return max(STUCK_S, 3 * self._longest)

    def _stuck(self, now: float) -> bool:
        return self._boundary is not None and now - self._boundary > self._stuck_after()

    def _watch_step(self) -> None:
        """After a deferred SIGTERM: exit if the rank becomes stuck (in this step, or a later one
        the host moved on to) before an agreement from this step on has completed on the device
        (settled). A thread, since a hung main thread runs no handler; on CUDA the host runs ahead
        of the device, so the watch polls the agreement's event. The stop's save comes after the
        agreement (and the host read that waits for it), so the watch never cuts it short."""
        began = self._boundary
        if began is None or self._agreed_since(began) or (self._watch is not None and self._watch.is_alive()):
            return

        def watch() -> None:
            while not self._agreed_since(began):
                now = time.monotonic()
                if self._stuck(now):
                    os._exit(EXIT_CODE[TERMINATE])
                    return  # only reached where os._exit is a test's stand-in
                time.sleep(min(1.0, max(0.01, (self._boundary or began) + self._stuck_after() - now)))

        self._watch = threading.Thread(target=watch, name="threefold-stuck-step", daemon=True)
        self._watch.start()

    def _handle(self, signum, _frame) -> None:
        now = time.monotonic()
        if signum == signal.SIGTERM and self._stuck(now):
            os._exit(EXIT_CODE[TERMINATE])
        if signum == signal.SIGTERM:
            self.requested = TERMINATE
            self._watch_step()
        elif self.requested and now - (self.received_at or now) > SAME_PRESS_S:
            # A second Ctrl-C: the user will not wait for the step and the save.
            if self.speaks:
                sys.stderr.flush()
                os.write(2, b"threefold: interrupted again: stopping now, without saving\n")
            os._exit(EXIT_CODE[INTERRUPT])
        else:
            self.requested = max(self.requested, INTERRUPT)
        if self.received_at is None:
            self.received_at = now
