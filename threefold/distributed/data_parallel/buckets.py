"""Gradient buffers and their bucketed reduction over dp, overlapped with backward.

Each bucket's gradients live in one contiguous tensor (a slice of a flat buffer for ZeRO 0/1,
a buffer allocated when its first gradient arrives and dropped after its reduce-scatter for
ZeRO 2/3). A post-accumulate-grad hook on every parameter moves the gradient in (for ZeRO 0/1
with matching dtypes, `param.grad` is a view of the buffer and autograd accumulates in place,
as DDP's gradient_as_bucket_view). When the last gradient of a bucket arrives during a
synchronized backward, the bucket's collective is launched asynchronously, so it runs on
gloo's/NCCL's own threads/streams while backward continues with earlier layers:

- ZeRO 0: all_reduce(SUM) of the whole bucket (every rank needs every gradient);
- ZeRO 1: reduce_scatter(SUM) in place, into this rank's own slice of the bucket (Megatron's
  distributed optimizer): the optimizer reads only that slice, and the reduction plus the
  parameter all-gather after the update move what one all-reduce moves. The rest of the
  buffer keeps this rank's unreduced gradient until zero_grad;
- ZeRO 2/3: reduce_scatter(SUM): each rank receives only the slice it owns, the step's first
  reduction of a bucket straight into the shard, later micro-batches' into a buffer added to it.

SUM is the mean we want: the loss is pre-scaled by 1/(tokens in the global batch).

Overlap accounting. `finish()` is called when this rank's backward has ended; the time it
spends blocked is timed by `exposed` (a DeviceTimer, new each finish(): the trainer reads it
with the step's scalars as dp_exposed_s, never inside the step). That figure also contains
load imbalance (waiting for a slower peer to finish *its* backward), which no overlap can
hide, so `finish()` also records when backward ended and when the reductions were done
(CLOCK_MONOTONIC via perf_counter, comparable across processes of one host): exposed
communication = done - latest backward end over dp. An asynchronous reduction's completion
is not observed before `wait()`, so in-flight time cannot be measured directly; the *cost* to
hide is measured by `time_serial()`, which replays the same collectives blocking on scratch
buffers. hidden = 1 - exposed / serial.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from threefold.distributed import comm
from threefold.distributed.comm import Group
from threefold.distributed.data_parallel.layout import BucketLayout
from threefold.distributed.timer import DeviceTimer


class Bucket:
    """One bucket: its unreduced gradient, the parameters heard from since it last completed,
    and its reduction, started once (`start`) and completed once (`finish`) per reduction."""

    def __init__(self, owner: GradBuckets, index: int):
        self.owner, self.index = owner, index
        self.spec = owner.layout.buckets[index]
        self.full: torch.Tensor | None = None  # ZeRO 2/3: the unreduced gradient of this step
        self.arrived: set[int] = set()
        self.launched = False  # ZeRO 0/1: at most one all-reduce per step (a SUM must not repeat)
        self.work = None  # the reduction in flight (None: none; a group of one has no handle)
        self.out: torch.Tensor | None = None  # ZeRO 2/3: where the reduce-scatter lands
        self.in_flight = False
        self.reduced = False  # ZeRO 2/3: reduced into the shard since zero_grad
        # ZeRO 2/3: the slots of `full` no gradient has been written to since it was allocated
        # (uninitialised: a first gradient is copied in, not added to zeros; start() zeroes the rest).
        self.unwritten: set[int] = set()

    def view(self) -> torch.Tensor:
        """The whole (unreduced, or all-reduced) gradient of the bucket."""
        o, b = self.owner, self.spec
        if not o.sharded:
            return o.flat[b.start : b.start + b.numel]
        if self.full is None:
            self.full = torch.empty(b.numel, dtype=o.grad_dtype, device=o.device)
            self.full[self._used() :].zero_()  # the padding
            self.unwritten = set(b.slots)
        return self.full

    def _used(self) -> int:
        last = self.owner.layout.slots[self.spec.slots[-1]]
        return last.start + last.numel - self.spec.start

    def _slot(self, i: int) -> torch.Tensor:
        """Parameter i's part of the bucket's gradient."""
        s = self.owner.layout.slots[i]
        start = s.start - self.spec.start
        return self.view()[start : start + s.numel]

    def write(self, i: int, grad: torch.Tensor) -> None:
        """ZeRO 2/3: add parameter i's gradient into the bucket (copy it, if it is the first)."""
        into = self._slot(i)
        if i in self.unwritten:
            into.copy_(grad.reshape(-1))
            self.unwritten.discard(i)
        else:
            into.add_(grad.reshape(-1))

    @property
    def complete(self) -> bool:
        """Every parameter of the bucket has been heard from since it last completed."""
        return len(self.arrived) == len(self.spec.slots)

    @property
    def pending(self) -> bool:
        """Gradients that have not been handed to a reduction yet."""
        return not self.in_flight and (self.full is not None if self.owner.sharded else not self.launched)

    def start(self) -> None:
        """Launch the bucket's reduction asynchronously: all-reduce (ZeRO 0), reduce-scatter in
        place into this rank's slice of the buffer (ZeRO 1) or into a slice of its own (ZeRO 2/3)."""
        o = self.owner
        if not o.sharded and self.launched:
            raise RuntimeError(
                "data parallel: a second synchronized backward in one step would sum the "
                "gradients twice (zero 0/1): run all but the last micro-batch under no_sync()"
            )
        self.launched = self.in_flight = True
        for i in self.unwritten:  # parameters without a gradient this step: zero, not garbage
            self._slot(i).zero_()
        self.unwritten = set()
        full = self.view()
        if o.scatter and not o.sharded:
            own = o.flat[slice(*self.spec.shard_range(o.shard_rank))]
            self.work = comm.reduce_scatter_into(own, full, o.group, async_op=True)
        elif not o.sharded:
            self.work = comm.all_reduce(full, o.group, async_op=True)
        else:
            # The step's first reduction of the bucket lands in the shard itself: zero_grad left
            # it zero, and 0 + x is x, so neither a receive buffer nor a pass adding it is needed.
            if self.reduced:
                self.out = torch.empty(self.spec.shard_numel, dtype=o.grad_dtype, device=o.device)
            into = self.out if self.reduced else self.own_shard()
            self.work = comm.reduce_scatter_into(into, full, o.group, async_op=True)
            self.reduced = True

    def own_shard(self) -> torch.Tensor:
        """ZeRO 2/3: this bucket's reduced slice in the rank's shard."""
        b = self.spec
        return self.owner.shard_buffer()[b.shard_offset : b.shard_offset + b.shard_numel]

    def finish(self) -> None:
        """Wait for the reduction; ZeRO 2/3 add the received slice to the shard and drop the
        unreduced gradient (ZeRO 2's memory saving)."""
        if self.work is not None:
            comm.wait(self.work, self.owner.group, spans=False)
        o = self.owner
        if o.sharded:
            if self.out is not None:  # a later micro-batch's reduction: added to the earlier ones
                self.own_shard().add_(self.out)
            self.full = self.out = None
        self.work, self.in_flight = None, False


