"""Start local workers through PyTorch's elastic agent (the engine behind torchrun).

`threefold train` started directly calls `launch`; under torchrun each process is already a
worker and this module is not used.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.multiprocessing.tail_log import TailLog
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from threefold.distributed import failures


class WorkersFailed(RuntimeError):
    """A worker exited non-zero; it has already printed its own reason."""

    def __init__(self, exit_code: int, summary: str):
        super().__init__(summary)
        self.exit_code = exit_code


def agent_log_to(log_dir: str) -> Path:
    """The elastic agent's own messages (its warnings, the tracebacks of workers it restarts)
    into <log_dir>/agent.log instead of the console, where the workers' one-line reports go."""
    path = Path(log_dir) / "agent.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.threefold = True
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # torch's own console handler sits on these; the agent logs under the first, the
    # multiprocessing context it starts workers with under the second.
    for name in ("torch.distributed", "torch.multiprocessing"):
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            logger.removeHandler(old)
            if getattr(old, "threefold", False):
                old.close()
        logger.addHandler(handler)
        logger.propagate = False
    return path


class WorkerLogs(LogsSpecs):
    """Each worker's stderr into its file (failures.worker_files), copied to this console line for
    line as it is written (no prefix: the workers' one-line reports read as they would), and its
    error file beside it. Called by the agent as it starts each attempt (`reify`): by then the
    previous attempt's workers are gone, and what their files say of why they died is recorded
    for the restarted rank 0 to report (failures.record_left_behind): a rank that NCCL's
    watchdog aborted runs no Python to say so itself."""

    def __init__(self, log_dir: str, run: str):
        super().__init__(log_dir)
        self.run = run
        self.attempt: int | None = None
        self._tail: TailLog | None = None

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        attempt = int(envs[0]["TORCHELASTIC_RESTART_COUNT"]) if envs else 0
        self.close()
        if self.attempt is not None:
            failures.record_left_behind(self._root_log_dir, self.run, self.attempt)
        self.attempt = attempt
        stderrs, error_files = {}, {}
        for local_rank, env in envs.items():
            stderr, error_file = failures.worker_files(self._root_log_dir, self.run, attempt, int(env["RANK"]))
            stderr.parent.mkdir(parents=True, exist_ok=True)
            stderrs[local_rank], error_files[local_rank] = str(stderr), str(error_file)
            env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
        self._tail = TailLog("worker", stderrs, sys.stderr, dict.fromkeys(stderrs, "")).start()
        return LogsDest(dict.fromkeys(envs, ""), stderrs, {}, {}, error_files)

    def close(self) -> None:
        """Copy what the last attempt's workers wrote to the console, to the end."""
        if self._tail is not None:
            self._tail.stop()
            self._tail = None


def _crash_lines(failed: dict) -> str:
    """The first failed worker of torch's ChildFailedError in words, when no record names it."""
    rank = min(failed)
    first = failed[rank]
    message = first.message.get("message", "") if isinstance(first.message, dict) else first.message
    if os.path.isfile(first.error_file) and str(message).strip():
        return f"rank {rank}: {str(message).strip().splitlines()[0][:200]}"
    how = f"killed by {first.signal_name()}" if first.exitcode < 0 else f"exit code {first.exitcode}"
    return f"{len(failed)} worker(s) failed; first: rank {rank} {how}"


def launch(
    entrypoint: Callable[..., Any],
    args: tuple,
    nproc: int,
    threads: int,
    max_restarts: int,
    timeout_s: float,
    log_dir: str = "runs/latest",
    grace_s: float = 30.0,
) -> Any:
    """Run `entrypoint(*args)` in `nproc` local workers; returns rank 0's return value. A
    SIGINT or SIGTERM the agent receives is forwarded to the workers, which save and exit within
    `grace_s` (then the agent kills them) and say so themselves."""
    # Workers read OMP_NUM_THREADS when torch starts: oversubscribed cores slow gloo ranks ~7x.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    # Restarted workers must not reuse the dead attempt's store (stale gloo keys).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    run_id = f"threefold-{uuid.uuid4().hex[:8]}"
    logs = WorkerLogs(log_dir, run_id)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        rdzv_configs={"timeout": int(timeout_s)},
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        shutdown_timeout=max(1, math.ceil(grace_s)),
        logs_specs=logs,
    )
    agent_log_to(log_dir)
    os.environ[failures.QUIET_ENV] = "1"  # workers record why they fail; the one line is ours
    try:
        results = elastic_launch(config, entrypoint)(*args)
    except SignalException as err:
        # The workers have stopped (saved, or were killed after grace_s) and said why.
        logs.close()
        raise WorkersFailed(128 + int(err.sigval), "") from None
    except ChildFailedError as err:
        logs.close()
        failed = err.failures
        first = failed[min(failed)]
        code = first.exitcode if first.exitcode and first.exitcode > 0 else 1
        if logs.attempt is not None:
            failures.record_left_behind(log_dir, run_id, logs.attempt)
        what = failures.summary(log_dir, logs.attempt, nproc, run=run_id) or _crash_lines(failed)
        restarts = f"after {max_restarts} restart(s)" if max_restarts else "train.max_restarts is 0"
        raise WorkersFailed(code, f"{what}; giving up ({restarts}; the agent's log: {log_dir}/agent.log)") from None
    finally:
        logs.close()
    return results[0]
