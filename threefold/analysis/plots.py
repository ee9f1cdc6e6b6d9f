"""PNG plots of a run and the HTML page bundling them (matplotlib: the optional `plots` extra).

loss.png       loss per step
timeline.png   the pipeline timeline of the first traced step: one row per rank, a bar per span
               (F/B/W, receive waits, sends, TP comm, optimizer, ...), coloured by category
breakdown.png  per rank, the step's time stacked by category
goodput.png    the goodput ledger over the run: wall time so far stacked by category (productive,
               lost, recovery by part, pre-flight, checkpoint stall ...), each attempt marked
report.html    the text summary and the images, in one page (images embedded)
"""

from __future__ import annotations

import base64
import html
import importlib.util
from pathlib import Path

from threefold.analysis.rundir import Run
from threefold.observe.spans import CATEGORIES
from threefold.observe.trace import gantt_rows

COLORS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "weight_grad": "#C44E52",
    "recompute": "#8C8C8C",
    "tp_comm": "#55A868",
    "cp_comm": "#A6D854",
    "pp_p2p": "#64B5CD",
    "pp_bubble": "#EEEEEE",
    "dp_exposed": "#8172B3",
    "ep_a2a": "#937860",
    "sync": "#DA8BC3",
    "data_wait": "#CCB974",
    "optimizer": "#2F4F4F",
    "checkpoint": "#000000",
    "other": "#BBBBBB",
}


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def loss_plot(run: Run, path: Path) -> Path:
    plt = _pyplot()
    steps = [m["step"] for m in run.metrics if isinstance(m.get("loss"), (int, float))]
    loss = [m["loss"] for m in run.metrics if isinstance(m.get("loss"), (int, float))]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, loss, lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{run.name}: training loss")
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def timeline_plot(run: Run, path: Path) -> Path | None:
    """Gantt of the first traced step; None when the run wrote no trace."""
    if not run.trace:
        return None
    step, rows = gantt_rows(run.trace)
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(rows) + 1.8))
    ranks = list(rows)
    for y, rank in enumerate(ranks):
        for depth in sorted({e[4] for e in rows[rank]}):  # children drawn over their parents
            spans = [e for e in rows[rank] if e[4] == depth]
            h = 0.8 / depth
            ax.broken_barh(
                [(e[2], e[3]) for e in spans],
                (y - h / 2, h),
                facecolors=[COLORS.get(e[0], "#999999") for e in spans],
                edgecolor="none",
            )
            for cat, name, start, dur, _ in spans:
                if cat in ("forward", "backward", "weight_grad") and dur > 0:
                    ax.text(
                        start + dur / 2,
                        y,
                        name.split("c")[0],
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="white",
                        clip_on=True,
                    )
    names = {
        e["pid"]: e["args"]["name"]
        for e in run.trace.get("traceEvents", [])
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([names.get(r, f"rank {r}") for r in ranks], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the start of the step")
    ax.set_title(f"{run.name}: step {step} per rank (F/B/W by micro-batch; pale = pipeline bubble)")
    used = {e[0] for r in rows.values() for e in r}
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[c]) for c in CATEGORIES if c in used]
    ax.legend(
        handles,
        [c for c in CATEGORIES if c in used],
        loc="center left",
        bbox_to_anchor=(1.0, 0.5),
        fontsize=7,
        frameon=False,
    )
    return _save(plt, fig, path)


def breakdown_plot(run: Run, per_rank: dict, path: Path) -> Path | None:
    if not per_rank:
        return None
    plt = _pyplot()
    ranks = list(per_rank)
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(ranks) + 1.8))
    left = [0.0] * len(ranks)
    for c in CATEGORIES:
        widths = [1e3 * per_rank[r]["time_s"][c] for r in ranks]
        if any(w > 0 for w in widths):
            ax.barh(
                range(len(ranks)),
                widths,
                left=left,
                color=COLORS[c],
                label=c,
                edgecolor="#999999" if c == "pp_bubble" else "none",
                linewidth=0.5,
            )
            left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (mean over steps)")
    ax.set_title(f"{run.name}: where each rank's step went")
    return _save(plt, fig, path, legend_of=ax)


def _save(plt, fig, path: Path, legend_of=None) -> Path:
    """Every plot's ending: its legend (if any) beside the axes, the figure written and closed."""
    if legend_of is not None:
        legend_of.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


LEDGER_COLORS = {
    "productive": "#55A868",
    "lost": "#C44E52",
    "detect": "#8172B3",
    "restart": "#DD8452",
    "preflight": "#CCB974",
    "load": "#64B5CD",
    "rewarm": "#937860",
    "checkpoint": "#000000",
    "skipped": "#DA8BC3",
    "other": "#BBBBBB",
}


def goodput_plot(run: Run, path: Path) -> Path | None:
    """The ledger's progress lines as stacked areas over the run's wall time; None without one."""
    from threefold.analysis.summary import LEDGER, ledger_seconds

    progress = [line for line in run.ledger if line.get("event") == "progress"]
    if not progress:
        return None
    plt = _pyplot()
    x = [0.0] + [line["wall_s"] for line in progress]  # from the run's start, when nothing was spent
    series = [dict.fromkeys(LEDGER, 0.0)] + [ledger_seconds(line) for line in progress]
    used = [k for k in LEDGER if any(s[k] > 0 for s in series)]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.stackplot(x, [[s[k] for s in series] for k in used], labels=used, colors=[LEDGER_COLORS[k] for k in used])
    start = progress[0]["time"] - progress[0]["wall_s"]
    for line in run.ledger:
        if line.get("event") == "attempt" and line.get("failure"):
            ax.axvline(line["time"] - start, color="#333333", lw=0.6, ls=":")
    ax.set_xlabel("wall time of the run (s); dotted: an attempt after a failure")
    ax.set_ylabel("seconds so far")
    ax.set_title(f"{run.name}: goodput ledger ({progress[-1].get('goodput', 0):.1%} productive)")
    return _save(plt, fig, path, legend_of=ax)


def write_html(path: Path, title: str, text: str, images: list[Path]) -> Path:
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em}pre{background:#f6f6f6;padding:1em}"
        "img{max-width:100%;display:block;margin:1em 0}</style></head><body>",
        f"<h1>{html.escape(title)}</h1><pre>{html.escape(text)}</pre>",
    ]
    for image in images:
        data = base64.b64encode(image.read_bytes()).decode("ascii")
        parts.append(
            f"<h2>{html.escape(image.stem)}</h2><img alt='{html.escape(image.stem)}' "
            f"src='data:image/png;base64,{data}'>"
        )
    parts.append("</body></html>")
    path.write_text("\n".join(parts), encoding="utf-8")
    return path
