"""One training process: join the group, build the grid, train, leave in order.

Runs under the elastic agent (spawned by `threefold train` or started by torchrun) or
in-process for a single-device run.
"""
from __future__ import annotations

import sys

import torch

from threefold.config import Config
from threefold.distributed.grid import Grid, RankLayout
from threefold.distributed.runtime import WorkerEnv, init_distributed, resolve_device, shutdown_distributed
from threefold.errors import UserError
from threefold.train.loop import train


def layout_of(cfg: Config) -> RankLayout:
    p = cfg.parallel
    return RankLayout(tp=p.tp, cp=p.cp, ep=p.ep, dp=p.dp, pp=p.pp, order=p.order)


def run_worker(cfg_dict: dict, measure_memory: bool = False):
    """Entry point of every worker; returns the last step's metrics (rank 0's are reported), or
    with `measure_memory` every rank's memory rows (on rank 0) for `threefold memory`."""
    cfg = Config.from_dict(cfg_dict)
    env = WorkerEnv.from_environ()
    device = resolve_device(cfg.train.device, env.local_rank)
    if device.type == "cpu":
        torch.set_num_threads(cfg.train.threads)
    try:
        init_distributed(device, cfg.train.timeout_s)
        layout = layout_of(cfg)
        layout.check_placement(cfg.parallel.devices_per_node or env.local_world_size,
                               cfg.parallel.allow_tp_across_nodes)
        probe = None
        if measure_memory:
            from threefold.train.memory_probe import MemoryProbe

            probe = MemoryProbe()
        result = train(cfg, Grid.build(layout), device, probe=probe)
        shutdown_distributed()
        return result
    except UserError as err:
        # A user mistake found only inside the worker: one line, exit 2, no traceback.
        print(f"threefold: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
