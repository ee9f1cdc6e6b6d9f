"""The live status line on the launching terminal (rank 0 only)."""

from __future__ import annotations

import sys
import time


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class StatusLine:
    """Rewrites one line in place on a terminal; prints every `interval` steps otherwise."""

    def __init__(self, total_steps: int, interval: int, enabled: bool, stream=None):
        self.total, self.interval, self.enabled = total_steps, interval, enabled
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.started = time.perf_counter()
        self.first_step: int | None = None

    def update(self, step: int, loss: float, tokens_per_s: float, mfu: float | None) -> None:
        if not self.enabled:
            return
        if self.first_step is None:
            self.first_step, self.started = step, time.perf_counter()
        done = step + 1 - self.first_step
        left = self.total - step - 1
        eta = (time.perf_counter() - self.started) / max(1, done) * left
        mfu_text = "n/a" if mfu is None else f"{100 * mfu:.1f}%"
        text = (
            f"step {step + 1}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  "
            f"MFU {mfu_text}  ETA {_fmt_duration(eta)}"
        )
        if self.tty:
            self.stream.write("\r\033[K" + text)
            if left == 0:
                self.stream.write("\n")
        elif (step + 1) % self.interval == 0 or left == 0 or done == 1:
            self.stream.write(text + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        if self.enabled:
            self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
            self.stream.flush()
