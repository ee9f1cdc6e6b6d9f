"""One training process: join the group, build the grid, train, leave in order.

Runs under the elastic agent (spawned by `threefold train` or started by torchrun) or
in-process for a single-device run.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from threefold.config import Config
from threefold.distributed import drills, failures, hang
from threefold.distributed.grid import Grid, slowlink_delays
from threefold.distributed.runtime import (
    WorkerEnv,
    abandon_distributed,
    give_deadlines,
    join_group,
    layout_of,
    shutdown_distributed,
)
from threefold.errors import UserError
from threefold.training import actions
from threefold.training.signals import Stopped, StopSignals
from threefold.training.trainer import Trainer


def crash_line(err: BaseException) -> str:
    """A Python exception in one short line: its type and the first line of its message."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


def _to_stderr(*args, **kwargs) -> None:
    print(*args, **kwargs, file=sys.stderr)


def run_worker(cfg_dict: dict, measure_memory: bool = False, callbacks=None, store=None):
    """Entry point of every worker; returns the last step's metrics (rank 0's are reported), or
    with `measure_memory` every rank's memory rows (on rank 0) for `threefold memory`. `store`:
    the launcher's store of a worker seated in an elastic round (training/seats.py)."""
    env = WorkerEnv.from_environ()
    cfg = actions.planned_config(Config.from_dict(cfg_dict), env)  # a rebalance decided by an earlier attempt
    # Listening from the start: a Ctrl-C during start-up stops the run after its first step.
    stop = StopSignals.install(speaks=env.rank == 0) if threading.current_thread() is threading.main_thread() else None
    t, grid, watch = cfg.train, None, None
    try:
        # Start-up (building, resuming, the first step's compilation) waits train.startup_timeout_s
        # for the slowest rank; the trainer brings train.timeout_s in after the first step.
        device = join_group(cfg, env, t.startup_timeout_s, store)
        layout = layout_of(cfg)
        layout.check_placement(
            cfg.parallel.devices_per_node or env.local_world_size, cfg.parallel.allow_tp_across_nodes
        )
        delays = slowlink_delays(drills.parse(*drills.spec_of(t)))  # the slowlink drill
        # ZeRO's parameter all-gathers get a communicator of their own beside the reductions'.
        lanes = ("dp_cp", "expert_dp") if cfg.model.num_experts else ("dp_cp",)
        grid = Grid.build(
            layout,
            timeout=timedelta(seconds=t.startup_timeout_s),
            device=device,
            link_delays=delays,
            lanes=lanes if cfg.parallel.zero >= 1 else (),
        )
        give_deadlines(grid, t.timeout_s, t.startup_timeout_s)
        watch = _stall_watch(cfg, grid, env)
        preflight_started = time.time()
        preflight = _preflight(cfg, grid, device, env)
        preflight_s = time.time() - preflight_started
        probe = None
        if measure_memory:
            from threefold.training.memory_probe import MemoryProbe

            probe = MemoryProbe(device)
        result = Trainer(
            cfg,
            grid,
            device,
            # `threefold memory` prints its report on stdout: the run's own lines go to stderr.
            log=_to_stderr if measure_memory else print,
            probe=probe,
            restarted=env.restart_count > 0,
            stop=stop,
            callbacks=callbacks,
            fingerprint=preflight.stack.fingerprint,
            preflight_s=preflight_s,
        ).train()
        shutdown_distributed()
        return result
    except Stopped as err:
        # Every rank stopped after the same step and the checkpoint is complete: one line, the
        # signal's exit code (130 for SIGINT, 143 for SIGTERM), no traceback from any rank.
        if env.rank == 0:
            print(err.line(), file=sys.stderr, flush=True)
        shutdown_distributed()
        sys.exit(err.exit_code)
    except actions.LeaveRun as err:
        # train.on_slow acted: every rank leaves this attempt the way the action needs.
        actions.end_attempt(cfg, grid, env, err)
    except UserError as err:
        # A user mistake found only inside the worker: one line, exit 2, no traceback.
        print(f"threefold: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Exception as err:
        why = _peer_failure(err, cfg, grid)
        if why is None:
            # This rank's own failure (a bug, a bad file): recorded and named by its exception in
            # the one line, then raised on (its traceback goes to the agent's log, or to torchrun).
            failures.record(cfg.log.dir, env.restart_count, env.rank, crash_line(err), failures.CRASH)
            if failures.prints_own_line():
                print(f"threefold: rank {env.rank}: {crash_line(err)}", file=sys.stderr, flush=True)
            raise
        # A peer stopped answering or died: fail this worker with one line (the elastic agent
        # restarts the group or gives up) instead of waiting forever or dumping a traceback.
        ops = {"ops": hang.snapshot(grid.groups)} if grid is not None else None
        failures.record(cfg.log.dir, env.restart_count, env.rank, why, extra=ops)
        if failures.prints_own_line():
            detail = str(err).splitlines()[0][-160:]
            print(f"threefold: rank {env.rank}: {why}: {detail}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        # Whatever ended the run, this process leaves no group behind (a later run in it, such as
        # bench/gpu.py's next phase, joins anew); after a failure without waiting for peers.
        if watch is not None:
            watch.stop()
        abandon_distributed()
        if stop is not None:
            stop.uninstall()


def _stall_watch(cfg: Config, grid: Grid, env: WorkerEnv) -> hang.StallWatch | None:
    """This rank's stall watch (distributed/hang.py): its operation state, left in its file once
    it has made no progress for half the collective deadline in force, so that a hang can be
    attributed even to a rank that never runs Python again."""
    if env.world_size == 1:
        return None
    path = failures.state_file(cfg.log.dir, os.environ.get("TORCHELASTIC_RUN_ID", ""), env.restart_count, env.rank)
    path.unlink(missing_ok=True)  # an earlier run's, in the same log.dir and attempt number

    def deadline_s() -> float:
        d = grid.world.deadlines
        if d is None:
            return cfg.train.timeout_s
        return (d.patient if d.open_phases else d.regular).total_seconds()

    return hang.StallWatch(grid.groups, path, deadline_s).start()


def _preflight(cfg: Config, grid: Grid, device, env: WorkerEnv):
    """Before step 1: every rank's stack compared, and the node and link probes per
    train.preflight; rank 0 writes <log.dir>/preflight.json and prints each finding once. A hard
    stack difference ends every rank with exit 2 (one line, on rank 0) unless
    train.allow_stack_mismatch; anything else named is a warning."""
    from threefold.preflight.run import HARD_EXIT, PREFLIGHT, node_count, run_preflight, wants_probes, write_preflight

    probes = wants_probes(cfg.train.preflight, node_count(env.world_size, env.local_world_size))
    result = run_preflight(cfg, grid, device, probes)
    stops = result.stack.hard and not cfg.train.allow_stack_mismatch
    if env.rank == 0:
        write_preflight(Path(cfg.log.dir) / PREFLIGHT, result)
        if stops:
            why = "; ".join(line.removeprefix("threefold: ") for line in result.stack.lines)
            why += " (--train.allow_stack_mismatch true trains on)"
            # Under threefold's launcher the record is the one line it prints; under torchrun, ours.
            failures.record(cfg.log.dir, env.restart_count, env.rank, why, failures.CRASH)
            if failures.prints_own_line():
                print(f"threefold: {why}", file=sys.stderr, flush=True)
        else:
            for line in result.lines:
                print(line, file=sys.stderr, flush=True)
    if stops:
        shutdown_distributed()
        sys.exit(HARD_EXIT)
    if cfg.train.preflight_exclude and result.node is not None and result.node.named:
        _exclude_named_node(cfg, grid, device, env, result)
    return result


def _exclude_named_node(cfg: Config, grid: Grid, device, env: WorkerEnv, result) -> None:
    """train.preflight_exclude: rank 0 names the node the node probe found slow (or none) to every
    rank; that node's workers end their node as a lost machine ends (agent and workers, the
    killnode drill's way), and the others exit so that their agents re-form the job without it,
    as after a lost node (torchrun --nnodes MIN:MAX). Returns when nothing is excluded."""
    from threefold.preflight.nodes import node_index
    from threefold.preflight.run import can_shrink, decide_exclusion, node_count
    from threefold.training.faults import kill_node

    nodes = node_count(env.world_size, env.local_world_size)
    node, line = decide_exclusion(result.node, grid, device, env.restart_count == 0, can_shrink(nodes))
    if line:
        print(line, file=sys.stderr, flush=True)
    if node < 0:
        return
    if node_index(env.rank) == node:
        kill_node()
        os.kill(os.getpid(), signal.SIGKILL)
    failures.record(cfg.log.dir, env.restart_count, env.rank, f"the preflight excluded node {node}")
    sys.exit(1)


def _peer_failure(err: Exception, cfg: Config, grid: Grid | None) -> str | None:
    """Why a collective failed because of a peer (it hung or died), or None: this rank's own error.
    `grid`: None before it was built (start-up)."""
    if not isinstance(err, RuntimeError):
        return None
    text = str(err).lower()
    if "timed out" in text:
        deadlines = grid.world.deadlines if grid is not None else None
        if grid is None or (deadlines is not None and deadlines.open_phases):
            key, seconds = "train.startup_timeout_s", cfg.train.startup_timeout_s
        else:
            key, seconds = "train.timeout_s", cfg.train.timeout_s
        return f"a collective timed out after {key} = {seconds:g} s (a peer is hung or dead)"
    if "connection closed by peer" in text or "connection reset" in text:
        return "a peer closed its connection (a worker or node died)"
    return None
