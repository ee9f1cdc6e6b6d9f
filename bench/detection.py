"""How small a slow link or a slow rank the in-run diagnosis names, and how fast: a sweep of the
slowlink drill's delay and the slow drill's factor over the tp2 x pp2 x dp2 layout of
tests/observe/test_slow_link.py (8 gloo processes, the production launcher, spans on).

Per setting and repeat one `threefold train` run (bench/clean_runs.py's one_run); a run counts as
named when the expected finding (`slow_link pp A->B`, `slow_rank rank R`) is in metrics.jsonl,
with the first report step that names it (the drill acts from step 0: that step is the detection
latency), and as wrong for every other finding it names. It prints a markdown section.

    python bench/detection.py [--ms 2,5,10,20] [--factors 1.25,1.5,2] [--repeats 2] [--steps 30]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clean_runs import DEFAULT, one_run  # noqa: E402

from threefold.distributed.grid import RankLayout  # noqa: E402

LAYOUT = RankLayout(tp=2, pp=2, dp=2)
A, B = LAYOUT.rank_of(tp=1, dp=1, pp=0), LAYOUT.rank_of(tp=1, dp=1, pp=1)  # one replica's pipeline pair
SLOW = LAYOUT.rank_of(tp=1, dp=0, pp=1)


def settings(ms: list[float], factors: list[float]) -> list[tuple[str, str, str]]:
    """(what, the drill spec, the finding it should name)."""
    out = [(f"slowlink {m:g} ms", f"slowlink:ranks={A}-{B}:ms={m:g}", f"slow_link pp {A}->{B}") for m in ms]
    out += [(f"slow x{f:g}", f"slow:rank={SLOW}:factor={f:g}", f"slow_rank rank {SLOW}") for f in factors]
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="2,5,10,20", help="slowlink delays (ms per exchange)")
    ap.add_argument("--factors", default="1.25,1.5,2", help="slow factors (the rank's compute)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per setting")
    ap.add_argument("--steps", type=int, default=30, help="training steps per run")
    ap.add_argument("--interval", type=int, default=5, help="log.interval: report steps, where detectors run")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    args = ap.parse_args(argv)
    ms = [float(x) for x in args.ms.split(",") if x]
    factors = [float(x) for x in args.factors.split(",") if x]
    rows = []
    for what, spec, expected in settings(ms, factors):
        runs = [one_run(DEFAULT, args.steps, args.interval, args.timeout, spec) for _ in range(args.repeats)]
        done = [r for r in runs if "failed" not in r]
        named = [r["first"][expected] for r in done if expected in r["first"]]
        wrong = sorted({k for r in done for k in r["first"] if k != expected})
        rows.append({"what": what, "spec": spec, "runs": len(done), "named": named, "wrong": wrong})
        print(f"{what}: named in {len(named)}/{len(done)} at {named}; other findings {wrong}", file=sys.stderr)
    command = f"python bench/detection.py --ms {args.ms} --factors {args.factors} --repeats {args.repeats}"
    command += f" --steps {args.steps} --interval {args.interval}"
    print("### Detection: the smallest slow link and slow rank named\n")
    print(
        f"`{command}`: `{' '.join(DEFAULT)}`, {args.steps} steps, log.interval {args.interval}, spans on; "
        f"the slowlink drill delays every exchange between ranks {A} and {B} (one replica's stages 0 "
        f"and 1), the slow drill stretches rank {SLOW}'s compute; both act from step 0.\n"
    )
    print("| drill | named | first report step naming it | other findings |")
    print("|---|---|---|---|")
    for r in rows:
        steps = ", ".join(map(str, r["named"])) or "-"
        print(f"| `{r['spec']}` | {len(r['named'])}/{r['runs']} | {steps} | {', '.join(r['wrong']) or 'none'} |")
    return [{"what": r["what"], "named": float(len(r["named"])), "runs": float(r["runs"])} for r in rows]


if __name__ == "__main__":
    main()
    sys.exit(0)
