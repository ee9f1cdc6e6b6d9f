"""Gradient buffers and their bucketed reduction over dp, overlapped with backward.

Each bucket's gradients live in one contiguous tensor (a slice of a flat buffer for ZeRO 0/1,
a buffer allocated when its first gradient arrives and dropped after its reduce-scatter for
ZeRO 2/3). A post-accumulate-grad hook on every parameter moves the gradient in (for ZeRO 0/1
with matching dtypes, `param.grad` is a view of the buffer and autograd accumulates in place,
as DDP's gradient_as_bucket_view). When the last gradient of a bucket arrives during a
synchronized backward, the bucket's collective is launched asynchronously, so it runs on
gloo's/NCCL's own threads/streams while backward continues with earlier layers:

- ZeRO 0/1: all_reduce(SUM) of the whole bucket (every rank needs every gradient);
- ZeRO 2/3: reduce_scatter(SUM): each rank receives only the slice it owns.

SUM is the mean we want: the loss is pre-scaled by 1/(tokens in the global batch).

Overlap accounting. `finish()` is called when this rank's backward has ended; the wall time
it spends blocked is `exposed_s`. That figure also contains load imbalance (waiting for a
slower peer to finish *its* backward), which no overlap can hide, so `finish()` also records
when backward ended and when the reductions were done (CLOCK_MONOTONIC via perf_counter,
comparable across processes of one host): exposed communication = done - latest backward end
over dp. gloo does not report completion of an async reduce_scatter before `wait()` (no
future, `is_completed()` stays False), so in-flight time cannot be observed directly; the
*cost* to hide is measured by `time_serial()`, which replays the same collectives blocking on
scratch buffers. hidden = 1 - exposed / serial.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist

from threefold.distributed.data_parallel.layout import Layout
from threefold.distributed.grid import Group


class GradBuckets:
    def __init__(self, params: list[torch.nn.Parameter], layout: Layout, group: Group, zero: int,
                 grad_dtype: torch.dtype, device: torch.device, grads_as_views: bool):
        self.params, self.layout, self.group, self.zero = params, layout, group, zero
        self.grad_dtype, self.device = grad_dtype, device
        self.shard_rank = group.rank if layout.shards > 1 else 0
        self.sharded = zero >= 2
        n = len(layout.buckets)
        # ZeRO 0/1 keep the full gradient; ZeRO 2/3 keep only the owned slice between steps.
        self.flat = None if self.sharded else torch.zeros(layout.numel, dtype=grad_dtype, device=device)
        self.shard = None  # ZeRO 2/3: allocated by the first reduce-scatter of a step, dropped by zero_grad
        self.full: list[torch.Tensor | None] = [None] * n  # ZeRO 2/3: unreduced bucket, this step
        self.as_views = grads_as_views and not self.sharded
        self.sync = True
        self.arrived: list[set[int]] = [set() for _ in range(n)]  # heard from since the bucket last completed
        self.launched = [False] * n  # ZeRO 0/1: at most one all-reduce per step (SUM must not repeat)
        self.works: list[tuple | None] = [None] * n
        self.on_bucket_backward_done: list = []  # callbacks(bucket index), e.g. ZeRO-3 resharding
        self._exposed = 0.0
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
        return self.flat[s.start:s.start + s.numel].view(s.shape)

    def bucket_view(self, b: int) -> torch.Tensor:
        """The full (unreduced or all-reduced) gradient of bucket `b`."""
        bucket = self.layout.buckets[b]
        if not self.sharded:
            return self.flat[bucket.start:bucket.start + bucket.numel]
        if self.full[b] is None:
            self.full[b] = torch.zeros(bucket.numel, dtype=self.grad_dtype, device=self.device)
        return self.full[b]

    def owned(self) -> list[torch.Tensor]:
        """Per bucket, the reduced gradient slice this rank's optimizer updates."""
        out = []
        if self.sharded and self.shard is None:  # no backward since zero_grad: zero gradient
            self.shard = torch.zeros(self.layout.shard_numel, dtype=self.grad_dtype, device=self.device)
        for b in self.layout.buckets:
            if self.sharded:
                out.append(self.shard[b.shard_offset:b.shard_offset + b.shard_numel])
            else:
                lo, hi = b.shard_range(self.shard_rank)
                out.append(self.flat[lo:hi])
        return out

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
        b = s.bucket
        if self.as_views:
            if self.launched[b]:
                raise RuntimeError(f"data parallel: a gradient for parameter {i} arrived after its bucket was "
                                   "all-reduced (zero 0/1): produce it before the last backward ends")
            self._views[i].add_(grad)
        else:
            if self.works[b] is not None:  # ZeRO 2/3 reducing every micro-batch
                self._complete(b)
            start = s.start - self.layout.buckets[b].start
            self.bucket_view(b)[start:start + s.numel].add_(grad.reshape(-1))
        self._arrived(i)

    def _arrived(self, i: int) -> None:
        # A bucket completes once every parameter in it has been heard from since it last
        # completed: a parameter that gets no gradient holds its bucket back (finish() then
        # reduces it) instead of letting it complete early.
        b = self.layout.slots[i].bucket
        self.arrived[b].add(i)
        if len(self.arrived[b]) == len(self.layout.buckets[b].slots):
            self.arrived[b].clear()
            for callback in self.on_bucket_backward_done:
                callback(b)
            if self.sync:
                self._launch(b)
                self.launched_in_backward += 1

    def _launch(self, b: int) -> None:
        if not self.sharded and self.launched[b]:
            raise RuntimeError("data parallel: a second synchronized backward in one step would sum the "
                               "gradients twice (zero 0/1): run all but the last micro-batch under no_sync()")
        self.launched[b] = True
        full, pg = self.bucket_view(b), self.group.pg
        if self.group.size == 1:
            self.works[b] = (None, None)
        elif not self.sharded:
            self.group.stats.record("all_reduce", full.numel() * full.element_size())
            self.works[b] = (dist.all_reduce(full, op=dist.ReduceOp.SUM, group=pg, async_op=True), None)
        else:
            out = torch.empty(self.layout.buckets[b].shard_numel, dtype=self.grad_dtype, device=self.device)
            self.group.stats.record("reduce_scatter", full.numel() * full.element_size())
            self.works[b] = (dist.reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=pg, async_op=True), out)

    def _complete(self, b: int) -> None:
        work, out = self.works[b]
        if work is not None:
            work.wait()
        if self.sharded:
            bucket = self.layout.buckets[b]
            if out is None:  # dp of 1: the whole bucket is the owned slice
                out = self.full[b]
            if self.shard is None:
                self.shard = torch.zeros(self.layout.shard_numel, dtype=self.grad_dtype, device=self.device)
            self.shard[bucket.shard_offset:bucket.shard_offset + bucket.shard_numel].add_(out)
            self.full[b] = None  # free the unsharded gradient (ZeRO-2's memory saving)
        self.works[b] = None

    def finish(self) -> None:
        """Called once backward has ended: reduce what has not been launched yet (buckets
        held back by a parameter without gradient, or a step run entirely under no_sync), then
        wait for everything."""
        t0, events = time.perf_counter(), None
        self.t_backward_end = t0
        if not self.as_views:  # a .grad set outside autograd's accumulation: fold it in
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    grad, p.grad = p.grad, None
                    self.accumulate(i, grad)
        for arrived in self.arrived:
            arrived.clear()
        if self.device.type == "cuda":  # wait() only stalls the stream: time the stall with events
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        for b in range(len(self.layout.buckets)):
            pending = self.full[b] is not None if self.sharded else not self.launched[b]
            if pending and self.works[b] is None:
                self._launch(b)
        for b in range(len(self.layout.buckets)):
            if self.works[b] is not None:
                self._complete(b)
        if events is not None:
            events[1].record()
        self.t_done = time.perf_counter()
        self._exposed = events or self.t_done - t0
        self.launched = [False] * len(self.launched)

    @property
    def exposed_s(self) -> float:
        """Seconds of dp gradient communication left after backward, in the last finish()."""
        if isinstance(self._exposed, tuple):
            self._exposed[1].synchronize()
            return self._exposed[0].elapsed_time(self._exposed[1]) / 1e3
        return self._exposed

    def zero_grad(self) -> None:
        """ZeRO 0/1 zero the buffer in place (param.grad views stay valid); ZeRO 2/3 drop the
        gradient shard until the next backward needs it, as set_to_none does."""
        if self.flat is not None:
            self.flat.zero_()
        self.shard = None
        self.launched_in_backward = 0

    # --- measurement --------------------------------------------------------------------------
    def time_serial(self, repeats: int = 5) -> float:
        """Median seconds of this step's collectives run blocking, back to back, on scratch
        buffers of the same sizes: the cost that overlap has to hide. Collective over dp."""
        if self.group.size == 1:
            return 0.0
        pg, times = self.group.pg, []
        scratch = [torch.zeros(b.numel, dtype=self.grad_dtype, device=self.device) for b in self.layout.buckets]
        outs = [torch.empty(b.shard_numel, dtype=self.grad_dtype, device=self.device) for b in self.layout.buckets]
        for _ in range(repeats):
            dist.barrier(group=pg)
            t0 = time.perf_counter()
            for full, out in zip(scratch, outs):
                if self.sharded:
                    dist.reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=pg)
                else:
                    dist.all_reduce(full, op=dist.ReduceOp.SUM, group=pg)
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
        dist.all_gather_single(ends, mine, group=self.group.pg)
        return max(0.0, self.t_done - float(ends.max()))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
