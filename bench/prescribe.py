"""Does applying `threefold report`'s prescription make the run faster?

For each knob pathology of issue #20 (too few micro-batches for pp 4, gradient buckets far too
small or too large, data.prefetch 0 with a slowed source, full recompute where memory allows
none) this trains the pathological config once with spans on, asks the report's diagnosis
(analysis.prescribe with the planner) for its prescription for the cost the pathology creates
(COST: usually its first one; the table gives its place in the list), then measures tokens/s of
the config before and after the knob change: `--rounds` rounds of one short run each way in
the same process group (order alternating between rounds), each run's median tokens/s over its
steps after `--warmup`; after / before is the median per-round ratio with its 95% bootstrap
interval (bench/stats.py). Spans are off in the timed runs.

pp 4 on fewer than four cores loses to its bubble only what leaves a core idle: a rank waiting in
the bubble gives its core to the others. At 4 micro-batches the two cores are already busy, the
planner predicts nothing from more and the report says so ("pp4 m4"); at 1 or 2 they are not
("pp4 m1", "pp4 m2"), and "pp2 m2" is the same pathology with a core per rank.

The slowed data source is the sampler sleeping `--data-sleep` seconds per step, patched into the
single process that trains (world 1, so no spawned process misses the patch).

    python bench/prescribe.py [--rounds 3] [--steps 10] [--warmup 3] [--only NAME ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]
from stats import paired_ratio, show  # noqa: E402

from harness import run_training, run_training_many  # noqa: E402

TINY = {"model.preset": "tiny", "train.warmup_steps": 2, "train.lr": 5e-4}
# Many small parameters on a short step: one bucket per parameter makes ~170 reductions of a few
# KiB, each paying a collective's fixed cost.
NARROW_DEEP = {
    "model.layers": 24,
    "model.hidden": 64,
    "model.ffn_hidden": 176,
    "model.seq_len": 32,
    "train.micro_batch": 4,
}
# One bucket only costs what it fails to overlap: the reduction after backward. Wider still, on
# short sequences, the gradients (84 MB) are large against the step's compute.
HEAVY = {"model.hidden": 512, "model.ffn_hidden": 1408, "model.seq_len": 16}
PATHOLOGIES = {
    "pp4 m1": {"parallel.pp": 4, "train.global_batch": 16, "train.micro_batch": 16},
    "pp4 m2": {"parallel.pp": 4, "train.global_batch": 16, "train.micro_batch": 8},
    "pp4 m4": {"parallel.pp": 4, "train.global_batch": 16, "train.micro_batch": 4},
    "pp2 m2": {"parallel.pp": 2, "train.global_batch": 16, "train.micro_batch": 8},
    "dp2 tiny buckets": {**NARROW_DEEP, "parallel.dp": 2, "parallel.bucket_mb": 0.002, "train.global_batch": 8},
    "dp2 one bucket": {
        **HEAVY,
        "parallel.dp": 2,
        "parallel.bucket_mb": 1000,
        "train.global_batch": 4,
        "train.micro_batch": 2,
    },
    "prefetch 0, slow data": {"data.prefetch": 0, "train.global_batch": 8, "train.micro_batch": 4},
    "full recompute": {"train.recompute": "full", "train.global_batch": 8, "train.micro_batch": 4},
}
SLOW_DATA = "prefetch 0, slow data"
# The cost each pathology creates. The knob applied is the report's prescription for that cost:
# its first one when the cost is the biggest, else the one further down the report's list (the
# table says where), since on this host another cost may outweigh it (the optimizer's AdamW on
# one core outweighs a 46 MiB reduction).
COST = {
    "pp4 m1": "pp_bubble",
    "pp4 m2": "pp_bubble",
    "pp4 m4": "pp_bubble",
    "pp2 m2": "pp_bubble",
    "dp2 tiny buckets": "dp_exposed",
    "dp2 one bucket": "dp_exposed",
    SLOW_DATA: "data_wait",
    "full recompute": "recompute",
}


def world_of(over: dict) -> int:
    return over.get("parallel.dp", 1) * over.get("parallel.tp", 1) * over.get("parallel.pp", 1)


def slow_sampler(seconds: float):
    """Make this process's sampler sleep `seconds` per step (the slowed data source); returns
    the function that undoes it."""
    from threefold.training.trainer import Trainer

    batches = Trainer.batches

    def slowed(self, step):
        time.sleep(seconds)
        return batches(self, step)

    Trainer.batches = slowed
    return lambda: setattr(Trainer, "batches", batches)


def train(runs: dict[str, dict], root: Path, cache: str, world: int) -> dict[str, list[dict]]:
    if world == 1:  # in this process: the data patch holds
        return {name: run_training(over, root / name, cache) for name, over in runs.items()}
    return run_training_many(runs, root, cache, world)


def prescription(path: Path, cost: str):
    """(the finding for `cost`, its best knob, its place in the report's list from 1); the
    report's first finding and no knob when the report does not list that cost."""
    from threefold.analysis.prescribe import best_knob, diagnose
    from threefold.analysis.rundir import load_run
    from threefold.analysis.summary import summarize
    from threefold.planner.predict import RunPredictor

    run = load_run(path)
    found = diagnose(summarize(run), run.config, RunPredictor(run.info))
    for place, finding in enumerate(found, 1):
        if finding.category == cost:
            return finding, best_knob(finding), place
    return (found[0] if found else None), None, None


def measure(name: str, over: dict, args, root: Path, cache: str) -> dict:
    base = {**TINY, **over, "train.steps": args.steps}
    world = world_of(over)
    # The last two steps traced: their collectives are also replayed alone (dp_comm_serial_s).
    traced = f"{args.steps - 1},{args.steps}"
    diagnosed = {**base, "log.spans": "true", "log.interval": 1, "log.trace_steps": traced}
    train({"diagnosed": diagnosed}, root / name, cache, world)
    finding, knob, place = prescription(root / name / "diagnosed", COST[name])
    out = {"pathology": name, "finding": finding.text() if finding else None, "knob": None, "place": place}
    if knob is None:
        return out
    after = {**base, **{k: str(v).lower() if isinstance(v, bool) else v for k, v in knob.changes.items()}}
    runs = {}
    for i in range(args.rounds):  # before/after alternate in order between rounds
        pair = (("before", base), ("after", after)) if i % 2 == 0 else (("after", after), ("before", base))
        runs.update({f"{which}{i}": cfg for which, cfg in pair})
    metrics = train(runs, root / name, cache, world)
    tps = {k: statistics.median(r["tokens_per_s"] for r in v[args.warmup :]) for k, v in metrics.items()}
    before = [tps[f"before{i}"] for i in range(args.rounds)]
    later = [tps[f"after{i}"] for i in range(args.rounds)]
    ratio = paired_ratio(later, before)
    out.update(
        knob=knob.cli(),
        predicted=knob.gain,
        source=knob.source,
        before_tokens_per_s=before,
        after_tokens_per_s=later,
        ratio=ratio.__dict__,
        ratio_text=show(ratio),
    )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of one run before and one after the change")
    ap.add_argument("--steps", type=int, default=10, help="training steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="steps dropped at the start of each run")
    ap.add_argument("--data-sleep", type=float, default=0.08, help="seconds the slowed sampler sleeps per step")
    ap.add_argument("--only", nargs="+", choices=list(PATHOLOGIES), help="run only these pathologies")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="threefold-prescribe-") as tmp:
        root, cache = Path(tmp), str(Path(tmp) / "cache")
        for name in args.only or PATHOLOGIES:
            undo = slow_sampler(args.data_sleep) if name == SLOW_DATA else (lambda: None)
            t0 = time.perf_counter()
            try:
                results.append(measure(name, PATHOLOGIES[name], args, root, cache))
            finally:
                undo()
            results[-1]["wall_s"] = time.perf_counter() - t0
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(
        f"The report's prescription for the pathology's cost applied: {args.rounds} rounds of one run "
        "before and one after (order alternating), "
        f"{args.steps} steps each, median tokens/s after the first {args.warmup}; after / before = median "
        "per-round ratio [95% bootstrap interval]. Tiny preset on this host's CPU cores (gloo).\n"
    )
    print(
        "| pathology | prescription for its cost | place in the report | predicted | before tokens/s "
        "| after tokens/s | after / before |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if r["knob"] is None:
            what = r["finding"] or "nothing above 3% of the step"
            print(f"| {r['pathology']} | {what} (no knob) | {r['place'] or 'not listed'} | | | | |")
            continue
        gain = "n/a" if r["predicted"] is None else f"{r['predicted']:+.0%} ({r['source']})"
        print(
            f"| {r['pathology']} | `{r['knob']}` | {r['place']} | {gain} | "
            f"{statistics.median(r['before_tokens_per_s']):,.0f} | "
            f"{statistics.median(r['after_tokens_per_s']):,.0f} | {r['ratio_text']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
