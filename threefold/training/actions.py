"""train.on_slow: what a node or pipeline stage that stays slow leads to.

    actions = Actions(cfg, grid, is_logger, log)         # the Trainer's
    actions.after_step(step, record, diagnosis, report)  # every rank, every step (the loop)
    cfg = planned_config(cfg, env)                       # the worker, before the layout
    end_attempt(cfg, grid, env, err)                     # the worker, on LeaveRun

On report steps rank 0 reads the diagnosis' findings (observe/diagnose.py). A target, a node
(slow_node, or every rank of a node named slow_rank) or a pipeline stage (slow_stage, or the
stage of a slow node or rank in a pipelined layout), that is named on train.on_slow_reports
report steps in a row is acted on:

    warn       one line, once per target, saying what exclude or rebalance would do
    exclude    the node leaves as a lost node does (training/faults.py kill_node: its agent and
               workers), the other ranks exit 1 and their agents re-form the job without it
               (torchrun --nnodes MIN:MAX); the restart resumes from the checkpoint, dp re-planned
               over fewer ranks with the same global batch and data order
    rebalance  an uneven layer partition from the measured stage speeds
               (distributed/pipeline/partition.py) goes to <log.dir>/rebalance.json under the
               elastic run's id, every rank exits 1, and the agent's restart trains with it
               (planned_config sets parallel.stage_layers; checkpoints reshard across partitions)

An action waits for the next checkpoint (checkpoint.interval) so that the restart loses no
steps; with an asynchronous save, for the first report step after it (the save is published
there). Rank 0 decides and tells every rank in one broadcast of three numbers on report steps,
until a decision is taken; nothing runs on other steps. Every action is one console line, a
record in failures.jsonl per leaving rank, and a fault time in faults.jsonl, so goodput counts
the restart it causes as it counts a lost node's (observe/goodput.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from threefold.atomic import atomic_write
from threefold.distributed import comm, failures
from threefold.distributed.pipeline.partition import partition_for_speeds, stage_costs, stage_counts, stage_times
from threefold.observe.goodput import record_fault

WARN = "warn"
"""failures.jsonl's kind of a warning train.on_slow gave (nothing failed)."""
REBALANCE = "rebalance.json"
NONE, EXCLUDE, RE = 0.0, 1.0, 2.0
"""The broadcast's action codes."""


class LeaveRun(Exception):
    """Raised on every rank when an action ends this attempt (exclude, rebalance)."""

    def __init__(self, action: str, node: int = -1):
        super().__init__(f"train.on_slow {action}")
        self.action, self.node = action, node


@dataclass(frozen=True)
class Target:
    action: str
    """What would act on it: "exclude" or "rebalance"."""
    key: str
    """"node 1", "stage 0"."""
    finding: object
    """The finding that names it on this report."""


