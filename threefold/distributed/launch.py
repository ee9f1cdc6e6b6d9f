"""Start local workers through PyTorch's elastic agent (the engine behind torchrun).

`threefold train` started directly calls `launch`; under torchrun each process is already a
worker and this module is not used.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from threefold.train import failures


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
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"threefold-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        rdzv_configs={"timeout": int(timeout_s)},
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        shutdown_timeout=max(1, math.ceil(grace_s)),
    )
    agent_log_to(log_dir)
    os.environ[failures.QUIET_ENV] = "1"  # workers record why they fail; the one line is ours
    try:
        results = elastic_launch(config, entrypoint)(*args)
    except SignalException as err:
        # The workers have stopped (saved, or were killed after grace_s) and said why.
        raise WorkersFailed(128 + int(err.sigval), "") from None
    except ChildFailedError as err:
        failed = err.failures
        first = failed[min(failed)]
        code = first.exitcode if first.exitcode and first.exitcode > 0 else 1
        what = failures.summary(log_dir, None, nproc) or (
            f"{len(failed)} worker(s) failed; first: rank {first.local_rank} exit code {first.exitcode}"
        )
        restarts = f"after {max_restarts} restart(s)" if max_restarts else "train.max_restarts is 0"
        raise WorkersFailed(code, f"{what}; giving up ({restarts}; the agent's log: {log_dir}/agent.log)") from None
    return results[0]
