"""`Checkpointer`: synchronous or asynchronous saves for the training loop.

Asynchronous (`checkpoint.async`): the loop pays only for copying this rank's tensors to host
memory; a background thread writes, fsyncs, checksums and publishes them with the same
protocol as a synchronous save (temporary directory, manifest, rename, `latest` last), so a
crash at any moment still leaves the previous checkpoint intact. At most one save is in
flight: the next save, a rollback and the end of training wait for it.
"""

from __future__ import annotations

import threading
import time

from threefold.checkpoint.io import snapshot, write
from threefold.checkpoint.state import LocalTensor
from threefold.distributed import comm


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
    ):
        self.root, self.state, self.config, self.layout, self.keep = root, state, config, layout, keep
        self.asynchronous, self.on_published = asynchronous, on_published
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.group = None
        if asynchronous and comm.world_size() > 1:
            # The background thread's barrier and gather need a process group of their own.
            # Collectives on one group must be issued in the same order on every rank; the
            # training thread issues its all-reduces on the default group while this thread
            # runs at its own pace, so sharing that group would interleave them differently
            # on different ranks (mismatched collectives: a hang or silently mixed data).
            # A separate gloo group (host tensors, also under NCCL) has its own connections
            # and sequence numbers; saves are issued in the same order everywhere, so its
            # collectives match. new_group is itself collective: created once, up front.
            self.group = comm.job_group("checkpoint", backend="gloo")

    def save(self, step: int, extra: dict) -> float:
        """Save `step`; returns the seconds the caller was blocked (waiting for the previous
        save, copying to host memory, and for a synchronous save all of the writing)."""
        t0 = time.perf_counter()
        self.wait()
        shards = snapshot(self.state, copy=self.asynchronous)
        if not self.asynchronous:
            self._publish(step, shards, extra, None)
            return time.perf_counter() - t0
        self._thread = threading.Thread(
            target=self._run, args=(step, shards, extra), name="threefold-checkpoint", daemon=True
        )
        self._thread.start()
        return time.perf_counter() - t0

    def _run(self, step: int, shards, extra: dict) -> None:
        try:
            self._publish(step, shards, extra, self.group)
        except BaseException as err:  # handed to the training thread by wait()
            self._error = err

    def _publish(self, step: int, shards, extra: dict, group) -> None:
        directory = write(self.root, step, shards, self.config, self.layout, extra, self.keep, group=group)
        self.on_published(step, directory)

    def wait(self) -> None:
        """Block until the save in flight (if any) is published; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self) -> None:
        self.wait()
        if self.group is not None:
            comm.destroy_group(self.group.pg)
            self.group = None