class Decider:
    """Rank 0's choice, pure (no collectives, no files): streaks of targets over report steps."""

    def __init__(self, mode: str, needed: int, pp: int, local_world_size: int, stage_of, not_able: dict[str, str]):
        """`stage_of(rank)`: a rank's pipeline stage. `not_able[action]`: why that action
        cannot act in this attempt ("" when it can)."""
        self.mode, self.needed, self.pp = mode, max(1, needed), pp
        self.local, self.stage_of, self.not_able = max(1, local_world_size), stage_of, not_able
        self.streak: dict[str, int] = {}
        self.said: set[str] = set()
        self.refused: set[str] = set()
        """Targets the action looked at and left (no checkpoint due, no faster partition): once."""

    def targets(self, step: int, findings) -> list[Target]:
        """The targets the findings named on report step `step` (counted from 1) make."""
        fresh = [f for f in findings if f.step == step]
        out: dict[tuple[str, str], Target] = {}
        slow_ranks = {r for f in fresh if f.kind == "slow_rank" for r in f.ranks}
        for f in fresh:
            if f.kind == "slow_stage" and f.stage is not None:
                out.setdefault(("rebalance", f"stage {f.stage}"), Target("rebalance", f"stage {f.stage}", f))
            if f.kind not in ("slow_node", "slow_rank"):
                continue
            node = f.node if f.node is not None else (f.ranks[0] // self.local if f.ranks else None)
            whole = f.kind == "slow_node" or (
                node is not None and all(r in slow_ranks for r in range(node * self.local, (node + 1) * self.local))
            )
            if whole and node is not None:
                out.setdefault(("exclude", f"node {node}"), Target("exclude", f"node {node}", f))
            if self.pp > 1:
                for stage in sorted({self.stage_of(r) for r in f.ranks}):
                    out.setdefault(("rebalance", f"stage {stage}"), Target("rebalance", f"stage {stage}", f))
        return list(out.values())

    def on_report(self, step: int, findings) -> tuple[list[str], Target | None]:
        """(lines to print, the target to act on or None) for report step `step` (from 1)."""
        named = self.targets(step, findings)
        keys = {t.key for t in named}
        self.streak = {k: n for k, n in self.streak.items() if k in keys}  # a quiet report ends a streak
        lines: list[str] = []
        for target in named:
            self.streak[target.key] = self.streak.get(target.key, 0) + 1
        for target in named:
            if self.streak[target.key] < self.needed:
                continue
            if self.mode == target.action and not self.not_able.get(target.action) and target.key not in self.refused:
                return lines, target
            if target.key in self.said or target.key in self.refused:
                continue
            self.said.add(target.key)
            head = f"threefold: on_slow {self.mode}: {target.key} named for {self.streak[target.key]} reports in a row"
            head += f" ({target.finding.text})"
            if self.mode == target.action:
                lines.append(f"{head}; not acting: {self.not_able[target.action]}")
            else:
                lines.append(f"{head} (train.on_slow {target.action} would act)")
        return lines, None


def rebalanced(cfg, target: Target, findings) -> list[int]:
    """The new layer counts per virtual stage for a slow `target` stage: from the slow-stage
    finding's measured compute, or from a slow node's or rank's speed (its figure over its peers'),
    with slow layers (slow_layer findings) weighed by their own figure."""
    m, p = cfg.model, cfg.parallel
    counts = stage_counts(m, p.pp, p.vpp, p.stage_layers)
    weights = [1.0] * m.layers
    for f in findings:
        if f.kind == "slow_layer" and f.layer is not None and 0 <= f.layer < m.layers and f.baseline > 0:
            weights[f.layer] = max(1.0, f.value / f.baseline)
    f = target.finding
    if f.kind == "slow_stage" and len(f.extra.get("compute_s", [])) == p.pp:
        compute = list(f.extra["compute_s"])
    else:
        # The modelled time of each stage, stretched on the slow ranks' stages by their figure.
        times = stage_times(counts, *stage_costs(m), None, weights)
        compute = [sum(times[v] for v in range(len(counts)) if v % p.pp == r) for r in range(p.pp)]
        # A slow rank's figure is its seconds over its peers' median; a slow node's, the factor itself.
        factor = f.value / f.baseline if f.baseline > 0 else f.value
        stage = int(target.key.split()[1])
        compute[stage] *= max(1.0, factor)
    return partition_for_speeds(m, p.pp, counts, compute, weights)[0]


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _restarts_left() -> int:
    env = os.environ
    return int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))


def not_able(cfg, world: int, local_world_size: int) -> dict[str, str]:
    """Why each action cannot act in this attempt ("" when it can): the same on every rank (from
    the config and the launcher's environment only), so every rank agrees whether the decision's
    broadcast runs."""
    from threefold.preflight.run import can_shrink, node_count

    c, common = cfg.checkpoint, ""
    if not (c.dir and c.interval):
        common = "needs checkpoint.dir and checkpoint.interval (the restart resumes from the checkpoint)"
    elif not os.environ.get("TORCHELASTIC_RUN_ID"):
        common = "needs the elastic agent (train.max_restarts > 0, or torchrun --max-restarts > 0)"
    elif _restarts_left() <= 0:
        common = "no restart left (train.max_restarts, torchrun --max-restarts)"
    nodes = node_count(world, local_world_size)
    exclude = common or (
        "" if can_shrink(nodes) else "needs torchrun --nnodes MIN:MAX over several nodes and --max-restarts > 0"
    )
    rebalance = common or ("" if cfg.parallel.pp > 1 else "needs pipeline stages (parallel.pp > 1)")
    return {"exclude": exclude, "rebalance": rebalance}


