"""Planner calibration on CPU: train a matrix of layouts, fit on two runs, predict the rest.

    python bench/planner_calibration.py                      # the whole matrix, fresh runs
    python bench/planner_calibration.py --reuse              # keep run directories that finished
    python bench/planner_calibration.py --only dp            # the data-parallel layouts only

Each layout runs `threefold train` for a few steps into <out>/<name> (run.json, metrics.jsonl
and, with log.spans, spans.jsonl: every rank's step split by category). A layout `threefold
train` refuses is skipped with its one-line reason. The planner is then calibrated on the two
runs named by --calibrate-on and predicts every run's median step time; the table marks errors
over 25%. The default pair is what a user has at hand: one process (compute alone) and the
full 3D run, tp2 x pp2 x dp2 on 8 processes (TP collectives, pipeline transfers, the DP
reduction, cores shared 4 ways); the share of a core 4 processes get follows from the cpu
profile's measured `core_share_exponent`.

`--calibrate-on all` is leave-one-out over the whole matrix: each run is predicted by a fit on
all the others, so every row is held out. Each row carries its interval (predicted x
exp(+-2 sigma), sigma the category's residual spread in log space); the tables end with, per
category, how many rows are within 25% of measured and how many intervals cover the
measurement, and Kendall's tau between predicted and measured step times.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (name, dp, tp, pp): dp/tp/pp combinations of 1..4 on 4 and 8 processes, and one process.
MATRIX = [
    ("dp1", 1, 1, 1),
    ("dp4", 4, 1, 1),
    ("dp8", 8, 1, 1),
    ("tp2dp2", 2, 2, 1),
    ("tp4", 1, 4, 1),
    ("tp2dp4", 4, 2, 1),
    ("pp2dp2", 2, 1, 2),
    ("pp4", 1, 1, 4),
    ("tp2pp2dp2", 2, 2, 2),
]


def run_layout(out: Path, name: str, dp: int, tp: int, pp: int, args) -> tuple[str, str]:
    """('ok' | 'skipped' | 'failed', detail)."""
    run_dir = out / name
    if args.reuse and (run_dir / "metrics.jsonl").is_file():
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        if len(lines) >= args.steps:
            return "ok", "reused"
    if run_dir.exists():
        for f in run_dir.iterdir():
            if f.is_file():
                f.unlink()
    cmd = [
        sys.executable,
        "-m",
        "threefold",
        "train",
        "--model.preset",
        args.preset,
        "--parallel.dp",
        str(dp),
        "--parallel.tp",
        str(tp),
        "--parallel.pp",
        str(pp),
        "--train.steps",
        str(args.steps),
        "--train.global_batch",
        str(args.global_batch),
        "--train.micro_batch",
        str(args.micro_batch),
        "--train.warmup_steps",
        "1",
        "--log.dir",
        str(run_dir),
        "--log.quiet",
        "true",
        "--data.prefetch",
        "0",
        "--log.spans",
        "true" if args.spans else "false",
        "--log.interval",
        "1",  # a spans.jsonl line per step: each one an equation
    ]
    if args.seq_len:
        cmd += ["--model.seq_len", str(args.seq_len)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return "failed", f"timed out after {args.timeout} s"
    if proc.returncode == 2:
        return "skipped", proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "refused"
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return "failed", f"exit {proc.returncode}: {tail}"
    return "ok", f"{time.perf_counter() - t0:.0f} s wall"


def main(argv: list[str] | None = None) -> list[dict]:
    """Prints the calibration and the table; returns one row per held-out run (name, error)."""
    ap = argparse.ArgumentParser(
        prog="bench/planner_calibration.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="runs/planner_calibration", help="directory for the run directories")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq-len", type=int, default=128, help="override model.seq_len (0 = the preset's)")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per training run")
    ap.add_argument("--only", choices=("dp", "tp", "pp"), help="run only layouts using this dimension (dp: dp-only)")
    ap.add_argument("--names", default="", help="comma-separated run names of the matrix to run (default: all)")
    ap.add_argument(
        "--host-cores",
        type=int,
        default=0,
        help="cores the processes really get (default: run.json's; less when the machine is shared)",
    )
    ap.add_argument(
        "--calibrate-on", default="dp1,tp2pp2dp2", help="run names to fit on; 'all': leave-one-out over the matrix"
    )
    ap.add_argument("--fit", default="", help="parameters to fit (default: chosen by the planner)")
    ap.add_argument(
        "--spans",
        type=int,
        default=1,
        help="1: time each step by category (log.spans), so every run gives one equation per category",
    )
    ap.add_argument("--reuse", action="store_true", help="keep finished run directories")
    ap.add_argument("--no-train", action="store_true", help="only calibrate on what is already in --out")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny preset, 4 steps; calibrated on dp1 and tp2dp2, predicts pp2dp2: indicative only",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.steps = "tiny", 4
        args.names = args.names or "dp1,tp2dp2,pp2dp2"
        if args.calibrate_on == ap.get_default("calibrate_on"):
            args.calibrate_on = "dp1,tp2dp2"

    out = (ROOT / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    matrix = MATRIX
    if args.only == "dp":
        matrix = [m for m in MATRIX if m[2] == 1 and m[3] == 1]
    elif args.only == "tp":
        matrix = [m for m in MATRIX if m[2] > 1 or m[0] == "dp1"]
    elif args.only == "pp":
        matrix = [m for m in MATRIX if m[3] > 1 or m[0] == "dp1"]
    if args.names:
        keep = set(args.names.split(","))
        matrix = [m for m in matrix if m[0] in keep]
    status: dict[str, tuple[str, str]] = {}
    for name, dp, tp, pp in matrix:
        if args.no_train:
            ok = (out / name / "metrics.jsonl").is_file()
            status[name] = ("ok", "existing") if ok else ("skipped", "no run directory")
        else:
            status[name] = run_layout(out, name, dp, tp, pp, args)
        print(f"{name:12} {status[name][0]:8} {status[name][1]}", flush=True)

    from threefold.planner.calibrate import fit, leave_one_out, load_run
    from threefold.planner.cluster import build_cluster
    from threefold.planner.report import calibration_text

    done = {name: load_run(str(out / name)) for name, (state, _) in status.items() if state == "ok"}
    loo = args.calibrate_on.strip() == "all"
    calib = list(done) if loo else [n.strip() for n in args.calibrate_on.split(",")]
    missing = [n for n in calib if n not in done]
    if missing:
        raise SystemExit(f"cannot calibrate: runs {', '.join(missing)} did not finish")
    # Peak and cores come from each run's run.json; the rest of the cpu profile are priors.
    given = {"device": "cpu", "peak_tflops": done[calib[0]].peak_flops / 1e12}
    if args.host_cores:
        given["host_cores"] = args.host_cores
    base = build_cluster(given)
    free = [s for s in args.fit.split(",") if s] or None
    explicit = {"host_cores"} if args.host_cores else set()
    if loo:
        cal = leave_one_out([done[n] for n in calib], base, free, explicit)
    else:
        cal = fit([done[n] for n in calib], base, free, [r for n, r in done.items() if n not in calib], explicit)
    print()
    print(calibration_text(cal))
    print()
    print("| run | dp | tp | pp | processes | measured s | predicted s | interval s | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for row in cal.rows:
        if row.category != "step":
            continue
        lay = row.run.layout
        err = row.fitted / row.measured - 1
        flag = " (calibration)" if not row.held_out else (" **over 25%**" if abs(err) > 0.25 else "")
        print(
            f"| {row.run.name}{flag} | {lay.dp} | {lay.tp} | {lay.pp} | {lay.world} | {row.measured:.3f} | "
            f"{row.fitted:.3f} | {row.lo:.3f}-{row.hi:.3f} | {err:+.1%} |"
        )
        if row.held_out:
            rows.append(
                {
                    "name": row.run.name,
                    "error": err,
                    "predicted_s": row.fitted,
                    "step_times_s": used_step_times(row.run.path),
                }
            )
    for name, (state, detail) in status.items():
        if state != "ok":
            print(f"| {name} | | | | | {state}: {detail} | | | |")
    print_category_errors(cal)
    from threefold.planner.report import accuracy_text

    print("\nPer category after calibration: within 25% of measured, or the interval covers it:\n")
    print(accuracy_text(cal))
    return rows


def used_step_times(run_dir: str) -> list[float]:
    """The step times behind a run's measured median: calibrate.load_run's, warm-up dropped."""
    import json

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    times = [json.loads(line)["step_time_s"] for line in lines if line.strip()]
    return times[max(1, len(times) // 5) :] or times[-1:]


def worst_error(rows: list[dict]):
    """The worst held-out |predicted / measured - 1| with a 95% bootstrap interval: each run's
    steps are resampled, its median and error recomputed, and the worst run taken."""
    import numpy as np
    from stats import bootstrap

    predicted = np.array([r["predicted_s"] for r in rows])

    def statistic(*times):
        medians = np.stack([np.median(t, axis=-1) for t in times], axis=-1)
        return np.abs(predicted / medians - 1).max(axis=-1)

    steps = min(len(r["step_times_s"]) for r in rows)
    return bootstrap(
        [r["step_times_s"] for r in rows], statistic, f"worst of {len(rows)} runs, steps resampled ({steps}+ per run)"
    )


def print_category_errors(cal) -> None:
    """Each measured category (the slowest rank's spans) against its fitted prediction, per run,
    and the band over all runs: what `threefold plan` prints next to a category outside 25%."""
    from threefold.planner.validation import MEASURED_AS, TOLERANCE, Band

    names = [n for n in MEASURED_AS if n != "step" and any(r.category == n for r in cal.rows)]
    if not names:
        print("\nNo category was measured (the runs had no spans).")
        return
    errors = {(r.run.name, r.category): r.fitted / r.measured - 1 for r in cal.rows}
    covers = {(r.run.name, r.category): r.covered for r in cal.rows}
    runs = list(dict.fromkeys(r.run.name + (" (calibration)" if not r.held_out else "") for r in cal.rows))
    labels = [MEASURED_AS[n] for n in names]
    print(
        f"\nPer category, predicted / measured - 1 on the slowest rank (spans); plans print a category outside "
        f"{TOLERANCE:.0%} with its band:\n"
    )
    print("| run | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    for run in runs:
        name = run.split(" ")[0]
        cells = [
            Band(errors[name, n], errors[name, n], 1).text() + ("" if covers[name, n] else " (not covered)")
            if (name, n) in errors
            else "-"
            for n in names
        ]
        print(f"| {run} | " + " | ".join(cells) + " |")
    bands = cal.bands()
    print(
        "| **band** | "
        + " | ".join(bands[label].text() + ("" if bands[label].within else " (outside)") for label in labels)
        + " |"
    )


if __name__ == "__main__":
    main()
