"""`threefold report RUN_DIR [RUN_B]`: summarize one run (text, plots, HTML) or compare two."""

from __future__ import annotations

import argparse
from pathlib import Path

from threefold.analysis.compare import compare
from threefold.analysis.rundir import RunDirError, load_run
from threefold.analysis.summary import summarize
from threefold.errors import ConfigError

USAGE = """threefold report RUN_DIR [--out DIR] [--no-plots] [--write-bands FILE] [--write-rules FILE]
                        [--cluster.KEY V ...]
       threefold report RUN_A RUN_B
  one run: text summary and what to change next on stdout; loss.png, timeline.png, breakdown.png,
  goodput.png (the goodput ledger over the run) and report.html in --out (default RUN_DIR/report)
  when matplotlib is installed (pip install 'threefold[plots]'). --cluster.profile FILE (a
  calibrated profile, from threefold plan --calibrate) or other --cluster.* keys tell the
  planner the machine.
  --write-bands FILE: the run's step shares per category as bands that threefold train
  --log.bands FILE checks a later run against, and the same bands as Prometheus alerting rules
  (FILE's .rules.yml beside it, or --write-rules FILE) over the endpoint of log.prometheus_port.
  two runs: their breakdowns side by side, the biggest change, whether it is beyond the
  run-to-run noise, and the config differences."""


def prescriptions(run, summary: dict, cluster_pairs: list) -> str:
    """The prescription text of one run (analysis.prescribe), with the planner's predictions."""
    from threefold.analysis.prescribe import critical_rank, diagnose, format_prescriptions
    from threefold.planner.predict import RunPredictor

    note = ""
    try:
        predictor = RunPredictor(run.info, cluster_pairs)
    except (ConfigError, ValueError, KeyError, TypeError, ZeroDivisionError) as err:
        if cluster_pairs:  # the user's --cluster keys: their error is the answer
            raise
        # A run the planner cannot model (an old run.json, a device it has no profile for):
        # prescribe from the spans alone.
        predictor, note = None, f"\n  (no planner predictions: {err})"
    found = diagnose(summary, run.config, predictor)
    ranks = summary["per_rank"]
    return format_prescriptions(found, critical_rank(ranks) if ranks else None) + note


def rules_for_s(run) -> float:
    """How long a share stays out of its band before the alert fires: the report lines the
    in-run check waits (bands.PERSIST, the first line starts the wait), at the run's median step
    time and report interval."""
    import statistics

    from threefold.observe.bands import PERSIST

    times = [m["step_time_s"] for m in run.steady(run.metrics) if m.get("step_time_s")]
    interval = run.config.get("log", {}).get("interval", 10)
    return (PERSIST - 1) * interval * statistics.median(times) if times else 0.0


def _write_bands(run, path: str | None, rules: str | None) -> str:
    from threefold.observe.bands import bands_from_run, rules_path, write_bands, write_rules

    bands = bands_from_run(run)
    if not bands:
        raise RunDirError(f"report: {run.path} has no spans to take bands from (train with --log.spans true)")
    rules = rules or str(rules_path(path))
    lines = []
    try:
        if path:
            write_bands(path, bands, f"expected step shares measured in {run.path} (threefold report --write-bands)")
            lines.append(f"wrote bands of {len(bands)} categories to {path}: threefold train --log.bands {path}")
        comment = f"threefold's bands measured in {run.path}, as alerts on log.prometheus_port's endpoint"
        write_rules(rules, bands, rules_for_s(run), comment)
    except OSError as err:
        raise RunDirError(f"report: cannot write {err.filename or path} ({err.strerror or err})") from None
    lines.append(f"wrote them as Prometheus alerting rules to {rules}: rule_files in prometheus.yml")
    return "\n".join(lines)


def preflight_text(run_dir: Path) -> str | None:
    """What the run's preflight (<log.dir>/preflight.json, threefold/preflight/run.py) found, or
    None for a run without one (older runs, or one that failed before it)."""
    import json

    path = Path(run_dir) / "preflight.json"
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return f"preflight: {path} is unreadable ({err})"
    checked = "stack, node and link" if doc.get("node") is not None else "the stack; probes off (train.preflight)"
    found = f"{len(doc['lines'])} finding(s)" if doc.get("lines") else "nothing named"
    head = f"preflight of {checked}: {found}"
    return "\n".join([head, *(f"  {line}" for line in doc.get("lines", []))])


def report_command(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="threefold report", usage=USAGE)
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's log.dir (one, or two to compare)")
    ap.add_argument("--out", help="where plots and report.html go (default RUN_DIR/report)")
    ap.add_argument("--no-plots", action="store_true", help="text only")
    ap.add_argument(
        "--write-bands", metavar="FILE", help="write the run's measured step shares as bands for train's log.bands"
    )
    ap.add_argument(
        "--write-rules", metavar="FILE", help="where the bands' Prometheus alerting rules go (default: FILE.rules.yml)"
    )
    from threefold.planner.cluster import split_cluster_args

    argv, cluster_pairs = split_cluster_args(argv)
    args = ap.parse_args(argv)
    if len(args.runs) > 2:
        ap.error("give one run directory, or two to compare")
    runs = [load_run(r) for r in args.runs]
    summaries = [summarize(r) for r in runs]
    if len(runs) == 2:
        text, _ = compare(summaries[0], summaries[1], runs[0].config, runs[1].config, runs[0], runs[1])
        print(text)
        return 0
    from threefold.analysis.summary import format_summary

    run, summary = runs[0], summaries[0]
    text = format_summary(summary)
    preflight = preflight_text(run.path)
    if preflight:
        text += "\n" + preflight
    if summary["breakdown"]:
        text += "\n" + prescriptions(run, summary, cluster_pairs)
    if args.write_bands or args.write_rules:
        text += "\n" + _write_bands(run, args.write_bands, args.write_rules)
    print(text)
    if args.no_plots:
        return 0
    from threefold.analysis import plots

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
            plots.goodput_plot(run, out / "goodput.png"),
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
