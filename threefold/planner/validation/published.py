"""The planner against published GPU training results (published.toml beside this file).

Each row is a run someone published: its model, layout, global batch and device, and the figure
it reported, in its own metric and FLOP convention. `predict_row` predicts the run with the
device's profile and the row's `cluster` keys (the implementation the source ran), turns the
predicted step into the source's metric by the source's own FLOP count (so an MFU is compared
with an MFU counted the same way), and gives both conventions: the source's and threefold's
(causal attention, recomputation not counted). `python -m threefold.planner.validation.published`
prints the table.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

TABLE = Path(__file__).with_name("published.toml")
METRICS = ("tflops_per_gpu", "mfu", "tokens_per_s", "tokens_per_s_per_gpu", "minutes")
CONVENTIONS = ("megatron_2021", "model_full", "palm", "threefold")
"""The FLOP counts flops_per_token knows (the table header in published.toml)."""


def _non_embedding_params(cfg) -> float:
    from threefold.model.flops import total_params

    tied = bool(getattr(cfg, "tie_embeddings", False))
    positions = cfg.seq_len * cfg.hidden if cfg.arch == "gpt2" else 0
    return total_params(cfg) - cfg.vocab * cfg.hidden * (1 if tied else 2) - positions


def flops_per_token(convention: str, cfg) -> float:
    """Training FLOPs per token as `convention` counts them (published.toml's header)."""
    from threefold.model.flops import hardware_flops_per_token, train_flops_per_token

    h, layers, s = cfg.hidden, cfg.layers, cfg.seq_len
    if convention == "megatron_2021":  # == Narayanan eq. 3 per token (docs/flops.md)
        return hardware_flops_per_token(cfg, s, causal=False, recompute="full")
    if convention == "model_full":  # Korthikanti eq. 7 per token
        return train_flops_per_token(cfg, s, causal=False)
    if convention == "palm":
        return 6 * _non_embedding_params(cfg) + 12 * layers * h * s
    if convention == "threefold":
        return train_flops_per_token(cfg, s, causal=True)
    raise ValueError(f"unknown FLOP convention {convention!r}")


@dataclass
class RowResult:
    row: dict
    predicted: float
    """In the row's metric and convention."""
    mfu_source: float
    """Predicted MFU as the source counts FLOPs (against the device's dense peak)."""
    mfu_threefold: float
    """Predicted MFU as threefold counts it (causal attention, no recomputation)."""
    fits: bool

    @property
    def error(self) -> float:
        return self.predicted / self.row["published"] - 1

    @property
    def met(self) -> bool:
        return not self.row.get("unmet")


def load_rows(path: Path = TABLE) -> list[dict]:
    with open(path, "rb") as f:
        rows = tomllib.load(f)["row"]
    for row in rows:
        if row["metric"] not in METRICS:
            raise ValueError(f"{path}: row {row['label']!r}: metric {row['metric']!r} is not one of {METRICS}")
    return rows


def model_of(row: dict):
    from threefold.config import build_config

    preset = "gpt-175b" if row["model"]["arch"] == "gpt2" else "llama-70b"
    pairs = [("model.preset", preset)] + [(f"model.{k}", str(v)) for k, v in row["model"].items()]
    return build_config(None, pairs).model


def predict_row(row: dict) -> RowResult:
    from threefold.planner import Layout, build_cluster, model_shape, predict

    cfg = model_of(row)
    layout = Layout(**row["layout"])
    gpus = layout.world
    per_node = 8
    cluster = build_cluster(
        {"device": row["device"], "nodes": max(1, math.ceil(gpus / per_node)), **row.get("cluster", {})}
    )
    pred = predict(model_shape(cfg), cluster, layout, row["global_batch"])
    tokens_per_s = pred.tokens_per_s
    source_flops = flops_per_token(row["flops"], cfg) * tokens_per_s / gpus
    peak = cluster.peak_tflops * 1e12
    metric = row["metric"]
    if metric == "tflops_per_gpu":
        value = source_flops / 1e12
    elif metric == "mfu":
        value = source_flops / peak
    elif metric == "tokens_per_s":
        value = tokens_per_s
    elif metric == "tokens_per_s_per_gpu":
        value = tokens_per_s / gpus
    else:  # minutes to train the row's tokens
        value = row["tokens"] / tokens_per_s / 60
    return RowResult(row, value, source_flops / peak, pred.mfu, pred.fits)


def kendall_tau(a: list[float], b: list[float]) -> float:
    from threefold.planner.categories import kendall_tau as tau

    return tau(a, b)


def table_text(results: list[RowResult]) -> str:
    lines = [
        f"{'source':16} {'row':22} {'metric':15} {'published':>11} {'predicted':>11} {'error':>7}  "
        f"{'MFU (source)':>12} {'MFU (threefold)':>15}"
    ]
    for r in results:
        row = r.row
        note = "" if r.met else "  (not met: see unmet)"
        lines.append(
            f"{row['source']:16} {row['label']:22} {row['metric']:15} {row['published']:>11.4g} {r.predicted:>11.4g} "
            f"{r.error:>+7.1%}  {r.mfu_source:>12.1%} {r.mfu_threefold:>15.1%}{note}"
        )
    return "\n".join(lines)


def main() -> int:
    results = [predict_row(row) for row in load_rows()]
    print(table_text(results))
    met = [r for r in results if r.met]
    each = ", ".join(f"{c} {rank_tau(met, c):+.2f}" for c in CONVENTIONS)
    print(
        f"rows {len(results)}, met {len(met)}; worst |error| {max(abs(r.error) for r in met):.1%}; "
        f"Kendall tau on one FLOP count: {each}; with each row in its source's own count "
        f"{rank_tau(met, None):+.2f}"
    )
    return 0


def published_mfu(r: RowResult, predicted_mfu: float | None = None) -> float:
    """The row's published figure as an MFU: in its source's own convention, or in the one
    `predicted_mfu` (the row's predicted MFU) is counted in."""
    predicted = r.mfu_source if predicted_mfu is None else predicted_mfu
    return predicted / (1 + r.error) if r.row["metric"] != "minutes" else predicted * (1 + r.error)


def rank_tau(results: list[RowResult], convention: str | None) -> float:
    """Kendall's tau between predicted and published MFU over `results`, every row counted in
    FLOP `convention` (one of CONVENTIONS), or with None each row in its source's own.

    The ranking compares rows with each other, so it needs one count: the sources' counts differ
    by row (Narayanan et al. 2021 count the recompute pass, 4/3 of the dense work under full
    recompute; PaLM's and Korthikanti's count full attention, threefold's causal), and ranking
    one row's 46% with recompute counted against another's 47% without ranks the counts, not
    the runs. A row's throughput, and so its error, is the same in every count."""
    predicted, published = [], []
    for r in results:
        if convention is None:
            mfu = r.mfu_source
        else:
            cfg = model_of(r.row)
            mfu = r.mfu_source * flops_per_token(convention, cfg) / flops_per_token(r.row["flops"], cfg)
        predicted.append(mfu)
        published.append(published_mfu(r, mfu))
    return kendall_tau(predicted, published)


if __name__ == "__main__":
    raise SystemExit(main())
