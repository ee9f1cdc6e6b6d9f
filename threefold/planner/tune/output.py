"""What a tune leaves in its directory:

best.toml       the winner, runnable by `threefold train --config best.toml`; its [log] bands
                point at bands.toml, so the run is checked against the tuned expectations
bands.toml      the winner trial's share of each time category with its band (observe/bands.py)
journal.jsonl   every trial (written as the tune runs: tune/loop.py)
tune.json       the summary: space sizes, trials, stop reason, winner, Kendall's tau, sensitivity
report.html     the summary, predicted vs measured tokens/s, and the winner's sensitivity
"""

from __future__ import annotations

import json
from pathlib import Path

from threefold.config import Config
from threefold.planner.tune.loop import TuneResult
from threefold.planner.tune.space import Candidate, trial_config


def neighbours(best: Candidate, cands: list[Candidate]) -> list[tuple[str, Candidate]]:
    """Candidates one knob away from `best` (the degree triple counts as one knob), with the knob."""
    out = []
    b = best.layout
    for c in cands:
        lay = c.layout
        diffs = []
        if (lay.dp, lay.tp, lay.pp, lay.cp) != (b.dp, b.tp, b.pp, b.cp):
            diffs.append(f"dp{lay.dp}tp{lay.tp}pp{lay.pp}" + (f"cp{lay.cp}" if lay.cp > 1 else ""))
        if c.microbatches != best.microbatches:
            diffs.append(f"microbatches {c.microbatches}")
        for knob in ("schedule", "zero", "recompute", "sp"):
            if getattr(lay, knob) != getattr(b, knob):
                diffs.append(f"{knob} {getattr(lay, knob)}")
        if len(diffs) == 1:
            out.append((diffs[0], c))
    return out


def sensitivity(result: TuneResult) -> list[dict]:
    """How much each neighbouring setting of the winner loses: measured where it was tried,
    else the tuner's final belief with its interval."""
    if result.best is None:
        return []
    top = result.best_result.tokens_per_s
    rows = []
    for knob, cand in neighbours(result.best, result.space.candidates):
        entry = next((t for t in result.trials if t["name"] == cand.name), None)
        if entry and entry["measured_status"] == "ok":
            rows.append(
                {"change": knob, "name": cand.name, "loss": entry["measured_tokens_per_s"] / top - 1, "how": "measured"}
            )
            continue
        if entry:
            rows.append({"change": knob, "name": cand.name, "loss": None, "how": entry["measured_status"]})
            continue
        belief = result.beliefs[cand.name]
        lo, hi = belief.interval()
        rows.append(
            {
                "change": knob,
                "name": cand.name,
                "loss": belief.tokens_per_s / top - 1,
                "how": "predicted",
                "interval": [lo / top - 1, hi / top - 1],
            }
        )
    return sorted(rows, key=lambda r: -(r["loss"] if r["loss"] is not None else -9))


def write_outputs(result: TuneResult, cfg: Config, out: Path) -> dict:
    """Write best.toml, bands.toml, tune.json and report.html; returns the summary."""
    from threefold.analysis.rundir import load_run
    from threefold.observe.bands import bands_from_run, write_bands
    from threefold.planner.emit import write_config

    summary = {
        "space": {
            "values": result.space.values,
            "nominal": result.space.nominal,
            "candidates": len(result.space.candidates),
            "refused": result.space.refused,
        },
        "trials": len(result.trials),
        "new_trials": result.new_trials,
        "cached_trials": sum(1 for t in result.trials if t["cached"]),
        "stop_reason": result.stop_reason,
        "kendall_tau": result.tau,
        "cache_key": result.cache_key,
        "notes": result.notes,
    }
    if result.best is not None:
        best_dir = Path(result.best_result.path)
        bands_note = ""
        try:
            bands = bands_from_run(load_run(best_dir))
        except Exception as err:  # noqa: BLE001 - a winner without spans still gets its config
            bands, bands_note = {}, f"no bands: {err}"
        chosen = trial_config(cfg, result.best.layout)
        if cfg.log.dir and chosen.checkpoint.dir == str(Path(cfg.log.dir) / "checkpoints"):
            chosen.checkpoint.dir = "auto"  # as the user left it: beside whatever log.dir the run gets
        if bands:
            write_bands(out / "bands.toml", bands, f"expected step shares of {result.best.name} (threefold tune)")
            chosen.log.bands = str((out / "bands.toml").resolve())
        header = (
            f"threefold tune: {result.best.name}, measured {result.best_result.tokens_per_s:,.0f} tokens/s\n"
            f"{len(result.trials)} trials ({result.new_trials} new) of {len(result.space.candidates)} candidates; "
            f"stopped: {result.stop_reason}\n"
            f"run it: threefold train --config {out / 'best.toml'}"
        )
        write_config(str(out / "best.toml"), chosen, header)
        summary.update(
            best=result.best.name,
            best_layout=result.best.layout.as_dict(),
            best_tokens_per_s=result.best_result.tokens_per_s,
            best_noise=result.best_result.noise,
            best_config=str(out / "best.toml"),
            bands=str(out / "bands.toml") if bands else bands_note,
            sensitivity=sensitivity(result),
        )
    (out / "tune.json").write_text(json.dumps(summary, indent=1, default=str), encoding="utf-8")
    _report_page(result, summary, out)
    return summary