class GradBuckets:
    def __init__(
        self,
        params: list[torch.nn.Parameter],
        layout: BucketLayout,
        group: Group,
        zero: int,
        grad_dtype: torch.dtype,
        device: torch.device,
        grads_as_views: bool,
    ):
        self.params, self.layout, self.group, self.zero = params, layout, group, zero
        self.grad_dtype, self.device = grad_dtype, device
        self.shard_rank = group.rank if layout.shards > 1 else 0
        self.sharded = zero >= 2
        # ZeRO 1-3 reduce-scatter: each rank's slices partition the reduced gradient.
        self.scatter = zero >= 1 and layout.shards > 1
        # ZeRO 0/1 keep the full gradient; ZeRO 2/3 keep only the owned slice between steps.
        self.flat = None if self.sharded else torch.zeros(layout.numel, dtype=grad_dtype, device=device)
        self.shard = None  # ZeRO 2/3: the owned slices, allocated by the first reduce-scatter
        self.buckets = [Bucket(self, b) for b in range(len(layout.buckets))]
        self.as_views = grads_as_views and not self.sharded
        self.sync = True
        self.on_bucket_backward_done: list = []  # callbacks(bucket index), e.g. ZeRO-3 resharding
        self._exposed = DeviceTimer(device)  # the last finish()'s blocked time
        self.t_backward_end = self.t_done = 0.0
        self.launched_in_backward = 0
        self._hooks = []
        # `flat` lives as long as the engine: its per-parameter views are made once, not per hook.
        self._views = [self._make_view(i) for i in range(len(params))] if self.as_views else []
        for i, p in enumerate(params):
            if self.as_views:
                p.grad = self._views[i]
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))

    # --- views ------------------------------------------------------------------------------
    def _make_view(self, i: int) -> torch.Tensor:
        s = self.layout.slots[i]
        return self.flat[s.start : s.start + s.numel].view(s.shape)

    def bucket_view(self, b: int) -> torch.Tensor:
        """The full (unreduced or all-reduced) gradient of bucket `b`."""
        return self.buckets[b].view()

    @property
    def full(self) -> list[torch.Tensor | None]:
        """ZeRO 2/3: each bucket's unreduced gradient while it exists (memory accounting)."""
        return [b.full for b in self.buckets]

    def shard_buffer(self) -> torch.Tensor:
        """ZeRO 2/3: this rank's reduced slices, allocated (zero) when the step first needs them."""
        if self.shard is None:
            self.shard = torch.zeros(self.layout.shard_numel, dtype=self.grad_dtype, device=self.device)
        return self.shard

    def owned(self) -> list[torch.Tensor]:
        """Per bucket, the reduced gradient slice this rank's optimizer updates."""
        if self.sharded:  # no backward since zero_grad: a zero gradient
            return [bucket.own_shard() for bucket in self.buckets]
        return [self.flat[slice(*b.shard_range(self.shard_rank))] for b in self.layout.buckets]

    # --- backward ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate locally; reduce on the next synchronized backward (DDP's no_sync)."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def _make_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            if self.as_views:
                view = self._views[i]
                if p.grad.data_ptr() != view.data_ptr():  # someone reset .grad: fold it back in
                    view.add_(p.grad)
                    p.grad = view
                self._arrived(i)
            elif p.grad is not None:  # None: a zero-bubble B deferred this weight's dW to its W action
                grad, p.grad = p.grad, None
                self.accumulate(i, grad)

        return hook

    def accumulate(self, i: int, grad: torch.Tensor) -> None:
        """Add `grad` into parameter i's bucket and count it as arrived. The autograd hook
        calls this; so can code producing weight gradients outside autograd (a zero-bubble
        pipeline's deferred W)."""
        s = self.layout.slots[i]
        bucket = self.buckets[s.bucket]
        if self.as_views:
            if bucket.launched:
                raise RuntimeError(
                    f"data parallel: a gradient for parameter {i} arrived after its bucket was "
                    "reduced (zero 0/1): produce it before the last backward ends"
                )
            self._views[i].add_(grad)
        else:
            if bucket.in_flight:  # ZeRO 2/3 reducing every micro-batch
                bucket.finish()
            bucket.write(i, grad)
        self._arrived(i)

    def _arrived(self, i: int) -> None:
        # A bucket completes once every parameter in it has been heard from since it last
        # completed: a parameter that gets no gradient holds its bucket back (finish() then
        # reduces it) instead of letting it complete early.
        bucket = self.buckets[self.layout.slots[i].bucket]
        bucket.arrived.add(i)
        if bucket.complete:
            bucket.arrived.clear()
            for callback in self.on_bucket_backward_done:
                callback(bucket.index)
            if self.sync:
                bucket.start()
                self.launched_in_backward += 1

    def finish(self) -> None:
        """Called once backward has ended: reduce what has not been launched yet (buckets
        held back by a parameter without gradient, or a step run entirely under no_sync), then
        wait for everything."""
        t0 = time.perf_counter()
        self.t_backward_end = t0
        # On CUDA wait() only stalls the stream: the timer times the stall with events there.
        self._exposed = DeviceTimer(self.device)
        token = self._exposed.start()
        if not self.as_views:  # a .grad set outside autograd's accumulation: fold it in
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    grad, p.grad = p.grad, None
                    self.accumulate(i, grad)
        for bucket in self.buckets:
            bucket.arrived.clear()
        for bucket in self.buckets:
            if bucket.pending:
                bucket.start()
        for bucket in self.buckets:
            if bucket.in_flight:
                bucket.finish()
        self._exposed.stop(token)
        self.t_done = time.perf_counter()
        for bucket in self.buckets:
            bucket.launched = False

    @property
    def exposed(self) -> DeviceTimer:
        """The last finish()'s timer of dp gradient communication left after backward, unread:
        each finish() starts a new one, so a step may carry it to its host read (on CUDA reading
        it waits for the device, see distributed/timer.py)."""
        return self._exposed

    def zero_grad(self) -> None:
        """Zero the gradients in place: ZeRO 0/1's buffer (param.grad views stay valid), ZeRO
        2/3's owned slices (2P/N bytes that ZeRO's formulas count as resident; keeping them
        saves allocating and zeroing them inside the next step's finish())."""
        if self.flat is not None:
            self.flat.zero_()
        if self.shard is not None:
            self.shard.zero_()
        for bucket in self.buckets:
            bucket.reduced = False
        self.launched_in_backward = 0

    # --- measurement --------------------------------------------------------------------------
    def time_serial(self, repeats: int = 5) -> float:
        """Median seconds of this step's collectives run blocking, back to back, on scratch
        buffers of the same sizes: the cost that overlap has to hide. Collective over dp."""
        if self.group.size == 1:
            return 0.0
        times = []
        # One bucket-sized scratch pair, sliced per bucket: the same collectives of the same sizes
        # without holding a second copy of the whole gradient (ZeRO-2/3 keep only a shard of it).
        buckets = self.layout.buckets
        full_scratch = torch.zeros(max(b.numel for b in buckets), dtype=self.grad_dtype, device=self.device)
        out_scratch = torch.empty(max(b.shard_numel for b in buckets), dtype=self.grad_dtype, device=self.device)
        with comm.unrecorded(self.group):  # a measurement, not the step's traffic
            for _ in range(repeats):
                comm.barrier(self.group)
                t0 = time.perf_counter()
                for bucket in buckets:
                    full, out = full_scratch[: bucket.numel], out_scratch[: bucket.shard_numel]
                    if self.scatter:
                        comm.reduce_scatter_into(out, full, self.group)
                    else:
                        comm.all_reduce(full, self.group)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def exposed_after_slowest(self) -> float:
        """Seconds from the last dp rank's end of backward to the end of this rank's reductions
        in the last finish(): exposed communication without load imbalance. Collective over dp
        (one small all-gather); meaningful where perf_counter is one clock (a single host)."""
        if self.group.size == 1:
            return self.t_done - self.t_backward_end
        ends = torch.zeros(self.group.size, dtype=torch.float64, device=self.device)
        mine = torch.tensor([self.t_backward_end], dtype=torch.float64, device=self.device)
        comm.all_gather_into(ends, mine, self.group)
        return max(0.0, self.t_done - float(ends.max()))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
