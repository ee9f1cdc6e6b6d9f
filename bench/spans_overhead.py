"""Cost of span recording: the same run with log.spans off and on, side by side.

Each round trains the same config twice through `threefold train` (the production launcher),
once with spans off and once on, the order alternating between rounds to cancel machine
drift. Per-step time is the interval between consecutive metrics lines (everything counts:
the spans' marks, the per-step all-gather, spans.jsonl), after `--warmup` steps. A round is
one run of each; on / off is the median over rounds of the ratio of the two runs' median step
times, with its 95% bootstrap interval (bench/stats.py). Overhead = that ratio - 1.

    python bench/spans_overhead.py [--rounds 4] [--steps 20] [--warmup 4] [--trace | --layers] [-- --parallel.tp 2 ...]

--trace: spans on in both runs, log.trace_steps at its default ('auto': the last report step
before the last) against '' (none). The traced step's recording lands in the interval ending at its
metrics line, and its gathers, replays and trace.json write in the next (a line's time is stamped
before them); so besides the median ratio it reports the traced step's own cost: those two
intervals' sum less twice the run's median interval, on minus off, per round, as a median with its
95% bootstrap interval. (Without --trace, the spans-on run has the default trace too.)

--layers: spans on and the default trace in both runs, log.layer_times false against true: the
cost of timing each layer's forward and backward on the traced step (observe/layers.py), as the
median ratio and as the traced step's own cost, measured as --trace measures it.

Default layout: tiny preset, tp2 x pp2 (4 processes), 1F1B over 4 micro-batches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats import _median, bootstrap, show  # noqa: E402
from timing import cell, on_off_rounds, ratio, steps_of  # noqa: E402

DEFAULT = [
    "--model.preset",
    "tiny",
    "--parallel.tp",
    "2",
    "--parallel.pp",
    "2",
    "--parallel.microbatches",
    "4",
    "--train.global_batch",
    "8",
    "--train.warmup_steps",
    "2",
]


def traced_step(args: list[str], steps: int) -> int:
    """The step that log.trace_steps 'auto' traces in this run (validate.py resolves it)."""
    from threefold.config import build_config, parse_overrides
    from threefold.validate import validate

    return int(validate(build_config(None, parse_overrides([*args, "--train.steps", str(steps)]))).log.trace_steps)


def traced_cost(blocks: dict, step: int, warmup: int):
    """Seconds the traced step adds. In each run, the two intervals that hold its cost (the one
    ending at its metrics line: the recording; the next: gathers, replays, trace.json) summed,
    less twice the median of that run's other intervals, so a run slowed as a whole by a busy
    machine shifts nothing; then with the trace minus without, per round: the median over rounds
    with its bootstrap interval. Interval i of a run ends at step i + 2 + warmup."""
    first = step - 2 - warmup
    if first < 0 or step - warmup > len(blocks["on"][0]):
        raise SystemExit(f"the traced step {step} is outside the timed intervals: use more --steps")

    def excess(run: list[float]) -> float:
        others = run[:first] + run[first + 2 :]
        return sum(run[first : first + 2]) - 2 * statistics.median(others)

    extra = [excess(on) - excess(off) for on, off in zip(blocks["on"], blocks["off"])]
    return bootstrap([extra], _median, f"per-round difference, {len(extra)} rounds")


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ours, _, extra = (
        (argv[: argv.index("--")], None, argv[argv.index("--") + 1 :]) if "--" in argv else (argv, None, [])
    )
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="rounds: one run with spans off, one with spans on")
    ap.add_argument("--steps", type=int, default=20, help="training steps per run")
    ap.add_argument("--warmup", type=int, default=4, help="step intervals dropped at the start of each run")
    ap.add_argument("--quick", action="store_true", help="2 rounds (off, on) of 6 steps: indicative only")
    ap.add_argument(
        "--trace", action="store_true", help="spans on in both: log.trace_steps auto (the default) against ''"
    )
    ap.add_argument(
        "--layers", action="store_true", help="spans and the trace on in both: log.layer_times false against true"
    )
    args = ap.parse_args(ours)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 6, 2
    extra = extra or DEFAULT
    if args.trace:
        return trace_main(extra, args)
    if args.layers:
        return layers_main(extra, args)
    blocks = on_off_rounds(extra, "log.spans", args.rounds, args.steps, args.warmup)
    on_off = ratio(blocks, "on", "off")
    result = {"blocks": blocks, "rounds": args.rounds, "steps": args.steps, "config": " ".join(extra)}
    print(
        f"{args.rounds} rounds (off/on, order alternating) x {args.steps} steps, the first {args.warmup} "
        "intervals of each run dropped; median [IQR] ms/step; on / off: median per-round ratio [95% bootstrap "
        "interval]\n"
    )
    print("| run | spans off (ms/step) | spans on (ms/step) | on / off |")
    print("|---|---|---|---|")
    print(
        f"| `{result['config']}` | {cell(steps_of(blocks['off']))} | {cell(steps_of(blocks['on']))} | {show(on_off)} |"
    )
    return result


def trace_main(extra: list[str], args) -> dict:
    """The --trace comparison: the default one traced step against none, spans on in both."""
    return traced_pair(extra, args, "log.trace_steps", ("", "auto"), "trace", ("trace off", "trace auto"))


def layers_main(extra: list[str], args) -> dict:
    """The --layers comparison: the default traced step with and without per-layer timing."""
    names = ("layer times off", "layer times on")
    return traced_pair(
        [*extra, "--log.trace_steps", "auto"], args, "log.layer_times", ("false", "true"), "layer timing", names
    )


def traced_pair(extra: list[str], args, key: str, values: tuple[str, str], what: str, names: tuple[str, str]) -> dict:
    """Spans on in both runs, `key` at values' off and on: the median ratio, and the traced
    step's own cost (traced_cost)."""
    spans_on = [*extra, "--log.spans", "true"]
    step = traced_step(spans_on, args.steps)
    blocks = on_off_rounds(spans_on, key, args.rounds, args.steps, args.warmup, values=values)
    on_off, cost = ratio(blocks, "on", "off"), traced_cost(blocks, step, args.warmup)
    result = {"blocks": blocks, "rounds": args.rounds, "steps": args.steps, "config": " ".join(spans_on)}
    result["traced"], result["on_off"], result["traced_step_s"] = step, on_off, cost
    print(
        f"{args.rounds} rounds ({what} off/on, order alternating) x {args.steps} steps (auto traces step {step}), "
        f"the first {args.warmup} intervals of each run dropped; median [IQR] ms/step; on / off: median per-round "
        "ratio [95% bootstrap interval]; traced step: the two intervals holding its cost, summed, less twice the "
        "run's median interval, on minus off, median per-round difference in ms [95% bootstrap interval]\n"
    )
    print(f"| run | {names[0]} (ms/step) | {names[1]} (ms/step) | on / off | traced step (ms) |")
    print("|---|---|---|---|---|")
    ms = f"{1e3 * cost.value:.1f} [{1e3 * cost.lo:.1f}, {1e3 * cost.hi:.1f}]"
    print(
        f"| `{result['config']}` | {cell(steps_of(blocks['off']))} | {cell(steps_of(blocks['on']))} | "
        f"{show(on_off)} | {ms} |"
    )
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
