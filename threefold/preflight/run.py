"""The preflight of a run: the stack fingerprint always, then the node and link probes when
asked, with the drills of train.faults / THREEFOLD_FAULT applied from outside the checks.

    result = run_preflight(cfg, grid, device, probes=True)   # collective over grid's world
    result.lines                                             # on rank 0: every finding, one line each
    write_preflight(Path(cfg.log.dir) / PREFLIGHT, result)  # rank 0

What `threefold doctor` runs, and `threefold train` before its first step (train.preflight).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from threefold.atomic import atomic_write
from threefold.config import Config
from threefold.distributed import comm, drills
from threefold.distributed.grid import Grid
from threefold.preflight.fingerprint import apply_stack_drill, fingerprint
from threefold.preflight.link_probe import LinkReport, probe_links
from threefold.preflight.node_probe import NodeReport, probe_node
from threefold.preflight.nodes import where
from threefold.preflight.stack import StackReport, check_stack

PREFLIGHT = "preflight.json"
HARD_EXIT = 2
"""A hard stack difference: the run cannot be trusted to compute the same thing on every rank."""
NAMED_EXIT = 1
"""Something else named (an environment difference, a slow node or link)."""


@dataclass
class Preflight:
    stack: StackReport
    node: NodeReport | None
    link: LinkReport | None

    @property
    def lines(self) -> list[str]:
        """Every finding in one line each (filled on rank 0)."""
        reports = [self.stack, self.node, self.link]
        return [line for r in reports if r is not None for line in r.lines]

    @property
    def named(self) -> bool:
        """Something differs or drags; the same on every rank."""
        probes = [r.named for r in (self.node, self.link) if r is not None]
        return self.stack.hard or self.stack.soft or any(probes)

    @property
    def exit_code(self) -> int:
        """threefold doctor's exit status: 2 for a hard stack difference, 1 for anything else
        named, 0 when nothing is."""
        return HARD_EXIT if self.stack.hard else NAMED_EXIT if self.named else 0

    def to_json(self) -> dict:
        return {
            "hard": self.stack.hard,
            "named": self.named,
            "lines": self.lines,
            "fingerprint": self.stack.fingerprint,
            "stack": self.stack.record,
            "node": self.node.record if self.node is not None else None,
            "link": self.link.record if self.link is not None else None,
        }


def probe_dtype(name: str, device: torch.device) -> torch.dtype:
    """The run's compute dtype (train.dtype), which the node probe's GEMM runs at."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def node_count(world_size: int, local_world_size: int, environ: dict | None = None) -> int:
    """The nodes the world spans: torchrun's agents (GROUP_WORLD_SIZE, one per node), else the
    world over the ranks that share a node."""
    env = os.environ if environ is None else environ
    if env.get("GROUP_WORLD_SIZE"):
        return int(env["GROUP_WORLD_SIZE"])
    return max(1, -(-world_size // max(1, local_world_size)))


def wants_probes(setting: str, nodes: int) -> bool:
    """train.preflight: on, off, or auto (the probes when the world spans more than one node)."""
    return setting == "on" or (setting == "auto" and nodes > 1)


def link_delays(cfg: Config) -> tuple[tuple[int, int, float], ...]:
    """Grid.build's link_delays: the slowlink drills of train.faults / THREEFOLD_FAULT."""
    from threefold.distributed.grid import slowlink_delays

    return slowlink_delays(drills.parse(*drills.spec_of(cfg.train)))


def run_preflight(cfg: Config, grid: Grid, device: torch.device, probes: bool) -> Preflight:
    """The fingerprint compared across ranks (part A), then with `probes` the node probe and the
    link probe. Collective over `grid`'s world; every rank returns the same verdict. The drills
    act as a real difference would look from inside the rank: `stack` overrides this rank's
    fingerprint values, `slowdevice` stretches its probe kernels (slowlink sits in the grid's
    groups)."""
    spec, key = drills.spec_of(cfg.train)
    mine = [f for f in drills.parse(spec, key) if f.rank == grid.global_rank]
    fp = fingerprint(device)
    for fault in mine:
        if fault.kind == "stack":
            fp = apply_stack_drill(fp, fault.stack)
    stack = check_stack(grid, device, fp)
    if not probes:
        return Preflight(stack, None, None)
    slow_factor = 1.0
    for fault in mine:
        if fault.kind == "slowdevice":
            slow_factor *= fault.factor
    node = probe_node(grid, device, probe_dtype(cfg.train.dtype, device), slow_factor=slow_factor)
    link = probe_links(grid, device)
    return Preflight(stack, node, link)


def node_to_exclude(report: NodeReport, rank: int, first_attempt: bool, can_shrink: bool) -> tuple[int, str]:
    """Rank 0's choice for train.preflight_exclude (pure): (the node to leave out, the one line
    saying why) or (-1, why not; "" when nothing was named). A node is left out only when every
    rank the node probe named is on it (a whole kind under its datasheet peak, or slow ranks on
    several nodes, is not one bad machine), only on the elastic agent's first attempt (the
    restarted, smaller world probes again but never excludes: no loop), and only when the
    launch has room to shrink (`can_shrink`: more than one node and restarts left). The link
    probe's slow hops are never excluded: a hop joins two ranks, and which end is at fault is a
    guess."""
    if rank != 0 or not report.named:
        return -1, ""
    named = report.record.get("named", [])
    nodes = {row["rank"]: row["node"] for row in report.record.get("ranks", [])}
    named_nodes = sorted({nodes[r] for r in named})
    if len(named_nodes) != 1:
        return -1, f"threefold: preflight: not excluding: the named ranks are on nodes {named_nodes}, not one"
    if not first_attempt:
        return -1, "threefold: preflight: not excluding again after a restart (train.preflight_exclude acts once)"
    if not can_shrink:
        needs = "torchrun --nnodes MIN:MAX over several nodes and --max-restarts > 0"
        return -1, f"threefold: preflight: not excluding: needs {needs}"
    node = named_nodes[0]
    # The node probe's own line says why; with several ranks named, the first line and the rest.
    finding = report.lines[0].removeprefix("threefold: node: ") if report.lines else where(named, nodes)
    more = f"; of {where(named, nodes)}" if len(named) > 1 else ""
    line = (
        f"threefold: preflight: excluding node {node}, named by the node probe: {finding}{more}; "
        "the other nodes re-form the job without it (train.preflight_exclude)"
    )
    return node, line


def decide_exclusion(report: NodeReport, grid: Grid, device: torch.device, first_attempt: bool, can_shrink: bool):
    """(node, line): rank 0's node_to_exclude on every rank, as one float64 (the node index or -1)
    broadcast over the world; `line` is filled on rank 0. Collective: call it on every rank when
    the node probe ran and named something (report.named is the same on every rank)."""
    node, line = node_to_exclude(report, grid.global_rank, first_attempt, can_shrink)
    decided = comm.broadcast(torch.tensor([float(node)], dtype=torch.float64, device=device), grid.world)
    return int(decided.item()), line


def can_shrink(nodes: int, environ: dict | None = None) -> bool:
    """An elastic launch with room to lose a node: torchrun's agents over several nodes and
    restarts left to re-form the job (TORCHELASTIC_MAX_RESTARTS)."""
    env = os.environ if environ is None else environ
    return bool(env.get("GROUP_WORLD_SIZE")) and nodes > 1 and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0


def write_preflight(path: str | Path, result: Preflight) -> Path:
    """<log.dir>/preflight.json (rank 0): the verdict, every line and each part's record."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(result.to_json(), indent=2, default=str) + "\n")
    return path
