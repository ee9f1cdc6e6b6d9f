"""Timing contestants side by side: blocks alternate A, B, A, B ... and a round is one block of
each, so a slow drift of a shared machine hits both halves of a round alike. Times are kept
per round (a list of step seconds per block) for the per-round ratios of bench/stats.py."""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from stats import Interval, paired_ratio

Blocks = dict[str, list[list[float]]]  # contestant -> per round, the seconds of each step


def alternate(
    contestants: dict[str, Callable[[], object]],
    rounds: int,
    steps: int,
    barrier: Callable[[], object] = lambda: None,
    warmup: int = 0,
) -> Blocks:
    """`warmup` untimed steps per contestant, then `rounds` rounds of `steps` steps per
    contestant, in the order given. A step's time is the interval between consecutive step
    ends, the first measured from the end of the barrier (so whatever a step leaves running on
    other ranks is waited for by the barrier, not charged to the next contestant)."""
    for step in contestants.values():
        for _ in range(warmup):
            step()
    times: Blocks = {name: [] for name in contestants}
    for _ in range(rounds):
        for name, step in contestants.items():
            barrier()
            block, last = [], time.perf_counter()
            for _ in range(steps):
                step()
                now = time.perf_counter()
                block.append(now - last)
                last = now
            times[name].append(block)
    return times


def feeder(step: Callable, batches: list, *args) -> Callable[[], object]:
    """A call without arguments running step(next batch, *args), the batches cycling: every
    contestant fed this way walks the same batches in the same order."""
    it = itertools.cycle(batches)
    return lambda: step(next(it), *args)


def round_medians(blocks: list[list[float]]) -> list[float]:
    """One value per round: the median of that round's step times."""
    return [statistics.median(block) for block in blocks]


def ratio(blocks: Blocks, a: str, b: str) -> Interval:
    """a / b as the median per-round ratio of round medians, with its bootstrap interval."""
    return paired_ratio(round_medians(blocks[a]), round_medians(blocks[b]))


def summary(samples: list[float]) -> tuple[float, float, float]:
    """Median and the 25th/75th percentiles (never outside the data) of step times."""
    if len(samples) < 2:
        return samples[0], samples[0], samples[0]
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return statistics.median(samples), q[0], q[2]


def steps_of(blocks: list[list[float]]) -> list[float]:
    """Every step time of a contestant, rounds concatenated."""
    return [t for block in blocks for t in block]


def cell(samples: list[float]) -> str:
    """ "123.4 [110-131]": median [IQR] in milliseconds."""
    med, lo, hi = summary(samples)
    return f"{med * 1e3:.1f} [{lo * 1e3:.0f}-{hi * 1e3:.0f}]"


def train_step_times(args: list[str], steps: int, warmup: int) -> list[float]:
    """Step times of one `threefold train` run (the production launcher) with `args`: the
    intervals between consecutive metrics lines, after the first `warmup`. Everything a step
    costs counts, the metrics line included."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "threefold",
            "train",
            *args,
            "--train.steps",
            str(steps),
            "--log.dir",
            tmp,
            "--log.quiet",
            "true",
        ]
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL)
        stamps = [json.loads(line)["time"] for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    return [b - a for a, b in zip(stamps, stamps[1:])][warmup:]


def on_off_rounds(
    args: list[str], key: str, rounds: int, steps: int, warmup: int, values: tuple[str, str] = ("false", "true")
) -> Blocks:
    """`rounds` pairs of `threefold train` runs with `key` set to values' off and on, the order
    alternating between rounds to cancel machine drift: {"on": [...], "off": [...]} per round."""
    blocks: Blocks = {"off": [], "on": []}
    for r in range(rounds):
        for on in (False, True) if r % 2 == 0 else (True, False):
            value = values[1] if on else values[0]
            blocks["on" if on else "off"].append(train_step_times([*args, f"--{key}", value], steps, warmup))
    return blocks