def _fits_without(cfg, world: int, local_world_size: int) -> str:
    """Why the job would not fit on one node fewer ("" when it does): parallel.dp 0 re-planned."""
    from threefold.config import Config
    from threefold.errors import ConfigError
    from threefold.validate import validate

    smaller = Config.from_dict(cfg.to_dict())
    smaller.parallel.dp = 0
    try:
        validate(smaller, world - local_world_size)
    except ConfigError as err:
        return f"on {world - local_world_size} ranks the job does not fit: {err}"
    return ""


class Actions:
    def __init__(self, cfg, grid, is_logger: bool, log=print):
        t, c = cfg.train, cfg.checkpoint
        self.cfg, self.grid, self.is_logger, self.log = cfg, grid, is_logger, log
        self.mode = t.on_slow
        self.local = int(os.environ.get("LOCAL_WORLD_SIZE", grid.world.size))
        self.not_able = not_able(cfg, grid.world.size, self.local)
        # The broadcast runs only where the mode can act: warn (and an action that cannot act)
        # costs the other ranks nothing.
        self.collective = self.mode != "warn" and not self.not_able[self.mode] and grid.world.size > 1
        self.decider = None
        if is_logger:
            pp, layout = cfg.parallel.pp, grid.layout
            self.decider = Decider(
                self.mode, t.on_slow_reports, pp, self.local, lambda r: layout.coords(r)["pp"], self.not_able
            )
        self.asynchronous = bool(c.async_save)
        self.pending: tuple[float, int, int] | None = None  # (code, node, save step) once decided
        self.partition: list[int] | None = None  # rank 0's, for a rebalance
        self.next_save = None
        """checkpoint.interval auto: the attempt's cadence (training/cadence.py) says when it saves."""

    def after_step(self, step: int, record: dict, diagnosis, report: bool) -> None:
        """Every rank, every step after the diagnosis; collective over the world only on report
        steps (rank 0 decides, one broadcast); raises LeaveRun on every rank to act."""
        if self.pending is not None:
            code, node, save_step = self.pending
            if step == save_step if not self.asynchronous else (report and step > save_step):
                self._act(step, code, node)
            return
        if not report or (self.decider is None and not self.collective):
            return
        decided = [NONE, -1.0, -1.0]
        if self.decider is not None:
            lines, target = self.decider.on_report(step + 1, list(diagnosis.active.values()))
            for line in lines:  # warn: each once, with a record (no failure: summaries skip it)
                self.log(line)
                failures.record(self.cfg.log.dir, _attempt(), 0, line.removeprefix("threefold: "), WARN)
            if target is not None:
                decided = self._decide(step, target, list(diagnosis.active.values()))
                if decided[0] == NONE:
                    self.decider.refused.add(target.key)
        if self.collective:
            box = torch.tensor(decided, dtype=torch.float64, device=self.grid.world.device)
            decided = comm.broadcast(box, self.grid.world).tolist()
        if decided[0] != NONE:
            self.pending = (decided[0], int(decided[1]), int(decided[2]))
            if not self.asynchronous and step == self.pending[2]:
                self._act(step, decided[0], int(decided[1]))

    def _decide(self, step: int, target: Target, findings) -> list[float]:
        """Rank 0: the action for `target`, its one line, and when it acts ([code, node, save
        step]; NONE where it cannot after all)."""
        save = self._next_save(step)
        streak = f"{target.key} named for {self.decider.streak[target.key]} reports in a row ({target.finding.text})"
        if save is None:
            self.log(f"threefold: on_slow {self.mode}: {streak}; not acting: no checkpoint is due before the run ends")
            return [NONE, -1.0, -1.0]
        at = f"after the checkpoint of step {save + 1}"
        if target.action == "exclude":
            node = int(target.key.split()[1])
            why = _fits_without(self.cfg, self.grid.world.size, self.local)
            if why:
                self.log(f"threefold: on_slow exclude: {streak}; not acting: {why}")
                return [NONE, -1.0, -1.0]
            self.log(
                f"threefold: on_slow exclude: {streak}; leaving node {node} out {at}: the other nodes re-form "
                "the job without it (train.on_slow exclude)"
            )
            return [EXCLUDE, float(node), float(save)]
        p = self.cfg.parallel
        now = stage_counts(self.cfg.model, p.pp, p.vpp, p.stage_layers)
        new = rebalanced(self.cfg, target, findings)
        if new == now:
            self.log(f"threefold: on_slow rebalance: {streak}; not acting: no other partition is faster")
            return [NONE, -1.0, -1.0]
        self.partition = new
        self.log(
            f"threefold: on_slow rebalance: {streak}; restarting {at} with layers per stage "
            f"{_text(new)} instead of {_text(now)} (train.on_slow rebalance)"
        )
        return [RE, -1.0, float(save)]

    def _next_save(self, step: int) -> int | None:
        """The first step from `step` on whose checkpoint is saved (0-based), short of the last
        step (the run ends there anyway); None when none is."""
        c, steps = self.cfg.checkpoint, self.cfg.train.steps
        if c.interval == "auto":
            due = self.next_save(step) if self.next_save is not None else steps
        else:
            due = step + (-(step + 1) % c.interval)
        return due if due + 1 < steps else None

    def _act(self, step: int, code: float, node: int) -> None:
        """Every rank: record why this rank leaves (the ranks of an excluded node leave no
        record: they end as a lost node does), rank 0 the rebalance file and the fault time."""
        from threefold.preflight.nodes import node_index

        cfg, rank = self.cfg, self.grid.global_rank
        attempt = _attempt()
        action = "exclude" if code == EXCLUDE else "rebalance"
        if rank == 0:
            record_fault(cfg.log.dir, rank, f"on_slow_{action}", step)
            if action == "rebalance":
                write_rebalance(cfg.log.dir, _text(self.partition), step + 1)
        if action == "exclude" and node_index(rank) != node:
            failures.record(cfg.log.dir, attempt, rank, f"train.on_slow exclude left node {node} out", failures.ACTION)
        elif action == "rebalance":
            why = "train.on_slow rebalance: a new pipeline partition"
            failures.record(cfg.log.dir, attempt, rank, why, failures.ACTION)
        raise LeaveRun(action, node)


