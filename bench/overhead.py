"""Framework overhead: threefold's single-process training step vs a minimal plain-PyTorch loop.

Same model (threefold's Transformer, same init), same batches, same AdamW and clipping; the
contestants alternate A, B, A, B ... to cancel machine drift. Per-step time is the interval
between consecutive step ends (everything the loop does counts: data, metrics, logging); a
round is one threefold run and one plain run, its value each run's median step time; the
ratio is the median per-round ratio with its 95% bootstrap interval (bench/stats.py).

    python bench/overhead.py [--preset tiny] [--rounds 6] [--steps 20] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from stats import show  # noqa: E402
from timing import cell, ratio, steps_of  # noqa: E402

from threefold.config import build_config  # noqa: E402
from threefold.data import GlobalBatchSampler, load_tokens  # noqa: E402
from threefold.model.meta import plain_model  # noqa: E402
from threefold.training.optim import param_groups  # noqa: E402
from threefold.training.worker import run_worker  # noqa: E402
from threefold.validate import validate  # noqa: E402

WARM = 2  # step intervals dropped from each run of either contestant: steps 2 and 3 (step 1 has none)


def make_cfg(preset: str, steps: int, log_dir: str):
    cfg = build_config(
        None,
        [
            ("model.preset", preset),
            ("train.steps", str(steps)),
            ("log.dir", log_dir),
            ("log.quiet", "true"),
            ("train.warmup_steps", "2"),
            ("checkpoint.dir", ""),  # the steps only: no save at the end (the default's)
        ],
    )
    return validate(cfg)


def threefold_step_times(preset: str, steps: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        run_worker(make_cfg(preset, steps, tmp).to_dict())
        stamps = [json.loads(line)["time"] for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    return [b - a for a, b in zip(stamps, stamps[1:])][WARM:]


def plain_step_times(preset: str, steps: int) -> list[float]:
    cfg = make_cfg(preset, steps, "")
    m, t = cfg.model, cfg.train
    model = plain_model(m, t.seed, "cpu")
    opt = torch.optim.AdamW(
        param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, foreach=True
    )
    tokens = load_tokens("", 0, "uint16", "").tokens
    sampler = GlobalBatchSampler(len(tokens), m.seq_len, t.global_batch, t.seed)
    n_tokens = t.global_batch * m.seq_len
    ends = []
    for step in range(steps):
        for x, y in sampler.microbatches(tokens, step, 0, 1, t.micro_batch):
            (model(x, y) / n_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
    return [b - a for a, b in zip(ends, ends[1:])][WARM:]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--rounds", type=int, default=6, help="rounds: one threefold run, one plain run")
    ap.add_argument("--steps", type=int, default=20, help="training steps per run")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 5 steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 3, 5
    torch.set_num_threads(1)
    blocks = {"threefold": [], "plain": []}
    for _ in range(args.rounds):
        blocks["threefold"].append(threefold_step_times(args.preset, args.steps))
        blocks["plain"].append(plain_step_times(args.preset, args.steps))
    result = {"preset": args.preset, "blocks": blocks, "rounds": args.rounds, "steps": args.steps}
    print(
        f"{args.rounds} rounds x {args.steps} steps (first {WARM} intervals of each run dropped); median [IQR] ms "
        "over all kept steps; ratio: median per-round ratio of run medians [95% bootstrap interval]\n"
    )
    print("| preset | threefold ms | plain loop ms | ratio |")
    print("|---|---|---|---|")
    print(
        f"| {args.preset} | {cell(steps_of(blocks['threefold']))} | {cell(steps_of(blocks['plain']))} | "
        f"{show(ratio(blocks, 'threefold', 'plain'))} |"
    )
    print("\nSingle process: this ratio is the framework's own per-step Python overhead, by design.\n")
    print("Contestants:\n")
    print(
        "- threefold: `threefold train`'s worker in this process (run_worker, dp = tp = pp = 1): prefetching "
        "data loader, DataParallel engine (its AdamW: torch's foreach arithmetic on flat buffers, weight decay "
        "on matrices only), grad norm + clip at the config's grad_clip, lr schedule, health guard, a metrics "
        "line per step."
    )
    print(
        "- plain loop: the same model (plain_model, same init) and sampler, AdamW(foreach=True, eps 1e-8) with "
        "threefold.training.optim.param_groups, clip_grad_norm_(foreach=True), zero_grad(set_to_none=True), "
        "constant lr."
    )
    print(
        f"- Both: one process, one thread, {args.steps} steps per run, the first {WARM} step intervals dropped; "
        f"{args.rounds} rounds alternating threefold, plain."
    )
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
