"""`Checkpointer`: synchronous or asynchronous saves for the training loop.

Asynchronous (`checkpoint.async`): the loop pays only for copying this rank's tensors into
host buffers kept for the run (io.HostSnapshot: pinned for accelerator tensors, non-blocking
copies, one sync); a background thread writes, fsyncs and checksums this rank's file and does
nothing else. The metadata round (reports to rank 0, manifest, rename, `latest` last, the
outcome broadcast) needs every rank at the same point, so it runs on the caller's thread, on
the main communicator, at the first report step after the save (every log.interval steps;
the training loop calls wait()), when the next save begins, or at close (the end of training,
a rollback): a crash before then leaves the previous checkpoint. No second process group is
needed: the training thread is the only one that communicates, so collectives stay in the same
order on every rank (and object collectives on NCCL use the current device, which only the main
thread sets).
"""

from __future__ import annotations

import threading
import time

from threefold.checkpoint.io import HostSnapshot, publish, snapshot, write_shards
from threefold.checkpoint.state import LocalTensor
from threefold.distributed import comm
from threefold.distributed.runtime import patient


class Checkpointer:
    def __init__(
        self,
        root: str,
        state: list[LocalTensor],
        config: dict,
        layout: dict,
        keep: int,
        asynchronous: bool,
        on_published=lambda step, directory: None,
        group: comm.Group | None = None,
    ):
        """`group`: the communicator of the metadata round (the grid's world; None = the job's
        default group)."""
        self.root, self.state, self.config, self.layout, self.keep = root, state, config, layout, keep
        self.asynchronous, self.on_published = asynchronous, on_published
        self.group = group or comm.job_group()
        self._thread: threading.Thread | None = None
        self._pending: tuple[int, dict, dict] | None = None  # step, extra, {"report": ...} of the save in flight
        self.host = HostSnapshot()  # an asynchronous save's buffers, reused from save to save
        self.fail_next: OSError | None = None
        """An error the next save's write meets instead of writing (the enospc drill)."""

    def save(self, step: int, extra: dict) -> float:
        """Save `step`; returns the seconds the caller was blocked (publishing the previous
        save, copying to host memory, and for a synchronous save all of the writing)."""
        t0 = time.perf_counter()
        self.wait()  # the buffers the snapshot overwrites are free once the last write ended
        error, self.fail_next = self.fail_next, None
        if not self.asynchronous:
            shards = snapshot(self.state)
            self._publish(step, extra, self._write_or_fail(step, shards, error))
            return time.perf_counter() - t0
        shards = self.host.take(self.state)
        box: dict = {}
        self._pending = (step, extra, box)
        self._thread = threading.Thread(
            target=self._write, args=(step, shards, box, error), name="threefold-checkpoint", daemon=True
        )
        self._thread.start()
        return time.perf_counter() - t0

    def _write_or_fail(self, step: int, shards, error: OSError | None) -> dict:
        if error is not None:
            return {"error": f"rank {self.group.rank}: {error}"}
        return write_shards(self.root, step, shards, self.group.rank)

    def _write(self, step: int, shards, box: dict, error: OSError | None = None) -> None:
        box["report"] = self._write_or_fail(step, shards, error)  # file I/O only

    def _publish(self, step: int, extra: dict, report: dict) -> None:
        # The ranks that write (dp rank 0 alone under ZeRO 0) come here after their files are
        # written, rank 0 prunes after the outcome: the others wait under the long deadline.
        with patient(self.group):
            directory = publish(self.root, step, report, self.config, self.layout, extra, self.keep, self.group)
        self.on_published(step, directory)

    @property
    def in_flight(self) -> bool:
        """An asynchronous save is written or being written, not yet published."""
        return self._thread is not None

    def wait(self) -> None:
        """Publish the save in flight (if any): wait for this rank's file, then the metadata
        round (collective: every rank calls it at the same point); a failed write on any rank
        raises the same CheckpointError on every rank."""
        if self._thread is None:
            return
        self._thread.join()
        step, extra, box = self._pending
        self._thread = self._pending = None
        self._publish(step, extra, box.get("report", {"error": f"rank {self.group.rank}: the write did not finish"}))

    def close(self) -> None:
        self.wait()
