"""False alarms of the in-run diagnosis: N clean runs (no fault drill), and everything any detector
named in them.

Each run is one `threefold train` (the production launcher, its elastic agent and gloo workers)
with spans on; what counts as named: every finding in metrics.jsonl (unique by kind and key: the
slow link, rank, node, layer and stage detectors, the change points), every band alert, and every
console line a detector prints ('threefold: slow ...', 'threefold: step time ...', the straggler
check's 'threefold: straggler ...', a share's '... of the step since step N'). It prints a markdown
section: per run the median step time, what was named, and the total with its rate.

    python bench/clean_runs.py [--runs 10] [--steps 60] [--interval 5] [-- --parallel.tp 2 ...]

Default layout: tiny preset, tp2 x pp2 x dp2 (8 processes), two micro-batches per pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT = [
    "--model.preset",
    "tiny",
    "--parallel.tp",
    "2",
    "--parallel.pp",
    "2",
    "--parallel.dp",
    "2",
    "--train.global_batch",
    "8",
    "--train.micro_batch",
    "2",
]
NAMED = re.compile(r"^threefold: (slow|step time|straggler|hang|.* of the step since step|step \d+: .* vs expected)")
DETECTORS = ("links", "layers", "stages", "changepoint")
"""The diagnosis' detector modules (observe/diagnose.py), besides the straggler check."""


def one_run(args: list[str], steps: int, interval: int, timeout: float, faults: str = "") -> dict:
    """One run (clean unless `faults`, a train.faults spec): its median step time, what it named
    and the first report step that named each finding (`first`: {"kind key": step})."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "threefold", "train", *args, "--train.steps", str(steps)]
        cmd += ["--log.spans", "true", "--log.interval", str(interval), "--log.dir", tmp, "--log.quiet", "true"]
        cmd += ["--train.faults", faults] if faults else []
        t0 = time.perf_counter()
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1")
        )
        wall = time.perf_counter() - t0
        if out.returncode != 0:  # not a clean run: say why, count it apart
            why = (out.stderr.strip().splitlines() or ["?"])[-1]
            print(f"run failed ({out.returncode}): {why}", file=sys.stderr, flush=True)
            return {"failed": why, "wall_s": wall}
        metrics = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    lines = [line for line in (out.stdout + out.stderr).splitlines() if NAMED.match(line)]
    stragglers = [line for line in lines if line.startswith("threefold: straggler")]  # not a finding
    findings = {(f["kind"], f["key"]): f["text"] for m in metrics for f in m.get("findings", [])}
    first: dict[str, int] = {}
    for m in metrics:
        for f in m.get("findings", []):
            first.setdefault(f"{f['kind']} {f['key']}", m["step"])
    bands = {(a["category"], a["since"]) for m in metrics for a in m.get("band_alerts") or []}
    return {
        "step_ms": 1e3 * statistics.median(m["step_time_s"] for m in metrics[3:] or metrics),
        "wall_s": wall,
        "lines": lines,
        "stragglers": stragglers,
        "findings": sorted(f"{k}: {t}" for (k, _), t in findings.items()),
        "band_alerts": sorted(bands),
        "named": len(findings) + len(bands) + len(stragglers),
        "first": first,
    }


def main(argv=None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10, help="clean runs")
    ap.add_argument("--steps", type=int, default=60, help="training steps per run")
    ap.add_argument("--interval", type=int, default=5, help="log.interval: report steps, where detectors run")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    args = ap.parse_args(ours)
    layout = extra or DEFAULT
    rows = []
    for i in range(args.runs):
        rows.append(one_run(layout, args.steps, args.interval, args.timeout))
        r = rows[-1]
        if "failed" not in r:
            print(f"run {i + 1}/{args.runs}: {r['step_ms']:.0f} ms/step, named {r['named']}", file=sys.stderr)
    done = [r for r in rows if "failed" not in r]
    total = sum(r["named"] for r in done)
    runs_with = sum(1 for r in done if r["named"])
    command = f"python bench/clean_runs.py --runs {args.runs} --steps {args.steps} --interval {args.interval}"
    print("### Clean runs: false alarms of the in-run diagnosis\n")
    print(
        f"{args.runs} clean runs of `{' '.join(layout)}`, {args.steps} steps, log.interval {args.interval}, "
        f"spans on (`{command}`{' -- ' + ' '.join(extra) if extra else ''}). Detectors active: "
        f"{', '.join(DETECTORS)} (and the straggler check). Named: every metrics.jsonl finding, "
        "band alert and detector console line.\n"
    )
    print("| run | median step (ms) | wall (s) | named |")
    print("|---|---|---|---|")
    for i, r in enumerate(rows, 1):
        if "failed" in r:
            print(f"| {i} | - | {r['wall_s']:.0f} | run failed, not counted: {r['failed']} |")
            continue
        bands = [f"band {c} since {s}" for c, s in r["band_alerts"]]
        what = "; ".join(r["findings"] + bands + r["stragglers"]) or "nothing"
        print(f"| {i} | {r['step_ms']:.0f} | {r['wall_s']:.0f} | {what.replace('|', '/')} |")
    # Zero in N: the rule of three bounds the per-run rate at 3/N (95%).
    n = len(done)
    bound = f"; 95% upper bound on the per-run rate {3 / n:.2f} (rule of three)" if total == 0 and n else ""
    kinds = {}
    for r in done:
        for f in r["findings"]:
            kinds[f.split(":")[0]] = kinds.get(f.split(":")[0], 0) + 1
    split = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
    split += (", " if split else "") + f"straggler check {sum(len(r['stragglers']) for r in done)}"
    split += f", band alerts {sum(len(r['band_alerts']) for r in done)}"
    print(f"\n**False alarms: {total} in {n} clean runs** ({runs_with} runs named anything{bound}; by kind: {split}).")
    return [{"false_alarms": float(total), "runs": float(n)}]


if __name__ == "__main__":
    main()
    sys.exit(0)
