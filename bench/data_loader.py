"""The loader's throughput against the training loop's consumption, and the data_wait share.

    python bench/data_loader.py [--preset small] [--steps 30] [--loader-steps 2000] [--prefetch 2,0]
                                [--data.path PATH] [--cache-dir DIR] [--out FILE]

Three measurements on one process (CPU, OMP_NUM_THREADS=1), on the same token stream (the
Python stdlib sources, byte-level, unless --data.path names another):

- loader alone: GlobalBatchSampler.microbatches (index arithmetic + fancy-indexed memmap reads)
  for --loader-steps steps of the preset's global batch, inline and through the Prefetcher
  (depth 2, as train runs it), consumed as fast as they come: tokens/s it can supply;
- the document-mask layout (data.document_mask) built per micro-batch: microseconds each;
- the training loop: `threefold train --model.preset P --train.steps N` (data.prefetch 2, then 0)
  in a subprocess; tokens/s it consumes = global_batch x seq_len / step_time_s, and the
  data_wait share = sum(data_wait_s) / sum(step_time_s) over metrics.jsonl, steps 2.. (step 1
  pays the first batch before the producer thread is ahead: reported apart).

The loader must out-supply the loop by a wide margin (goal: data_wait < 1% of step time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from threefold.config import build_config  # noqa: E402
from threefold.data import GlobalBatchSampler, Prefetcher, load_tokens  # noqa: E402
from threefold.data.documents import document_layout  # noqa: E402


def loader_rate(tokens, sampler: GlobalBatchSampler, micro_batch: int, steps: int, depth: int) -> float:
    """Tokens/s the sampler (+ prefetcher when depth > 0) delivers, consumed at once."""

    def produce(step: int):
        return sampler.microbatches(tokens, step % 10_000, 0, 1, micro_batch)

    for step in range(min(steps, 200)):  # warm: the epoch permutation, the pages of the map
        produce(step)
    start = time.perf_counter()
    if depth == 0:
        for step in range(steps):
            produce(step)
    else:
        with Prefetcher(produce, 0, steps, depth=depth) as prefetch:
            for step in range(steps):
                prefetch.get(step)
    return steps * sampler.global_batch * sampler.seq_len / (time.perf_counter() - start)


def layout_us(tokens, sampler: GlobalBatchSampler, micro_batch: int, reps: int = 200) -> float:
    """Microseconds to build one micro-batch's Documents (mask + positions) on CPU."""
    batches = sampler.microbatches(tokens, 0, 0, 1, micro_batch)
    x = batches[0][0]
    start = time.perf_counter()
    for _ in range(reps):
        document_layout(x, 0)
    return (time.perf_counter() - start) / reps * 1e6


def train_share(preset: str, steps: int, prefetch: int, data_path: str, cache_dir: str) -> dict:
    """Run the training loop in a subprocess; its consumption and data_wait share."""
    with tempfile.TemporaryDirectory() as log_dir:
        cmd = [sys.executable, "-m", "threefold", "train", "--model.preset", preset, "--train.steps", str(steps)]
        cmd += ["--data.prefetch", str(prefetch), "--log.dir", log_dir, "--log.quiet", "true", "--checkpoint.dir", ""]
        cmd += ["--data.path", data_path, "--data.cache_dir", cache_dir]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        rows = [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time_s" in r]
    steady = rows[1:]
    step_s = statistics.median(r["step_time_s"] for r in steady)
    return {
        "prefetch": prefetch,
        "steps": len(rows),
        "median_step_s": step_s,
        "data_wait_share": sum(r["data_wait_s"] for r in steady) / sum(r["step_time_s"] for r in steady),
        "max_data_wait_ms": 1e3 * max(r["data_wait_s"] for r in steady),
        "first_step_data_wait_ms": 1e3 * rows[0]["data_wait_s"],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=30, help="training steps per loop run")
    ap.add_argument("--loader-steps", type=int, default=2000)
    ap.add_argument("--data.path", dest="data_path", default="")
    ap.add_argument("--cache-dir", default="")
    ap.add_argument("--prefetch", default="2,0", help="data.prefetch values of the loop runs")
    ap.add_argument("--out", default="", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    cfg = build_config(None, [("model.preset", args.preset)])
    m, t = cfg.model, cfg.train
    stream = load_tokens(args.data_path, 0, "uint16", args.cache_dir)
    sampler = GlobalBatchSampler(len(stream.tokens), m.seq_len, t.global_batch, t.seed)
    per_step = t.global_batch * m.seq_len
    torch.set_num_threads(1)
    figures = {
        "preset": args.preset,
        "tokens_per_step": per_step,
        "source": stream.source,
        "loader_inline_tokens_per_s": loader_rate(stream.tokens, sampler, t.micro_batch, args.loader_steps, 0),
        "loader_prefetch_tokens_per_s": loader_rate(stream.tokens, sampler, t.micro_batch, args.loader_steps, 2),
        "document_layout_us_per_microbatch": layout_us(stream.tokens, sampler, t.micro_batch),
    }
    for prefetch in (int(v) for v in args.prefetch.split(",")):
        run = train_share(args.preset, args.steps, prefetch, args.data_path, args.cache_dir)
        run["consumed_tokens_per_s"] = per_step / run["median_step_s"]
        figures[f"train_prefetch{prefetch}"] = run
    loop = max(v["consumed_tokens_per_s"] for k, v in figures.items() if k.startswith("train_"))
    figures["loader_over_loop"] = figures["loader_prefetch_tokens_per_s"] / loop
    print(json.dumps(figures, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
