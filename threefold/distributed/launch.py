"""Start local workers through PyTorch's elastic agent (the engine behind torchrun).

`threefold train` started directly calls `launch`; under torchrun each process is already a
worker and this module is not used.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


class WorkersFailed(RuntimeError):
    """A worker exited non-zero; it has already printed its own reason."""

    def __init__(self, exit_code: int, summary: str):
        super().__init__(summary)
        self.exit_code = exit_code


def launch(
    entrypoint: Callable[..., Any], args: tuple, nproc: int, threads: int, max_restarts: int, timeout_s: float
) -> Any:
    """Run `entrypoint(*args)` in `nproc` local workers; returns rank 0's return value."""
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
    )
    try:
        results = elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as err:
        failures = err.failures
        first = failures[min(failures)]
        code = first.exitcode if first.exitcode and first.exitcode > 0 else 1
        raise WorkersFailed(
            code, f"{len(failures)} worker(s) failed; first: rank {first.local_rank} exit code {first.exitcode}"
        ) from None
    return results[0]
