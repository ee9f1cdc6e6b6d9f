"""`DataParallel`: a model's gradients, reduction, sharding and optimizer over grid.dp_cp
(the data-parallel replicas, times the context-parallel ranks that share their weights; the dp
group itself without cp).

    engine = DataParallel(model, grid, zero=1, bucket_mb=25, precision=MixedPrecision(),
                          betas=(0.9, 0.95), weight_decay=0.1)
    for i, (x, y) in enumerate(micro_batches):
        with engine.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            engine.backward(model(x, y) / tokens_per_global_batch)
    engine.finish()                             # wait for the bucket reductions
    norm = engine.grad_norm([grid.pp])          # once, over every group
    applied = engine.step(lr, norm, max_norm)   # clip + AdamW (ZeRO-1/2: each bucket's all-gather launched)
    engine.zero_grad()

`model` may also be a list of modules (a pipeline rank's virtual-stage chunks): they share
one set of buckets and one optimizer. With dp = 1 every ZeRO stage is a no-op (runs as 0).
ZeRO-1/2's parameter gathers run behind the next forward (gather.py), ZeRO-3's on the group's
all-gather lane `zero3_prefetch` blocks ahead (params.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from threefold.distributed import comm
from threefold.distributed.data_parallel.buckets import GradBuckets
from threefold.distributed.data_parallel.gather import ParamGather
from threefold.distributed.data_parallel.layout import Segment, build_layout, share_of
from threefold.distributed.data_parallel.params import FlatParams, ShardedParams, storage_device
from threefold.distributed.data_parallel.precision import LossScaler, MixedPrecision
from threefold.distributed.data_parallel.zero import ZeroAdamW
from threefold.distributed.timer import DeviceTimer
from threefold.errors import ConfigError
from threefold.model.sharding import sharding_of

MiB = 1 << 20


def sum_over(total: torch.Tensor, groups, carry: torch.Tensor | None = None) -> torch.Tensor:
    """`total` (a 0-d fp32 square sum) summed over each of `groups` in turn; `carry` (float64,
    1-D), if given, summed in place in the same collectives."""
    if carry is None:
        for group in groups:
            comm.all_reduce(total, group)
        return total
    # The squares in float64 beside the carry: two fp32 values summed in float64 and rounded
    # back give their fp32 sum.
    sums = torch.cat([total.double().reshape(1), carry])
    for group in groups:
        comm.all_reduce(sums, group)
    carry.copy_(sums[1:])
    return sums[0].float()


class DataParallel:
    def __init__(
        self,
        model: nn.Module | list[nn.Module],
        grid,
        *,
        zero: int = 0,
        bucket_mb: float = 25.0,
        precision: MixedPrecision | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        own_bucket: list[nn.Parameter] = (),
        group=None,
        only: Callable[[nn.Parameter], bool] | None = None,
        scaler: LossScaler | None = None,
        overlap_param_gather: bool = True,
        zero3_prefetch: int = 1,
    ):
        """own_bucket: parameters laid out alone, so that all_reduce_grads_of can sum them with
        the same tensor on ranks whose other parameters differ (a tied embedding and its copy
        in the last pipeline stage, over grid.embed).
        group: the replicas to reduce over (default grid.dp_cp); only: which parameters this
        engine trains (default all); scaler: a loss scaler shared with a sibling engine (experts).
        overlap_param_gather: ZeRO 1/2 wait for a bucket's gather at its first use in the next
        forward (False: inside step()); zero3_prefetch: ZeRO 3's blocks gathered ahead."""
        if not bucket_mb > 0:
            raise ConfigError("parallel.bucket_mb", f"must be > 0, got {bucket_mb}", "e.g. 25")
        if zero not in (0, 1, 2, 3):
            raise ConfigError("parallel.zero", f"{zero} is not a ZeRO stage", "valid: 0, 1, 2, 3")
        if zero3_prefetch < 1:
            raise ConfigError("parallel.zero3_prefetch", f"must be >= 1, got {zero3_prefetch}", "e.g. 1 or 2")
        self.chunks = list(model) if isinstance(model, (list, tuple, nn.ModuleList)) else [model]
        self.model, self.grid, self.group = model, grid, grid.dp_cp if group is None else group
        self.requested_zero = zero
        self.zero = zero if self.group.size > 1 else 0
        self.precision = precision or MixedPrecision()
        first = next(p for c in self.chunks for p in c.parameters())
        self.scaler = scaler or LossScaler(self.precision, storage_device([first]))
        pdt, gdt = self.precision.param_dtype, self.precision.grad_dtype

        with torch.no_grad():  # frozen parameters are not trained: just take the working dtype
            for chunk in self.chunks:
                for p in chunk.parameters():
                    if not p.requires_grad and p.is_floating_point():
                        p.data = p.data.to(pdt)
        solo_ids = {id(p) for p in own_bucket}
        params, groups, units = _ordered_params(self.chunks, self.zero, solo_ids, only)
        self.params = params
        shards = self.group.size if self.zero >= 1 else 1
        self.layout = build_layout(
            [tuple(p.shape) for p in params],
            bucket_mb * MiB,
            torch.empty((), dtype=gdt).element_size(),
            shards,
            groups,
            solo={i for i, p in enumerate(params) if id(p) in solo_ids},
        )
        rank = self.group.rank if shards > 1 else 0
        # fp32 master values come from the parameters as built (or their deferred initial
        # values), before any cast down: the store writes this rank's slices in as it lays
        # each bucket out, so no full-size fp32 copy of a bucket outlives its packing.
        master = None
        if pdt != torch.float32:
            master = torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=storage_device(params))
        # The parameters' all-gathers go on the group's lane beside the gradient reductions.
        self.gather_group = grid.lane(self.group) if self.group.size > 1 else self.group
        if self.zero == 3:  # unit by unit: start-up holds the shard plus one unit (params.py)
            self.store = ShardedParams(params, self.layout, pdt, self.gather_group, master, zero3_prefetch)
        else:
            self.store = FlatParams(params, self.layout, pdt, rank, master)
        self.grads = GradBuckets(
            params,
            self.layout,
            self.group,
            self.zero,
            gdt,
            params[0].device,
            grads_as_views=(gdt == pdt and self.zero < 2),
        )
        self.optimizer = ZeroAdamW(
            self.layout, self.group, self.zero, self.store.owned(), master, betas, eps, weight_decay
        )
        self._handles = []
        self.param_gather = None
        if self.zero in (1, 2):
            full = [self.store.bucket_view(b.index) for b in self.layout.buckets]
            self.param_gather = ParamGather(full, self.store.owned(), self.gather_group, overlap_param_gather)
            if overlap_param_gather:
                bucket_of = {id(p): self.layout.slots[i].bucket for i, p in enumerate(params)}
                self.param_gather.attach(self.chunks, bucket_of)
        if self.zero == 3:
            # One chunk without a pipeline runs each micro-batch's backward right after its
            # forward: its last block stays whole from one to the other (FSDP2 keeps its root so).
            keep_last = len(self.chunks) == 1 and grid.pp.size == 1
            for chunk, blocks, root in units:
                self._handles += self.store.attach(chunk, blocks, root, keep_last)
            self.grads.on_bucket_backward_done.append(self.store.free)
        self._rank = rank
        self._index = {id(p): i for i, p in enumerate(params)}
        self._norm_segments = self._tp_norm_segments()
        self._norm_cache: dict = {}

    @property
    def parts(self) -> list[DataParallel]:
        """The engines behind this one (one here; an MoE model's ExpertDataParallel has two)."""
        return [self]

    def owns(self, param: nn.Parameter) -> bool:
        """Whether this engine trains `param`."""
        return id(param) in self._index

    # --- backward ---------------------------------------------------------------------------
    def no_sync(self):
        """Accumulate this backward's gradients locally (all micro-batches but the last)."""
        return self.grads.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), multiplied by the loss scale when one is in use (fp16)."""
        (loss * self.scaler.scale if self.scaler.enabled else loss).backward()

    def finish(self) -> None:
        """After the last backward of the step: wait for every bucket's reduction."""
        self.grads.finish()
        if self.zero == 3:
            self.store.free_all()  # units whose gradients never all arrived (unused parameters)

    def accumulate_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Add a gradient computed outside autograd (a zero-bubble pipeline's deferred weight
        gradient) as autograd's accumulation would, bucket bookkeeping included."""
        self.grads.accumulate(self._index[id(param)], grad)

    def _held(self) -> list[torch.Tensor]:
        """Per bucket, the reduced gradient this rank holds: all of it (zero 0) or its slice
        (zero 1-3 reduce-scatter)."""
        if self.grads.scatter:
            return self.grads.owned()
        return [self.grads.bucket_view(b.index) for b in self.layout.buckets]

    def _held_segments(self, key) -> list[Segment]:
        """`layout.segments` over what _held() returns, offsets relative to those tensors."""
        if self.grads.scatter:
            return self.layout.segments(self._rank, key)
        return [
            Segment(
                seg.bucket,
                seg.lo + r * self.layout.buckets[seg.bucket].shard_numel,
                seg.hi + r * self.layout.buckets[seg.bucket].shard_numel,
                seg.key,
            )
            for r in range(self.layout.shards)
            for seg in self.layout.segments(r, key)
        ]

    def all_reduce_grads_of(self, params: list[nn.Parameter], group) -> None:
        """Sum the gradients of `params` over `group` (e.g. tensor parallelism's partial sums for
        sequence-parallel norms), on what this rank keeps: call after finish(). Summing over dp
        and over `group` commute, and ranks of `group` lay out identical shapes identically,
        so the parts they hold line up element for element."""
        if not params or group.size == 1:
            return
        chosen = {id(p) for p in params}
        index = [id(p) in chosen for p in self.params]
        held = self._held()
        views = [held[s.bucket][s.lo : s.hi] for s in self._held_segments(lambda sl: index[sl.index]) if s.key]
        if not views:
            return
        flat = comm.all_reduce(torch.cat(views), group)
        torch._foreach_copy_(views, list(flat.split([v.numel() for v in views])))

    # --- norm, step -------------------------------------------------------------------------
    def _tp_norm_segments(self) -> list:
        """Owned gradient ranges cut by who else holds the same elements: (group, replicas) of
        a parameter split over a group (its sharding record), or None."""
        self._tp_groups = {}
        index_key = []
        for p in self.params:
            s = sharding_of(p)
            index_key.append((s.group.name, s.spec.replicas) if s.split else None)
            if s.split:
                self._tp_groups[s.group.name] = s.group

        # One segment per parameter piece, so grad_norm may leave single parameters out.
        segments = self._held_segments(lambda slot: (index_key[slot.index], slot.index))
        if self.grads.scatter or self.group.size == 1:
            return segments
        # ZeRO 0: every replica holds the same reduced gradient, so each squares a share of its
        # pieces and the shares are summed over the group (the sum grad_sq's loss rides anyway).
        return share_of(segments, self.group.size, self.group.rank)

    def grad_norm(
        self, groups: list = (), exclude: list[nn.Parameter] = (), carry: torch.Tensor | None = None
    ) -> torch.Tensor:
        """L2 norm of the whole gradient (see grad_sq), divided by the loss scale. `carry`: a
        float64 vector summed in place by the same collectives (the step's loss)."""
        norm = self.grad_sq(groups, exclude, carry).sqrt()
        return norm / self.scaler.scale if self.scaler.enabled else norm

    def grad_sq(
        self, groups: list = (), exclude: list[nn.Parameter] = (), carry: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Squared L2 norm of the whole (loss-scaled) gradient, each logical element counted
        once: squares of this rank's part of the gradient (its slices for zero 1-3, its share
        of the replicated gradient for zero 0), tensor-parallel shards summed over their group
        (/replicas), then summed over dp and over `groups` (e.g. pipeline stages). `exclude`:
        copies counted elsewhere (a tied embedding's copy in the last pipeline stage).
        Non-finite = overflow. `carry` (float64, 1-D) is summed in place in the same dp and
        `groups` collectives: no call of its own."""
        return sum_over(self._local_sq(exclude), (self.group, *groups), carry)

    def _local_sq(self, exclude: list[nn.Parameter]) -> torch.Tensor:
        """This rank's squares, tensor-parallel shards already summed over their groups."""
        owned = self._held()
        views, index = self._norm_views(owned, frozenset(self._index[id(p)] for p in exclude))
        # One fused kernel for all pieces (fp32 accumulation for bf16/fp16 gradients).
        norms = torch._foreach_norm(views, 2, dtype=torch.float32) if views else []
        sq = torch.stack(norms).pow(2) if norms else torch.zeros(1, device=owned[0].device)
        total = sq[index[None]].sum() if None in index else torch.zeros((), device=sq.device)
        # A replicated gradient's square is counted on each rank of the split groups without
        # their sum: riding each sum as 0 x square (NaN when it is not finite) brings one rank's
        # non-finite copy to the others, so every rank's norm skips the same steps.
        poison = total * 0
        for name, replicas in sorted(k for k in index if k is not None):
            part = sq[index[name, replicas]].sum() / replicas + poison
            total = total + comm.all_reduce(part, self._tp_groups[name])
        return total

    def _norm_views(self, owned: list[torch.Tensor], skip: frozenset) -> tuple[list, dict]:
        """The gradient views grad_sq norms and, per (group, replicas) key (None: replicated),
        a device index of their positions: built once per `exclude` and buffer set, not per
        step (zero 0 holds every dp rank's range: O(dp x params) views), and indexed on the
        device without a host-to-device copy each step."""
        ptrs = tuple(t.data_ptr() for t in owned)
        cached = self._norm_cache.get(skip)
        if cached is None or cached[0] != ptrs:
            segs = [seg for seg in self._norm_segments if seg.key[1] not in skip]
            positions: dict = {}
            for i, seg in enumerate(segs):
                positions.setdefault(seg.key[0], []).append(i)
            device = owned[0].device
            index = {k: torch.tensor(v, dtype=torch.long, device=device) for k, v in positions.items()}
            cached = (ptrs, [owned[seg.bucket][seg.lo : seg.hi] for seg in segs], index)
            self._norm_cache[skip] = cached
        return cached[1], cached[2]

    def step(self, lr: float, grad_norm: torch.Tensor, max_norm: float = 0.0) -> bool | torch.Tensor:
        """Clip to `max_norm` (0 = off) and apply AdamW; not applied when the norm is not finite
        (fp16 overflow under loss scaling, or a NaN/Inf loss or gradient: a caller flags a
        skip by handing in a NaN norm). Every rank decides the same way: the norm is global.
        Returns whether it was applied: with the fused optimizer or loss scaling a 0-d bool
        tensor on the device (the decision stays there, so nothing waits for the host before
        the update: read it with the step's other scalars), otherwise a bool."""
        return step_engines(self.parts, lr, grad_norm, max_norm)

    def apply_update(
        self, lr: float, grad_norm: torch.Tensor, max_norm: float = 0.0, found_inf: torch.Tensor | None = None
    ) -> None:
        """Clip and AdamW (step() without the skip decision); `found_inf`: the fused optimizer's
        on-device skip flag. Under loss scaling the gradients are divided by the scale they
        were made with (before the scaler's update)."""
        scale = None
        if max_norm > 0:  # the same coefficient as train.optim.clip_gradients
            scale = torch.clamp(max_norm / (grad_norm + 1e-6), max=1.0)
        if self.scaler.enabled:
            scale = (scale if scale is not None else 1.0) / self.scaler.scale
        gather = self.param_gather
        if gather is None:
            self.optimizer.step(self.grads.owned(), lr, scale, found_inf)
            return
        # ZeRO 1/2: every rank updates its slices, each bucket's all-gather leaves as soon as
        # its slice is done and the next forward waits for it where it first needs it.
        gather.wait_all()  # the previous step's buckets no forward used (unused parameters)
        self.optimizer.step(self.grads.owned(), lr, scale, found_inf, gather.start)
        gather.finish_step()

    def zero_grad(self) -> None:
        self.grads.zero_grad()
        if self.zero == 3:
            self.store.end_step()

    def wait_params(self) -> None:
        """ZeRO 1/2: every parameter gather still in flight done, before the parameter buffer is
        read or written outside a forward (a checkpoint load into the fp32 masters, which are
        the owned slices of that buffer in fp32 training)."""
        if self.param_gather is not None:
            self.param_gather.wait_all()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """name -> a full copy of every parameter (ZeRO 3 gathers unit by unit: collective)."""
        names = {
            id(p): (f"{c}." if len(self.chunks) > 1 else "") + n
            for c, chunk in enumerate(self.chunks)
            for n, p in chunk.named_parameters()
        }
        out = {}
        self.wait_params()
        for b in self.layout.buckets:
            if self.zero == 3:
                self.store.ensure(b.index)
            for i in b.slots:
                out[names[id(self.params[i])]] = self.params[i].detach().clone()
            if self.zero == 3:
                self.store.free(b.index)
        return out

    # --- measurement ------------------------------------------------------------------------
    def step_timers(self) -> dict[str, DeviceTimer]:
        """The last step's exposed communication, unread, by metric name: the gradient reduction
        left after backward (dp_exposed_s, the last finish()) and with ZeRO 3 the parameter
        gathers not hidden by prefetch since the previous call (zero3_gather_wait_s). Reading
        one is a host read (on CUDA it waits for the device): a step carries them to its read."""
        out = {"dp_exposed_s": self.grads.exposed}
        if self.zero == 3:
            out["zero3_gather_wait_s"] = self.store.take_gather_wait()
        elif self.param_gather is not None:
            out["param_gather_wait_s"] = self.param_gather.take_wait()
        return out

    def exposed_comm_s(self) -> float:
        """Exposed gradient communication of the last step, load imbalance excluded
        (collective over dp; one host). See buckets.py."""
        return self.grads.exposed_after_slowest()

    def time_serial_comm(self, repeats: int = 5) -> float:
        """Blocking cost of one step's gradient collectives (collective over dp)."""
        return self.grads.time_serial(repeats)

    def time_serial_gather(self, repeats: int = 5) -> float:
        """Blocking cost of one step's parameter all-gathers (collective over the gather lane):
        ZeRO 1/2's one per bucket, ZeRO 3's those of the last step; 0 without any."""
        if self.param_gather is not None:
            return self.param_gather.replay(repeats)
        if self.zero == 3:
            return self.store.replay(repeats)
        return 0.0

    @property
    def loss_scale(self) -> float:
        """The loss scale now: a host read (the step itself uses scaler.scale, on the device)."""
        return self.scaler.value()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        if self.param_gather is not None:
            self.param_gather.wait_all()
            self.param_gather.remove_hooks()
        self.grads.remove_hooks()


def step_engines(parts: list[DataParallel], lr: float, grad_norm: torch.Tensor, max_norm: float) -> bool | torch.Tensor:
    """One skip decision for engines sharing one loss scaler and one optimizer kind (a dense
    engine, or an MoE model's dense + expert pair), then each one's update. With the fused
    optimizer or loss scaling the decision stays on the device: found_inf (a non-finite global
    norm) makes the fused AdamW kernel leave every tensor untouched, the loss scaler backs off
    or regrows on the same flag, and a 0-d bool tensor says whether the step was applied. The
    foreach optimizer without loss scaling (CPU, bit-identical to torch.optim.AdamW) reads the
    norm on the host and returns a bool."""
    scaler = parts[0].scaler
    if parts[0].optimizer.fused or scaler.enabled:
        found_inf = (~torch.isfinite(grad_norm)).float()
        for e in parts:
            e.apply_update(lr, grad_norm, max_norm, found_inf)
        scaler.update(found_inf)  # after the update, which divided by the scale backward used
        return found_inf == 0
    if not math.isfinite(float(grad_norm)):  # NaN/Inf (flagged by the caller): never apply
        return False
    for e in parts:
        e.apply_update(lr, grad_norm, max_norm)
    return True


def _ordered_params(chunks: list[nn.Module], zero: int, solo: set[int] = frozenset(), only=None):
    """Parameters in gradient-ready order (reverse of definition; the last chunk's first), and
    for ZeRO 3 the units: one bucket per transformer block (in `chunk.layers`), one root bucket
    per chunk for the rest (plus one per `solo` parameter there).
    Returns (params, bucket groups or None, [(chunk, blocks, root buckets)])."""
    seen: set[int] = set()
    per_chunk = []
    for chunk in chunks:
        ps = [
            p for p in chunk.parameters() if p.requires_grad and id(p) not in seen and (only is None or only(p))
        ]  # tied: once
        seen.update(id(p) for p in ps)
        per_chunk.append(ps)
    if zero < 3:
        return [p for ps in per_chunk[::-1] for p in ps[::-1]], None, []
    ordered, groups, units = [], [], []

    def add(ps: list) -> int:
        groups.append(list(range(len(ordered), len(ordered) + len(ps))))
        ordered.extend(ps)
        return len(groups) - 1

    for chunk, ps in zip(chunks[::-1], per_chunk[::-1]):
        mine = {id(p) for p in ps}
        layers = getattr(chunk, "layers", None)
        block_modules = list(layers.values()) if isinstance(layers, nn.ModuleDict) else []
        in_blocks = [[p for p in m.parameters() if id(p) in mine] for m in block_modules]
        for p_list in in_blocks:
            mine -= {id(p) for p in p_list}
        blocks = [None] * len(block_modules)
        for k in range(len(block_modules) - 1, -1, -1):  # last block's gradients are ready first
            if in_blocks[k]:
                blocks[k] = (block_modules[k], add(in_blocks[k][::-1]))
        rest = [p for p in ps if id(p) in mine][::-1]
        root = [add([p]) for p in rest if id(p) in solo]
        rest = [p for p in rest if id(p) not in solo]
        root += [add(rest)] if rest else []
        units.append((chunk, [b for b in blocks if b is not None], root))
    return ordered, groups, units[::-1]
