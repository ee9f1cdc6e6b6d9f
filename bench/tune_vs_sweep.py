"""`threefold tune` against an exhaustive measured sweep of the same space.

    python bench/tune_vs_sweep.py                        # sweep every candidate, then tune cold
    python bench/tune_vs_sweep.py --reuse                # keep sweep trials that finished

Space (issue #20's suggestion): one preset on 4 processes; every (dp, tp, pp) with product 4 x
micro-batches {2, 4, 8} x schedule {1f1b, interleaved} x ZeRO {0, 1}. Knobs that cannot matter
collapse (schedule at pp 1, ZeRO at dp 1) and the trainer's rules refuse a few (interleaving
needs >= 2 layers per stage), so the sweep runs every DISTINCT runnable candidate once. Both
contestants run each trial the same way: `threefold train --config trial.toml` for --steps
steps (tune/trials.py), the first fifth untimed, tokens/s from the median step.

The tune runs cold (no cache) with a budget of a quarter of the sweep's trials. Reported:
- the sweep's best and the tune's winner, and the ratio of the winner's tokens/s (as the sweep
  measured it) to the sweep best's, with a 95% bootstrap interval over the two runs' step times:
  "within noise" when the interval reaches 1;
- trial counts; where the winner ranks in the sweep;
- Kendall's tau over the whole sweep: the planner before any trial, and calibrated on the
  tune's trials, against the sweep's measured tokens/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPACE = ["microbatches=2,4,8", "schedule=1f1b,interleaved", "zero=0,1"]


def step_times(path: str) -> list[float]:
    """The timed steps of a trial (the ones planner/runs.py takes the median of)."""
    rows = [json.loads(x) for x in (Path(path) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    times = [r["step_time_s"] for r in rows if isinstance(r.get("step_time_s"), (int, float))]
    return times[max(1, len(times) // 5) :]


def sweep(cfg, space, out: Path, steps: int, reuse: bool, timeout: float) -> dict:
    from threefold.planner.tune.trials import measure, run_trial

    results = {}
    for i, cand in enumerate(space.candidates, 1):
        run_dir = out / cand.name
        if reuse and (run_dir / "metrics.jsonl").is_file() and (run_dir / "run.json").is_file():
            result = measure(cand.name, run_dir, 0.0)
        else:
            result = run_trial(cfg, cand, run_dir, steps, timeout)
        results[cand.name] = result
        shown = f"{result.tokens_per_s:,.0f} tokens/s" if result.status == "ok" else result.reason
        print(f"sweep {i}/{len(space.candidates)} {cand.name}: {result.status} {shown}", flush=True)
    (out / "results.json").write_text(json.dumps({n: r.as_dict() for n, r in results.items()}, indent=1))
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default="runs/tune_vs_sweep")
    ap.add_argument("--reuse", action="store_true", help="keep sweep trials that finished")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--confirm", type=int, default=3, help="paired rounds re-measuring the sweep best and the winner")
    args = ap.parse_args()

    from threefold.analysis.intervals import bootstrap
    from threefold.api import configure
    from threefold.planner.categories import kendall_tau
    from threefold.planner.tune.loop import TuneOptions, Tuner
    from threefold.planner.tune.output import write_outputs
    from threefold.planner.tune.space import Space

    cfg = configure(None, ["--model.preset", args.preset, "--train.global_batch", str(args.global_batch)])
    space = Space.parse(cfg, args.nproc, SPACE)
    out = Path(args.out)
    t0 = time.perf_counter()
    swept = sweep(cfg, space, out / "sweep", args.steps, args.reuse, args.timeout)
    sweep_s = time.perf_counter() - t0
    ok = {n: r for n, r in swept.items() if r.status == "ok"}
    best_name = max(ok, key=lambda n: ok[n].tokens_per_s)

    budget = len(space.candidates) // 4
    t1 = time.perf_counter()
    tuner = Tuner(
        cfg, args.nproc, space, TuneOptions(out=str(out / "tune"), trials=budget, steps=args.steps, cache="none")
    )
    result = tuner.run()
    tune_s = time.perf_counter() - t1
    write_outputs(result, cfg, out / "tune")
    winner = result.best.name

    def _ratio(b, w):  # tokens/s of the winner over the sweep best's = best's median step / winner's
        import numpy as np

        return np.median(b, axis=-1) / np.median(w, axis=-1)

    vs = bootstrap([step_times(ok[best_name].path), step_times(ok[winner].path)], _ratio, "ratio of median steps")
    own = bootstrap(
        [step_times(ok[best_name].path), step_times(result.best_result.path)], _ratio, "ratio of median steps"
    )
    ranked = sorted(ok, key=lambda n: -ok[n].tokens_per_s)
    names = [c.name for c in space.candidates if c.name in ok]
    calibrated = [result.beliefs[n].planner.tokens_per_s for n in names]
    measured = [ok[n].tokens_per_s for n in names]
    from threefold.planner.predict import predict

    prior = [
        predict(
            tuner.surrogate.shape,
            tuner.surrogate.base,
            tuner.by_name[n].layout,
            cfg.train.global_batch,
            tuner.surrogate.dtype,
        ).tokens_per_s
        for n in names
    ]
    # Confirmation: the sweep best and the winner again, in paired rounds (order alternating, so
    # drift of the shared host hits both alike); the per-round ratio is the verdict's interval.
    from stats import paired_ratio

    from threefold.planner.tune.trials import run_trial

    rounds, again = [], {best_name: [], winner: []}
    if winner != best_name:
        for i in range(args.confirm):
            pair = (best_name, winner) if i % 2 == 0 else (winner, best_name)
            got = {}
            for name in pair:
                r = run_trial(cfg, tuner.by_name[name], out / "confirm" / f"{i}-{name}", args.steps, args.timeout)
                got[name] = r.tokens_per_s if r.status == "ok" else float("nan")
                again[name].append(got[name])
            rounds.append((got[winner], got[best_name]))
    if rounds:
        confirmed = paired_ratio([w for w, _ in rounds], [b for _, b in rounds])
        within = confirmed.lo <= 1.0 <= confirmed.hi or confirmed.value >= 1.0
        spread = [x / ok[best_name].tokens_per_s for x in again[best_name]]
        confirm_line = (
            f"Confirmation, {len(rounds)} paired rounds: winner / sweep best {confirmed.value:.3f} "
            f"[{confirmed.lo:.3f}, {confirmed.hi:.3f}]; the sweep best re-measured at "
            + ", ".join(f"{x:.2f}" for x in spread)
            + " of its sweep tokens/s (run-to-run spread)."
        )
    else:
        within = True
        confirm_line = "The tune's winner is the sweep's best."
    cmd = f"python bench/tune_vs_sweep.py --preset {args.preset} --global-batch {args.global_batch}"
    cmd += f" --nproc {args.nproc} --steps {args.steps}"
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    tau_line = (
        f"Kendall's tau over the sweep (planner vs measured tokens/s): before any trial "
        f"{kendall_tau(prior, measured):+.2f}, calibrated on the tune's {result.new_trials} trials "
        f"{kendall_tau(calibrated, measured):+.2f}"
    )
    if result.tau is not None:
        tau_line += f"; over the tune's own trials {result.tau:+.2f}"
    lines = [
        f"`{cmd}` on {when}; sweep {sweep_s / 60:.1f} min, tune {tune_s / 60:.1f} min.",
        "",
        f"Space: {space.nominal} in the plain product, {len(space.candidates)} distinct runnable candidates "
        f"({len(space.refused)} refused by a rule); {len(ok)} measured by the sweep.",
        "",
        "| | trials | best layout | tokens/s | vs sweep best (95% interval) |",
        "|---|---|---|---|---|",
        f"| exhaustive sweep | {len(swept)} | {best_name} | {ok[best_name].tokens_per_s:,.0f} | 1 |",
        f"| threefold tune (cold, budget {budget}) | {result.new_trials} | {winner} | "
        f"{result.best_result.tokens_per_s:,.0f} (its own trial) | {own.value:.3f} [{own.lo:.3f}, {own.hi:.3f}] |",
        f"| the tune's winner as the sweep measured it | | {winner} (rank {ranked.index(winner) + 1} "
        f"of {len(ranked)}) | {ok[winner].tokens_per_s:,.0f} | {vs.value:.3f} [{vs.lo:.3f}, {vs.hi:.3f}] |",
        "",
        confirm_line,
        "",
        f"Within the sweep best's noise: **{'yes' if within else 'no'}**; trials {result.new_trials} of "
        f"{len(swept)} ({result.new_trials / len(swept):.0%}); stopped: {result.stop_reason}.",
        tau_line + ".",
    ]
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
