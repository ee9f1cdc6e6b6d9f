"""Parameter storage: one flat replicated buffer (ZeRO 0-2), or dp-sharded units (ZeRO 3).

ZeRO 3 (the paper's P_os+g+p) keeps only this rank's slice of every parameter between uses.
A *unit* is one transformer block (its own bucket) or the rest of the model (embeddings,
final norm, head: the "root"). A block is all-gathered by a forward pre-hook just before it
runs, with the next `prefetch` blocks' all-gathers already launched, and freed again by a
forward post-hook; a hook on the block's output gradient gathers it once more just before
its backward (prefetching the blocks before it), and it is freed as soon as all its
gradients have arrived. The root is gathered when the model's forward starts and freed after
its own backward: its parameters are used first and last in both passes (and a tied
embedding/head weight lives in both ends), so freeing it in between would gather it twice.
Without a pipeline the last block also stays whole from its forward to its backward, which
follows at once (`keep_last`): one gather less per micro-batch.

Two lanes, FSDP2's: the gathers run on the dp group's all-gather lane (Grid.lane: its own
communicator, so on NCCL its own stream and on gloo its own queue), the gradient
reduce-scatters on the group itself, so a prefetch never waits behind a reduction already in
flight. At most `prefetch + 1` blocks are whole or being gathered at once (the root besides):
a prefetch beyond that waits until a block is freed. A rank's parameter memory therefore peaks
at its shard + the root + (prefetch + 1) blocks (`peak_held`, `threefold memory`).

Freeing resizes the unit's storage to zero bytes; the parameters stay views of it, so tensors
autograd saved for backward see the data again once it is gathered back.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
from torch import nn

from threefold.distributed import comm
from threefold.distributed.comm import Group
from threefold.distributed.data_parallel.gather import ZERO3_LABEL
from threefold.distributed.data_parallel.layout import BucketLayout
from threefold.distributed.timer import DeviceTimer
from threefold.model.meta import adopt, deferred, initial_value

READY = "ready"  # unit state: None = freed, READY = gathered, otherwise an in-flight Work


def storage_device(params: list[torch.Tensor]) -> torch.device:
    """Where the parameters' storage goes: a deferred parameter's target device (model/meta.py)."""
    record = deferred(params[0])
    return record.device if record is not None else params[0].device


def place_bucket(
    params: list[nn.Parameter], layout: BucketLayout, b: int, full: torch.Tensor, rank: int, master: torch.Tensor | None
) -> None:
    """Write every parameter of bucket `b` into `full` (the bucket's padded buffer, any dtype)
    and make it a view of its slot there; the part of each in `rank`'s slice also goes into
    `master` (fp32, `rank`'s shard space), when given. A parameter still on the meta device
    (deferred) gets its initial value here, one parameter at a time; one with storage gives
    its current value, and its old storage is released."""
    bucket = layout.buckets[b]
    lo, hi = bucket.shard_range(rank)
    for i in bucket.slots:
        s, p = layout.slots[i], params[i]
        values = (initial_value(p) if deferred(p) is not None else p.detach()).reshape(-1)
        view = full[s.start - bucket.start : s.start - bucket.start + s.numel]
        view.copy_(values)
        a, z = max(lo, s.start), min(hi, s.start + s.numel)
        if master is not None and a < z:
            at = bucket.shard_offset + a - lo
            master[at : at + z - a].copy_(values[a - s.start : z - s.start])
        if deferred(p) is not None:
            adopt(p, view.view(s.shape))
        else:
            p.data = view.view(s.shape)


class FlatParams:
    """ZeRO 0-2: every parameter is a view of one flat buffer of the working dtype. `master`:
    filled with this rank's fp32 slices of the parameters' values (see place_bucket)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        layout: BucketLayout,
        dtype: torch.dtype,
        shard_rank: int,
        master: torch.Tensor | None = None,
    ):
        self.layout, self.shard_rank = layout, shard_rank
        self.flat = torch.zeros(layout.numel, dtype=dtype, device=storage_device(params))  # padding stays 0
        with torch.no_grad():
            for b in layout.buckets:
                place_bucket(params, layout, b.index, self.bucket_view(b.index), shard_rank, master)

    def bucket_view(self, b: int) -> torch.Tensor:
        bucket = self.layout.buckets[b]
        return self.flat[bucket.start : bucket.start + bucket.numel]

    def owned(self) -> list[torch.Tensor]:
        """Per bucket, the slice of the flat buffer this rank's optimizer writes."""
        return [self.flat[slice(*b.shard_range(self.shard_rank))] for b in self.layout.buckets]


class ShardedParams:
    """ZeRO 3: per bucket, this rank's slice persists; the full bucket exists only while used.
    `group`: where the gathers go (the dp group's all-gather lane); `prefetch`: blocks ahead.

    Built unit by unit: a unit's bucket is filled (deferred parameters get their initial
    values straight into it), its slice copied into the shard (and the fp32 `master`, when
    given), and the bucket freed before the next one is made. Start-up therefore holds the
    shard plus one unit, never the rank's whole model (with parallelize.build_model's
    `defer_init`; parameters built with storage are released as their unit is packed)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        layout: BucketLayout,
        dtype: torch.dtype,
        group: Group,
        master: torch.Tensor | None = None,
        prefetch: int = 1,
    ):
        self.layout, self.group, self.dtype, self.depth = layout, group, dtype, prefetch
        device = storage_device(params)
        self.shard = torch.empty(layout.shard_numel, dtype=dtype, device=device)
        self.full: list[torch.Tensor] = []
        self.state: list = []
        self.blocks: set[int] = set()  # the block units (attach); the others are roots
        self.wanted: list[int] = []  # prefetches waiting for a block to be freed (the in-flight limit)
        self.launched: list[int] = []  # the units gathered in this step so far
        self.last_step: list[int] = []  # ... and in the last whole step (replay)
        self.held_bytes = self.peak_held = 0  # bytes of units whole or being gathered: now, and the most
        with torch.no_grad():
            for b in layout.buckets:
                full = torch.zeros(b.numel, dtype=dtype, device=device)  # padding stays 0
                place_bucket(params, layout, b.index, full, group.rank, master)
                lo, hi = b.shard_range(group.rank)
                self.shard[b.shard_offset : b.shard_offset + b.shard_numel].copy_(full[lo - b.start : hi - b.start])
                self.full.append(full)
                self.state.append(READY)
                self.free(b.index)
        self.held_bytes = self.peak_held = 0  # start-up's units are packing, not held for use
        self.gather_wait = DeviceTimer(self.shard.device)  # blocked on parameter all-gathers (not hidden by prefetch)
        self.spans = None  # a span recorder (threefold.observe) timing that wait as dp_exposed, or None

    def owned(self) -> list[torch.Tensor]:
        return [self.shard[b.shard_offset : b.shard_offset + b.shard_numel] for b in self.layout.buckets]

    # --- gather / free ------------------------------------------------------------------------
    def _launch(self, b: int) -> None:
        full, bucket = self.full[b], self.layout.buckets[b]
        nbytes = bucket.numel * full.element_size()
        full.untyped_storage().resize_(nbytes)
        self.held_bytes += nbytes
        self.peak_held = max(self.peak_held, self.held_bytes)
        if b in self.wanted:
            self.wanted.remove(b)
        self.launched.append(b)
        shard = self.shard[bucket.shard_offset : bucket.shard_offset + bucket.shard_numel]
        self.state[b] = comm.all_gather_into(full, shard, self.group, async_op=True) or READY

    def _blocks_held(self) -> int:
        return sum(1 for b in self.blocks if self.state[b] is not None)

    def prefetch(self, b: int | None) -> None:
        """Launch bucket `b`'s all-gather without waiting (None: nothing to prefetch); a block
        beyond the in-flight limit (prefetch + 1 blocks) waits for a block to be freed."""
        if b is None or self.state[b] is not None:
            return
        if b in self.blocks and self._blocks_held() > self.depth:
            if b not in self.wanted:
                self.wanted.append(b)
            return
        self._launch(b)

    def ensure(self, b: int) -> None:
        """Make bucket `b`'s parameters whole, waiting for its all-gather if needed."""
        if self.state[b] is READY:
            return
        t0 = self.gather_wait.start()  # on CUDA an event pair: wait() only stalls the stream
        with contextlib.nullcontext() if self.spans is None else self.spans.span("dp_exposed", ZERO3_LABEL):
            if self.state[b] is None:
                self._launch(b)
            if self.state[b] is not READY:
                comm.wait(self.state[b], self.group, spans=False)
        self.state[b] = READY
        self.gather_wait.stop(t0)

    def take_peak_held(self) -> int:
        """The most bytes of units whole or being gathered at once since the last take (the
        in-flight limit bounds it: the root + prefetch + 1 blocks)."""
        peak, self.peak_held = self.peak_held, self.held_bytes
        return peak

    def take_gather_wait(self) -> DeviceTimer:
        """The time blocked on parameter all-gathers since the last take, unread: a step carries
        it to its host read (on CUDA reading it waits for the device, see distributed/timer.py)."""
        return self.gather_wait.take()

    def free(self, b: int) -> None:
        if self.state[b] is None:
            return
        if self.state[b] is not READY:  # never drop storage under a running collective
            comm.wait(self.state[b], self.group, spans=False)
        storage = self.full[b].untyped_storage()
        self.held_bytes -= storage.nbytes()
        storage.resize_(0)
        self.state[b] = None
        while self.wanted and self._blocks_held() <= self.depth:  # a deferred prefetch's turn
            self._launch(self.wanted[0])

    def free_all(self) -> None:
        self.wanted.clear()
        for b in range(len(self.full)):
            self.free(b)

    def end_step(self) -> None:
        """The step's gathers are all done (the engine's zero_grad): they become the last step's."""
        self.last_step, self.launched = self.launched, []

    def replay(self, repeats: int = 5) -> float:
        """Median seconds of the last step's gathers run blocking, back to back, on scratch
        buffers (collective over the group: the same units on every rank); 0 when there were
        none. What the prefetch has to hide (observe/observer.py)."""
        units = self.last_step
        if self.group.size == 1 or not units:
            return 0.0
        buckets = [self.layout.buckets[b] for b in units]
        out = torch.zeros(max(b.numel for b in buckets), dtype=self.dtype, device=self.shard.device)
        mine = torch.zeros(max(b.shard_numel for b in buckets), dtype=self.dtype, device=self.shard.device)
        times = []
        with comm.unrecorded(self.group):  # a measurement, not the step's traffic
            for _ in range(repeats):
                comm.barrier(self.group)
                t0 = time.perf_counter()
                for b in buckets:
                    comm.all_gather_into(out[: b.numel], mine[: b.shard_numel], self.group)
                if out.device.type == "cuda":
                    torch.cuda.synchronize(out.device)
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    # --- hooks ------------------------------------------------------------------------------
    def attach(
        self, model: nn.Module, blocks: list[tuple[nn.Module, int]], root: list[int], keep_last: bool = False
    ) -> list:
        """Hooks on `model` (a whole model or one pipeline chunk): `blocks` are its (block,
        bucket) pairs in forward order, `root` the buckets of its other parameters.
        `keep_last`: the last block's backward follows its forward at once (no pipeline), so it
        stays whole in between."""
        order = [b for _, b in blocks]
        self.blocks.update(order)

        def at(k: int) -> int | None:
            return order[k] if 0 <= k < len(order) else None

        def model_pre_forward(module, args) -> None:
            for b in root + order[: self.depth]:
                self.prefetch(b)
            for b in root:
                self.ensure(b)

        def model_post_forward(module, args, output) -> None:
            if not torch.is_grad_enabled():  # evaluation: nothing will need the weights again
                for b in root + order:
                    self.free(b)

        handles = [model.register_forward_pre_hook(model_pre_forward), model.register_forward_hook(model_post_forward)]
        for k, (block, _) in enumerate(blocks):
            last = keep_last and k == len(blocks) - 1
            handles.append(block.register_forward_pre_hook(self._block_pre_forward(at, k)))
            handles.append(block.register_forward_hook(self._block_post_forward(at, k, last)))
        return handles

    def _block_pre_forward(self, at, k: int):
        def hook(module, args) -> None:
            self.ensure(at(k))
            if torch._C._current_graph_task_id() != -1:
                return  # a rerun inside backward (recomputation): the blocks after it are done with
            for ahead in range(1, self.depth + 1):
                self.prefetch(at(k + ahead))

        return hook

    def _block_post_forward(self, at, k: int, keep: bool):
        def hook(module, args, output) -> None:
            if torch._C._current_graph_task_id() != -1:
                return  # a rerun inside backward (recomputation): backward still needs the weights
            outs = [t for t in _tensors(output) if t.requires_grad]
            backward = torch.is_grad_enabled() and outs
            if backward:
                # Fires when the gradient w.r.t. the block's output is complete, i.e. just
                # before the block's own backward runs.
                torch.autograd.graph.register_multi_grad_hook(outs, self._pre_backward(at, k), mode="any")
            if not (keep and backward):
                self.free(at(k))

        return hook

    def _pre_backward(self, at, k: int):
        def hook(grad) -> None:
            self.ensure(at(k))
            for behind in range(1, self.depth + 1):
                self.prefetch(at(k - behind))

        return hook


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []
