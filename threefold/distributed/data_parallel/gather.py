"""ZeRO 1/2: the updated parameters' all-gather, bucket by bucket, behind the next forward.

After the optimizer step each rank holds the new values of its slice of every bucket, and one
all-gather per bucket rebuilds the replicated flat buffer (in place: each rank's input is its
slice of the output). Megatron's overlap_param_gather, on threefold's buckets:

- each bucket's gather is launched as soon as the optimizer has updated that bucket, the
  buckets of the first layers first (the next forward needs them first: ZeroAdamW.step walks
  the buckets backwards), on the group's all-gather lane (Grid.lane: a communicator of its own,
  so the gathers never queue behind a gradient reduction);
- nothing waits for it until the next forward reaches a module owning parameters of the
  bucket: a forward pre-hook on every such module waits for its buckets and does nothing once
  they are in. With gradient accumulation that is the next step's first micro-batch; the later
  micro-batches find nothing pending;
- whatever reads or writes the buffer outside a forward (the next update, full_parameters,
  refresh after a checkpoint load) calls `wait_all()` first.

`overlap=False` is the path before it: the step launches every bucket's gather and waits for
all of them (parallel.overlap_param_gather false). The values gathered are the same bits
either way; only when the wait happens differs.

What a forward waits for is timed (`wait`: the step's param_gather_wait_s; with spans on also
the dp_exposed span "zero-1/2 gather"), and `replay()` times the same gathers run blocking,
back to back: the traced step's serial cost it is compared with (observe/observer.py).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
from torch import nn

from threefold.distributed import comm
from threefold.distributed.comm import Group
from threefold.distributed.timer import DeviceTimer

LABEL = "zero-1/2 gather"
"""The span label of a forward's wait for a bucket's gather (category dp_exposed)."""
ZERO3_LABEL = "zero-3 gather"
"""The span label of ZeRO 3's wait for a unit's gather (params.py)."""
LABELS = (LABEL, ZERO3_LABEL)
"""The parameter gathers' waits: what a traced step compares with their replay (observe/observer.py)."""


class ParamGather:
    """One all-gather per bucket of the replicated parameter buffer (`full`, each bucket's view),
    from this rank's updated slices (`owned`, views of the same buffer), on `group`."""

    def __init__(self, full: list[torch.Tensor], owned: list[torch.Tensor], group: Group, overlap: bool = True):
        self.full, self.owned, self.group, self.overlap = full, owned, group, overlap
        self.works: list = [None] * len(full)
        self.pending = 0
        """Gathers launched and not waited for yet."""
        self.wait_timer = DeviceTimer(full[0].device)
        self.spans = None  # a span recorder (threefold.observe) timing the waits as dp_exposed, or None
        self._hooks: list = []

    def attach(self, chunks: list[nn.Module], bucket_of: dict[int, int]) -> None:
        """A forward pre-hook on every module of `chunks` that owns parameters of the buckets
        (`bucket_of`: id(param) -> bucket): it waits for those buckets' gathers."""
        for chunk in chunks:
            for module in chunk.modules():
                mine = sorted({bucket_of[id(p)] for p in module.parameters(recurse=False) if id(p) in bucket_of})
                if mine:
                    self._hooks.append(module.register_forward_pre_hook(self._before_forward(tuple(mine))))

    def _before_forward(self, buckets: tuple[int, ...]):
        def hook(module, args) -> None:
            if self.pending:  # after the first use of a bucket its modules cost one check
                for b in buckets:
                    self.wait(b)

        return hook

    def start(self, b: int) -> None:
        """Launch bucket `b`'s all-gather (its slice is updated); the step waits for it at once
        when the gather is not overlapped (see `finish_step`)."""
        if self.group.size == 1:
            return
        self.works[b] = comm.all_gather_into(self.full[b], self.owned[b], self.group, async_op=True)
        self.pending += 1

    def finish_step(self) -> None:
        """The end of the optimizer step: without overlap every gather is waited for here."""
        if not self.overlap:
            self.wait_all()

    def wait(self, b: int) -> None:
        """Make bucket `b` whole: wait for its gather if one is in flight (timed)."""
        work = self.works[b]
        if work is None:
            return
        token = self.wait_timer.start()  # on CUDA an event pair: wait() only stalls the stream
        with contextlib.nullcontext() if self.spans is None else self.spans.span("dp_exposed", LABEL):
            comm.wait(work, self.group, spans=False)
        self.wait_timer.stop(token)
        self.works[b] = None
        self.pending -= 1

    def wait_all(self) -> None:
        for b in range(len(self.works)):
            self.wait(b)

    def gather_all(self) -> None:
        """Every bucket gathered now, blocking (after a checkpoint load rewrote the slices)."""
        self.wait_all()
        for b in range(len(self.full)):
            self.start(b)
        self.wait_all()

    def take_wait(self) -> DeviceTimer:
        """The time forwards (and updates) waited for gathers since the last take, unread."""
        return self.wait_timer.take()

    def replay(self, repeats: int = 5) -> float:
        """Median seconds of one step's gathers run blocking, back to back, on scratch buffers of
        the same sizes (collective over the group): what the overlap has to hide."""
        if self.group.size == 1:
            return 0.0
        like = {"dtype": self.full[0].dtype, "device": self.full[0].device}
        out = torch.zeros(max(f.numel() for f in self.full), **like)
        mine = torch.zeros(max(o.numel() for o in self.owned), **like)
        times = []
        with comm.unrecorded(self.group):  # a measurement, not the step's traffic
            for _ in range(repeats):
                comm.barrier(self.group)
                t0 = time.perf_counter()
                for full, owned in zip(self.full, self.owned):
                    comm.all_gather_into(out[: full.numel()], mine[: owned.numel()], self.group)
                if out.device.type == "cuda":
                    torch.cuda.synchronize(out.device)
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
