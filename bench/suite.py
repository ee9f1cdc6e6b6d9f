"""The plumbing of bench/run.py: a section runs one benchmark script in-process, keeps the
markdown the script prints and the ratios it measured; the writer assembles docs/benchmarks.md
from scratch (machine, date, command, a summary of every ratio, then each section).

A section is a `Script`: the module name of a bench/ script whose `main(argv)` prints
markdown and returns its rows, the argv of a full and of a quick run, and a function from the
returned rows to {ratio name: Interval} (bench/stats.py; a bare float is exact). Goals compare
a ratio with a bound ("<= 0.8"): met when the whole 95% interval is on the right side of it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

BENCH = os.path.dirname(os.path.abspath(__file__))
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from stats import Interval, as_interval, fmt  # noqa: E402


@dataclass
class Result:
    """What one section measured: its markdown, its ratios, and how it was run."""

    name: str
    title: str
    command: str
    body: str
    ratios: dict[str, Interval | float]
    goals: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    error: str = ""
    skipped: str = ""  # why an optional section did not run (its extra is not installed)


@dataclass
class Script:
    """A bench/ script as a suite section. `ratios(rows)` maps what main(argv) returned to
    {name: value}; `goals` maps a ratio name prefix to a bound such as "<= 0.8"."""

    module: str
    title: str
    full: str = ""
    quick: str = "--quick"
    ratios: Callable[[object], dict[str, Interval | float]] = lambda rows: {}
    goals: dict[str, str] = field(default_factory=dict)
    note: str = ""
    label: str = ""  # the section's name when one script runs twice with other arguments
    requires: str = ""  # a module outside the default install (an optional peer); absent: the section is skipped
    install: str = ""  # how to install `requires`, for the skip line

    @property
    def name(self) -> str:
        return self.label or self.module

    def argv(self, quick: bool) -> list[str]:
        return shlex.split(self.quick if quick else self.full)

    def command(self, quick: bool) -> str:
        args = self.quick if quick else self.full
        return f"python bench/{self.module}.py{' ' + args if args else ''}"

    def missing(self) -> str:
        """Why the section cannot run here ('' when it can)."""
        if self.requires and importlib.util.find_spec(self.requires) is None:
            return f"{self.requires} is not installed ({self.install or 'pip install ' + self.requires})"
        return ""

    def run(self, quick: bool) -> Result:
        t0 = time.perf_counter()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rows = importlib.import_module(self.module).main(self.argv(quick))
        body = out.getvalue().strip() + (f"\n\n{self.note}" if self.note else "")
        return Result(
            self.name,
            self.title,
            self.command(quick),
            body,
            self.ratios(rows),
            dict(self.goals),
            time.perf_counter() - t0,
        )


def run_sections(sections: list, quick: bool, log=print) -> list[Result]:
    """Every section in turn; a failing one is reported in its place (one line) and the rest run."""
    results = []
    for s in sections:
        missing = s.missing()
        if missing:
            log(f"bench: {s.name} skipped: {missing}", flush=True)
            results.append(Result(s.name, s.title, s.command(quick), "", {}, skipped=missing))
            continue
        log(f"bench: {s.name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            r = s.run(quick)
        except (Exception, SystemExit) as err:  # a broken section must not hide the others' numbers
            last = (str(err).strip().splitlines() or [type(err).__name__])[-1]
            r = Result(
                s.name, s.title, s.command(quick), "", {}, {}, time.perf_counter() - t0, f"{type(err).__name__}: {last}"
            )
        log(f"bench: {s.name} {'FAILED: ' + r.error if r.error else 'done'} ({r.seconds:.0f} s)", flush=True)
        results.append(r)
    return results


def check_goal(value: float, bound: str) -> bool:
    op, limit = bound.split()
    return {
        "<=": value <= float(limit),
        ">=": value >= float(limit),
        "<": value < float(limit),
        ">": value > float(limit),
    }[op]


def verdict(value: Interval | float, bound: str) -> str:
    """ "yes" when the whole interval meets the bound, "no" when none of it does, "within noise"
    when it straddles the bound. A bound's side is a half-line, so the interval's two ends
    decide for every point between them."""
    interval = as_interval(value)
    ends = [check_goal(interval.lo, bound), check_goal(interval.hi, bound)]
    return "yes" if all(ends) else "no" if not any(ends) else "within noise"


def goal_of(result: Result, ratio: str) -> str:
    return next((bound for prefix, bound in result.goals.items() if ratio.startswith(prefix)), "")


def machine() -> dict:
    """CPU model, cores this process may use, memory, torch/python versions, load, GPU."""
    import torch

    from threefold.observe.host import available_cores, cpu_model

    mem_gib = 0.0
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            mem_gib = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) / 2**20
    cores = available_cores()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return {
        "cpu": cpu_model(),
        "cores": cores,
        "memory_gib": round(mem_gib, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpu": gpu,
        "load_1min": round(load, 2),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def summary_table(results: list[Result]) -> list[str]:
    lines = ["| section | ratio | value | 95% interval | from | goal | met |", "|---|---|---|---|---|---|---|"]
    for r in results:
        if r.error:
            lines.append(f"| {r.name} | - | failed: {r.error} | - | - | - | - |")
        if r.skipped:
            lines.append(f"| {r.name} | - | skipped: {r.skipped} | - | - | - | - |")
        for name, value in r.ratios.items():
            i, goal = as_interval(value), goal_of(r, name)
            span = "-" if i.how == "exact" else f"[{fmt(i.lo)}, {fmt(i.hi)}]"
            cell = name.replace("|", "\\|")  # a ratio's name must not split the table row
            met = verdict(i, goal) if goal else "-"
            lines.append(
                f"| {r.name} | {cell} | {fmt(i.value)} | {span} | {i.how} | {goal or '-'} | "
                f"{'**no**' if met == 'no' else met} |"
            )
    return lines


def write_markdown(results: list[Result], info: dict, command: str, total_s: float, quick: bool) -> str:
    """docs/benchmarks.md, from scratch: every number below comes from this one run."""
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `{command}` on {info['date']} in {total_s / 60:.1f} minutes"
        + (" (**--quick**: few steps, indicative only)" if quick else "")
        + ". "
        "Every number in this file comes from that one run; rerun the command to regenerate it.",
        "",
        f"Machine: {info['cpu']}, {info['cores']} cores available, {info['memory_gib']} GiB memory, "
        f"GPU: {info['gpu']}; torch {info['torch']}, Python {info['python']}; CPU runs use gloo and one "
        f"OMP thread per rank; 1-minute load average {info['load_1min']} at the start.",
        "",
        "Contestants of a comparison run in the same processes and alternate in blocks (A, B, A, B ...); "
        "a round is one A block and one B block timed back to back, so machine drift hits both alike. "
        "Each round gives one ratio (A's median step time over B's); a timed comparison reports the median "
        "of the per-round ratios with a 95% percentile-bootstrap interval of that median (4000 "
        "resamplings, fixed seed; bench/stats.py). Other measured quantities (bubble, hidden communication, "
        "collective cost) are bootstrapped over their samples, and deterministic ones (memory, bytes, loss "
        "differences) are exact. A goal is met (yes) only when the whole interval clears it, missed "
        '(**no**) when the whole interval is on the wrong side, and "within noise" when the interval '
        "straddles the bound (always so for a single round, which has no interval). Tables show times "
        "as medians with their interquartile range. Ratios are threefold / peer for times (lower is "
        "better) and threefold / peer for tokens/s (higher is better), as named. With more ranks than "
        "cores the step times measure oversubscription, not scaling; ratios still compare like with "
        "like.",
        "",
        "## Summary",
        "",
    ]
    lines += summary_table(results)
    for r in results:
        lines += ["", f"## {r.title}", "", f"`{r.command}` ({r.seconds:.0f} s)", ""]
        lines.append(
            f"Failed in this run: {r.error}"
            if r.error
            else f"Skipped in this run: {r.skipped}"
            if r.skipped
            else r.body
        )
    lines += [
        "",
        "## Adding a section",
        "",
        "A section is one `Script(...)` entry in `SECTIONS` in bench/run.py: the bench/ script's module "
        "name, a title, the arguments of a full and of a quick run, a function from what its "
        "`main(argv)` returns to named ratios (bench/stats.py Intervals: `paired_ratio` of per-round "
        "times, `bootstrap_median` of samples, `exact`; a bare float counts as exact), and optional "
        "goals. The script's `main(argv)` prints markdown (its tables) and returns its rows, per-round "
        "data included; run.py calls it in-process and keeps both.",
        "",
    ]
    return "\n".join(lines)


def interval_json(value: Interval | float) -> dict:
    """value, lo, hi, n, how; an unbounded end (a single round) as null."""
    return {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(as_interval(value)).items()
    }


def write_json(path: str, results: list[Result], info: dict, command: str) -> None:
    data = {
        "machine": info,
        "command": command,
        "sections": [
            {
                "name": r.name,
                "title": r.title,
                "command": r.command,
                "seconds": r.seconds,
                "ratios": {k: interval_json(v) for k, v in r.ratios.items()},
                "goals": r.goals,
                "verdicts": {k: verdict(v, goal_of(r, k)) for k, v in r.ratios.items() if goal_of(r, k)},
                "error": r.error,
                "skipped": r.skipped,
            }
            for r in results
        ],
    }
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
