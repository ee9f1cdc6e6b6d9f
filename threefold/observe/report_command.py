"""`threefold report RUN_DIR [RUN_B]`: summarize one run (text, plots, HTML) or compare two."""

from __future__ import annotations

import argparse
from pathlib import Path

from threefold.observe.compare import compare
from threefold.observe.rundir import RunDirError, load_run
from threefold.observe.summary import summarize

USAGE = """threefold report RUN_DIR [--out DIR] [--no-plots]
       threefold report RUN_A RUN_B
  one run: text summary on stdout; loss.png, timeline.png, breakdown.png and report.html in
  --out (default RUN_DIR/report) when matplotlib is installed (pip install 'threefold[plots]').
  two runs: their breakdowns side by side, the biggest change and the config differences."""


def report_command(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="threefold report", usage=USAGE)
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's log.dir (one, or two to compare)")
    ap.add_argument("--out", help="where plots and report.html go (default RUN_DIR/report)")
    ap.add_argument("--no-plots", action="store_true", help="text only")
    args = ap.parse_args(argv)
    if len(args.runs) > 2:
        ap.error("give one run directory, or two to compare")
    runs = [load_run(r) for r in args.runs]
    summaries = [summarize(r) for r in runs]
    if len(runs) == 2:
        text, _ = compare(summaries[0], summaries[1], runs[0].config, runs[1].config)
        print(text)
        return 0
    from threefold.observe.summary import format_summary

    run, summary = runs[0], summaries[0]
    text = format_summary(summary)
    print(text)
    if args.no_plots:
        return 0
    from threefold.observe import plots

    if not plots.have_matplotlib():
        print(
            "note: matplotlib is not installed, so no plots or HTML page were written (pip install 'threefold[plots]')"
        )
        return 0
    out = Path(args.out) if args.out else run.path / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
        images = [
            plots.loss_plot(run, out / "loss.png"),
            plots.timeline_plot(run, out / "timeline.png"),
            plots.breakdown_plot(run, summary["per_rank"], out / "breakdown.png"),
        ]
        images = [i for i in images if i is not None]
        page = plots.write_html(out / "report.html", f"threefold report: {run.name}", text, images)
    except OSError as err:
        raise RunDirError(f"report: cannot write the plots to {out} ({err.strerror or err})") from None
    missing = []
    if run.trace is None:
        missing.append("no timeline (set log.trace_steps)")
    if not summary["per_rank"]:
        missing.append("no per-rank breakdown (set log.spans true)")
    print(
        f"wrote {', '.join(i.name for i in images)} and {page.name} to {out}"
        + (f" ({'; '.join(missing)})" if missing else "")
    )
    return 0
