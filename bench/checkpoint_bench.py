"""Checkpoint and recovery costs on CPU: save/load throughput, blocking time of async vs sync
saves, and MTTR (failure to the end of the first step after it).

    python bench/checkpoint_bench.py [--presets tiny,small] [--steps 16] [--interval 4] [--out FILE]

Save: a one-process training run saves every `interval` steps, synchronously and then
asynchronously; `ckpt_block_s` in its metrics is what the loop was blocked (sync: the whole
write, fsync, checksum and publish; async: the copy to host memory). Async / sync is the
median over saves of the k-th async save's blocking / the k-th sync save's (the same step,
the same state), with its 95% bootstrap interval. Save MB/s = checkpoint bytes / sync
blocking time (median). Load MB/s = bytes / (verify checksums + read every shard into
tensors of the saved layout), the path `checkpoint.resume auto` takes.
MTTR: two ranks under the elastic agent (train.max_restarts 1), rank 1 killed at step
`steps/2`; goodput.json gives the time from the kill to the end of the first resumed step
(process restart, start-up, checkpoint load and that step).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from stats import Interval, paired_ratio, show  # noqa: E402

from threefold.checkpoint import LocalTensor, find_resumable, load_into  # noqa: E402
from threefold.config import build_config  # noqa: E402
from threefold.training.worker import run_worker  # noqa: E402
from threefold.validate import validate  # noqa: E402

MB = 1e6


def _cfg(preset: str, steps: int, interval: int, ckpt: Path, log: Path, asynchronous: bool):
    pairs = [
        ("model.preset", preset),
        ("train.steps", str(steps)),
        ("train.warmup_steps", "2"),
        ("checkpoint.dir", str(ckpt)),
        ("checkpoint.interval", str(interval)),
        ("checkpoint.keep", "0"),
        ("checkpoint.async", str(asynchronous).lower()),
        ("log.dir", str(log)),
        ("log.quiet", "true"),
    ]
    return validate(build_config(None, pairs))


def save_costs(preset: str, steps: int, interval: int, tmp: Path) -> dict:
    out = {}
    for mode in ("sync", "async"):
        ckpt, log = tmp / f"{preset}-{mode}-ckpt", tmp / f"{preset}-{mode}-log"
        run_worker(_cfg(preset, steps, interval, ckpt, log, mode == "async").to_dict())
        rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
        out[f"{mode}_saves_s"] = [r["ckpt_block_s"] for r in rows if r["step"] % interval == 0 or r["step"] == steps]
        out[f"{mode}_block_s"] = statistics.median(out[f"{mode}_saves_s"])
        out[f"{mode}_step_s"] = statistics.median(r["step_time_s"] for r in rows[1:])
        out["ckpt_dir"] = ckpt
    directory, manifest = find_resumable(out.pop("ckpt_dir"))
    size = sum(meta["bytes"] for meta in manifest.files.values())
    # Tensors of the saved layout, filled by the resume path (verify, then read every shard).
    targets = [
        LocalTensor(
            name, torch.empty(s.lengths, dtype=getattr(torch, e.dtype)), tuple(e.shape), tuple(s.offsets), False
        )
        for name, e in manifest.tensors.items()
        for s in e.shards
    ]
    t0 = time.perf_counter()
    directory, manifest = find_resumable(directory.parent)
    load_into(targets, directory, manifest)
    load_s = time.perf_counter() - t0
    out.update(checkpoint_mb=size / MB, save_mb_per_s=size / MB / out["sync_block_s"], load_mb_per_s=size / MB / load_s)
    return out


def async_over_sync(r: dict) -> Interval:
    """Blocking time of the k-th async save / the k-th sync save, median over k, bootstrapped."""
    return paired_ratio(r["async_saves_s"], r["sync_saves_s"], unit="save")


def mttr(preset: str, steps: int, interval: int, tmp: Path) -> float:
    log, ckpt = tmp / f"{preset}-mttr-log", tmp / f"{preset}-mttr-ckpt"
    cmd = [
        sys.executable,
        "-m",
        "threefold",
        "train",
        "--model.preset",
        preset,
        "--parallel.dp",
        "2",
        "--train.steps",
        str(steps),
        "--train.warmup_steps",
        "2",
        "--train.max_restarts",
        "1",
        "--checkpoint.dir",
        str(ckpt),
        "--checkpoint.interval",
        str(interval),
        "--log.dir",
        str(log),
        "--log.quiet",
        "true",
    ]
    env = {**os.environ, "THREEFOLD_FAULT": f"kill:rank=1:step={steps // 2}"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"MTTR run failed:\n{done.stderr[-3000:]}")
    return json.loads((log / "goodput.json").read_text())["failures"][0]["mttr_s"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="bench/checkpoint_bench.py", description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--no-mttr", action="store_true", help="skip the restart measurement")
    ap.add_argument("--quick", action="store_true", help="tiny preset only, 6 steps, a save every 2")
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.presets, args.steps, args.interval = "tiny", 6, 2
    results = {}
    print(
        "| preset | checkpoint MB | save MB/s | load MB/s | sync save blocks (ms) | async save blocks (ms) | "
        "async / sync [95% interval] | MTTR (s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            r = save_costs(preset, args.steps, args.interval, Path(tmp))
            r["mttr_s"] = None if args.no_mttr else mttr(preset, args.steps, args.interval, Path(tmp))
            results[preset] = r
            mttr_text = "-" if r["mttr_s"] is None else f"{r['mttr_s']:.1f}"
            print(
                f"| {preset} | {r['checkpoint_mb']:.1f} | {r['save_mb_per_s']:.0f} | {r['load_mb_per_s']:.0f} | "
                f"{r['sync_block_s'] * 1e3:.1f} | {r['async_block_s'] * 1e3:.1f} | {show(async_over_sync(r))} | "
                f"{mttr_text} |",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
