"""Framework overhead: threefold's single-process training step vs a minimal plain-PyTorch loop.

Same model (threefold's Transformer, same init), same batches, same AdamW and clipping; the
contestants alternate A, B, A, B ... to cancel machine drift. Per-step time is the interval
between consecutive step ends (everything the loop does counts: data, metrics, logging).

    python bench/overhead.py [--preset tiny] [--rounds 5] [--steps 30] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from threefold.config import build_config  # noqa: E402
from threefold.data import load_tokens, GlobalBatchSampler  # noqa: E402
from threefold.model.meta import plain_model  # noqa: E402
from threefold.train.worker import run_worker  # noqa: E402
from threefold.validate import validate  # noqa: E402


def make_cfg(preset: str, steps: int, log_dir: str):
    cfg = build_config(None, [("model.preset", preset), ("train.steps", str(steps)), ("log.dir", log_dir),
                              ("log.quiet", "true"), ("train.warmup_steps", "2")])
    return validate(cfg)


def threefold_step_times(preset: str, steps: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        run_worker(make_cfg(preset, steps, tmp).to_dict())
        stamps = [json.loads(line)["time"] for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    return [b - a for a, b in zip(stamps, stamps[1:])][2:]  # drop warm-up intervals


def plain_step_times(preset: str, steps: int) -> list[float]:
    cfg = make_cfg(preset, steps, "")
    m, t = cfg.model, cfg.train
    model = plain_model(m, t.seed, "cpu")
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay}, {"params": other, "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2), foreach=True)
    tokens = load_tokens("", 0, "uint16", "").tokens
    sampler = GlobalBatchSampler(len(tokens), m.seq_len, t.global_batch, t.seed)
    n_tokens = t.global_batch * m.seq_len
    ends = []
    for step in range(steps):
        for x, y in sampler.microbatches(tokens, step, 0, 1, t.micro_batch):
            (model(x, y) / n_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
    return [b - a for a, b in zip(ends, ends[1:])][2:]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 5 steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 5
    torch.set_num_threads(1)
    a_times, b_times = [], []
    for _ in range(args.rounds):
        a_times.append(statistics.median(threefold_step_times(args.preset, args.steps)))
        b_times.append(statistics.median(plain_step_times(args.preset, args.steps)))
    a, b = statistics.median(a_times), statistics.median(b_times)
    result = {"preset": args.preset, "threefold_ms": 1e3 * a, "plain_ms": 1e3 * b, "ratio": a / b,
              "threefold_spread_ms": 1e3 * (max(a_times) - min(a_times)),
              "plain_spread_ms": 1e3 * (max(b_times) - min(b_times)), "rounds": args.rounds, "steps": args.steps}
    print(f"{args.rounds} rounds x {args.steps} steps (first 2 intervals dropped); median of the round medians "
          "(± half their spread)\n")
    print("| preset | threefold ms | plain loop ms | ratio |")
    print("|---|---|---|---|")
    print(f"| {args.preset} | {result['threefold_ms']:.1f} (±{result['threefold_spread_ms'] / 2:.1f}) | "
          f"{result['plain_ms']:.1f} (±{result['plain_spread_ms'] / 2:.1f}) | {result['ratio']:.3f} |")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