def format_summary(summary: dict) -> str:
    lines = [
        f"space: {summary['space']['candidates']} distinct candidates ({summary['space']['nominal']} in the "
        f"plain product, {len(summary['space']['refused'])} refused by a rule)",
        f"trials: {summary['trials']} ({summary['new_trials']} new, {summary['cached_trials']} from the cache); "
        f"stopped: {summary['stop_reason']}",
    ]
    tau = summary.get("kendall_tau")
    lines.append("Kendall's tau (calibrated planner vs measured, trials): " + ("n/a" if tau is None else f"{tau:+.2f}"))
    if "best" in summary:
        lines.append(
            f"best: {summary['best']} at {summary['best_tokens_per_s']:,.0f} tokens/s -> {summary['best_config']}"
        )
        for row in summary["sensitivity"]:
            loss = "n/a" if row["loss"] is None else f"{row['loss']:+.1%}"
            lines.append(f"  {row['change']:<22} {loss:>7}  ({row['how']})")
    lines += summary["notes"]
    return "\n".join(lines)


def _report_page(result: TuneResult, summary: dict, out: Path) -> None:
    from threefold.analysis import plots

    images = []
    if plots.have_matplotlib():
        plt = plots._pyplot()
        done = [t for t in result.trials if t["measured_status"] == "ok"]
        if done:
            fig, ax = plt.subplots(figsize=(5.5, 4.5))
            final = [result.beliefs[t["name"]].planner.tokens_per_s for t in done]
            measured = [t["measured_tokens_per_s"] for t in done]
            ax.scatter(measured, final, label="calibrated planner (final)")
            before = [
                (t["measured_tokens_per_s"], t["predicted_tokens_per_s"]) for t in done if "predicted_tokens_per_s" in t
            ]
            if before:
                ax.scatter(*zip(*before), marker="x", label="belief before the trial")
            lo, hi = min(measured + final) * 0.9, max(measured + final) * 1.1
            ax.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8)
            ax.set_xlabel("measured tokens/s")
            ax.set_ylabel("predicted tokens/s")
            ax.legend(fontsize=7)
            fig.tight_layout()
            images.append(out / "predicted_vs_measured.png")
            fig.savefig(images[-1], dpi=110)
            plt.close(fig)
        rows = [r for r in summary.get("sensitivity", []) if r["loss"] is not None]
        if rows:
            fig, ax = plt.subplots(figsize=(6, 0.4 * len(rows) + 1.2))
            ax.barh(
                [r["change"] for r in rows],
                [100 * r["loss"] for r in rows],
                color=["C0" if r["how"] == "measured" else "C7" for r in rows],
            )
            ax.set_xlabel("tokens/s vs the winner, % (blue measured, grey predicted)")
            fig.tight_layout()
            images.append(out / "sensitivity.png")
            fig.savefig(images[-1], dpi=110)
            plt.close(fig)
    plots.write_html(out / "report.html", "threefold tune", format_summary(summary), images)
