"""`threefold doctor [--parallel.* ...] [--nproc N] [--json]`: the preflight of `threefold train`
(threefold/preflight/run.py) alone, for a layout: every rank's stack compared, each node's
kernels and the layout's own links measured. One rank runs in this process; several run under
threefold's launcher; under torchrun or Slurm every process is one rank (as `threefold train`).

Exit status: 0 when nothing is named, 1 when something is (an environment or clock difference, a
slow node or link), 2 for a hard stack difference (torch, NCCL as loaded, CUDA, device model,
threefold's source) or a bad command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from threefold.config import Config, parse_overrides, set_key

USAGE = """threefold doctor [--parallel.* ...] [--train.* ...] [--nproc N] [--json]
  e.g. threefold doctor --nproc 4
       threefold doctor --parallel.tp 2 --parallel.pp 2 --parallel.dp 2 --json
  exit status: 0 nothing named, 1 something named, 2 a hard stack difference"""


def doctor_worker(cfg_dict: dict) -> dict:
    """One rank of the doctor: join, build the layout's groups, run the preflight with both
    probes; returns the verdict (rank 0's carries every line and record)."""
    from threefold.distributed.grid import Grid
    from threefold.distributed.runtime import WorkerEnv, join_group, layout_of, shutdown_distributed
    from threefold.preflight.run import link_delays, run_preflight

    cfg = Config.from_dict(cfg_dict)
    device = join_group(cfg, WorkerEnv.from_environ(), cfg.train.startup_timeout_s)
    grid = Grid.build(layout_of(cfg), device=device, link_delays=link_delays(cfg))
    t0 = time.perf_counter()
    result = run_preflight(cfg, grid, device, probes=True)
    doc = result.to_json()
    doc.update(
        exit_code=result.exit_code,
        wall_s=round(time.perf_counter() - t0, 3),
        layout={k: v for k, v in grid.describe().items() if k != "groups"},  # the degrees, not O(world) lists
        device=str(device),
    )
    shutdown_distributed()
    return doc


def run_doctor(cfg: Config) -> dict:
    """Rank 0's verdict of the doctor over cfg's layout, wherever its ranks run."""
    from threefold.distributed import drills
    from threefold.distributed.runtime import under_launcher
    from threefold.validate import validate_parallel

    if under_launcher():
        world = int(os.environ["WORLD_SIZE"])
        validate_parallel(cfg, world)
        drills.check(cfg.train, world)
        return doctor_worker(cfg.to_dict())
    validate_parallel(cfg, None)
    p = cfg.parallel
    world = p.dp * p.tp * p.pp * p.cp
    drills.check(cfg.train, world)
    if world == 1:
        return doctor_worker(cfg.to_dict())
    from threefold.distributed.launch import WorkersFailed, launch

    try:
        return launch(doctor_worker, (cfg.to_dict(),), world, cfg.train.threads, 0, cfg.train.timeout_s, cfg.log.dir)
    except WorkersFailed as err:
        if str(err):
            print(f"threefold: {err}", file=sys.stderr)
        raise SystemExit(err.exit_code) from None


def _table(doc: dict) -> str:
    """The verdict as a reader scans it: one row per check, then every finding."""
    lay = doc["layout"]
    shape = " ".join(f"{k}{lay[k]}" for k in ("tp", "cp", "ep", "pp", "dp") if k in lay)
    rows = [f"threefold doctor: {lay.get('world_size', 1)} rank(s), {shape}, on {doc['device']}, {doc['wall_s']:.2f} s"]
    stack = "hard difference" if doc["hard"] else "soft difference" if _part_named(doc, "stack") else "same everywhere"
    verdicts = {
        "stack": stack,
        "node": "slow node named" if _part_named(doc, "node") else "ok",
        "link": "slow link named" if _part_named(doc, "link") else "ok",
    }
    for part, verdict in verdicts.items():
        rows.append(f"  {part:<6} {verdict}")
    rows.extend(doc["lines"] or ["nothing named"])
    return "\n".join(rows)


def _part_named(doc: dict, part: str) -> bool:
    return any(line.startswith(f"threefold: {part}:") for line in doc["lines"])


def doctor_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="threefold doctor", usage=USAGE)
    parser.add_argument("--nproc", type=int, default=0, help="ranks to run (parallel.dp fills what tp*pp*cp leave)")
    parser.add_argument("--json", action="store_true", help="print the verdict as one JSON object")
    args, rest = parser.parse_known_args(argv)
    cfg = Config()
    overrides = parse_overrides(rest)
    for key, value in overrides:
        set_key(cfg, key, value)
    from threefold.distributed.runtime import under_launcher

    if (args.nproc or under_launcher()) and "parallel.dp" not in dict(overrides):
        cfg.parallel.dp = 0  # filled from --nproc, or from torchrun's world
    if args.nproc:
        from threefold.validate import resolve_dp

        resolve_dp(cfg, args.nproc)
    doc = run_doctor(cfg)
    if int(os.environ.get("RANK", 0)) != 0:  # under torchrun every process runs this command
        return doc["exit_code"]
    print(json.dumps(doc, indent=2, default=str) if args.json else _table(doc))
    return doc["exit_code"]