def _text(counts: list[int]) -> str:
    return ",".join(map(str, counts))


def write_rebalance(log_dir: str | Path, stage_layers: str, step: int, run: str | None = None) -> Path:
    """<log_dir>/rebalance.json: the partition the restart of elastic run `run` (default: this
    worker's) trains with, beside the earlier runs' entries."""
    path = Path(log_dir) / REBALANCE
    run = os.environ.get("TORCHELASTIC_RUN_ID", "") if run is None else run
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    entries[run] = {"stage_layers": stage_layers, "step": step}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(entries, indent=1) + "\n")
    return path


def end_attempt(cfg, grid, env, err: LeaveRun) -> None:
    """In the worker: how an attempt that an action ended leaves. An excluded node's workers end
    their node (agent and workers, the killnode drill's way); every other rank exits 1, so its
    agent restarts it (re-forming the job without the excluded node)."""
    from threefold.preflight.nodes import node_index
    from threefold.training.faults import kill_node

    if err.action == "exclude" and node_index(env.rank) == err.node:
        kill_node()
        os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(1)


def planned_config(cfg, env):
    """In the worker, before the layout: the config with a rebalance an earlier attempt of this
    elastic run decided (<log.dir>/rebalance.json) applied as parallel.stage_layers."""
    from threefold.distributed.pipeline.partition import parse_stage_layers
    from threefold.errors import ConfigError

    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if not run or env.restart_count == 0:
        return cfg
    try:
        entry = json.loads((Path(cfg.log.dir) / REBALANCE).read_text()).get(run)
    except (OSError, ValueError):
        return cfg
    if not entry:
        return cfg
    p, text = cfg.parallel, entry.get("stage_layers", "")
    try:
        parse_stage_layers(text, cfg.model.layers, p.pp * p.vpp)
    except ConfigError as err:  # another layout than the one it was cut for: train on without it
        if env.rank == 0:
            print(f"threefold: on_slow rebalance: not applying {REBALANCE}: {err}", file=sys.stderr, flush=True)
        return cfg
    if env.rank == 0:
        was = _text(stage_counts(cfg.model, p.pp, p.vpp, p.stage_layers))
        print(
            f"threefold: on_slow rebalance: layers per stage {text} (was {was}), from step {entry.get('step')}",
            file=sys.stderr,
            flush=True,
        )
    p.stage_layers = text
    return cfg
