"""The distributed optimizer: AdamW on this rank's slices, global norm, clipping, re-gather.

ZeRO (Rajbhandari et al. 2020) stage by stage, with N = dp size:
- 0: every rank owns every bucket (plain data parallelism; optimizer state replicated).
- 1: rank r owns slice r of every bucket: fp32 master weights and both Adam moments exist
     only for that slice (12P/N bytes in mixed precision); each bucket's gradient is
     reduce-scattered in place into that slice of the full gradient buffer (buckets.py), and
     after the bucket's update its new parameters are all-gathered into the replicated flat
     buffer (gather.py: behind the next forward).
- 2: as 1, and only the owned gradient slice is kept (the bucket's full gradient is dropped
     after its reduce-scatter).
- 3: as 2, and the parameters themselves are sharded (see params.py): the updated slice
     simply stays where it is; the next forward gathers it.
When the working parameters are fp32, the master weights *are* the owned parameter slices (no
copy); otherwise a separate fp32 master is kept and copied down after each update.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from threefold.distributed.comm import Group
from threefold.distributed.data_parallel.adamw import adamw_update, fused_adamw_update
from threefold.distributed.data_parallel.layout import BucketLayout


class ZeroAdamW:
    def __init__(
        self,
        layout: BucketLayout,
        group: Group,
        zero: int,
        param_owned: list[torch.Tensor],
        master_init: torch.Tensor | None,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
    ):
        """param_owned: per bucket, the working-dtype slice this rank updates. master_init:
        this rank's shard space in fp32, holding the initial values of a separate master,
        adopted as it is (None: params are fp32, update them)."""
        self.layout, self.group, self.zero = layout, group, zero
        self.rank = group.rank if layout.shards > 1 else 0
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.param_owned = param_owned
        device = param_owned[0].device
        if master_init is None:
            self.master_flat, self.master = None, param_owned
        else:
            self.master_flat = master_init
            self.master = self._views(self.master_flat)
        self.exp_avg_flat = torch.zeros(layout.shard_numel, dtype=torch.float32, device=device)
        self.exp_avg_sq_flat = torch.zeros(layout.shard_numel, dtype=torch.float32, device=device)
        self.exp_avg, self.exp_avg_sq = self._views(self.exp_avg_flat), self._views(self.exp_avg_sq_flat)
        # Weight decay per element range: the ndim >= 2 rule of param_groups, applied to the
        # parts of parameters that fall into this rank's slices (per bucket: buckets are updated
        # one at a time, each gathered as soon as it is done).
        self.decay_views: list[list[torch.Tensor]] = [[] for _ in layout.buckets]
        for seg in layout.segments(self.rank):
            if seg.key:
                self.decay_views[seg.bucket].append(self.master[seg.bucket][seg.lo : seg.hi])
        self.step_count = 0

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[b.shard_offset : b.shard_offset + b.shard_numel] for b in self.layout.buckets]

    fused = False
    """Update with torch's fused AdamW kernel (the engine's choice: the default on CUDA)."""
    _step_t = None  # the fused path's step count, on the device (skips are decided there)
    _steps = 0
    _fused_state = None

    @property
    def step_count(self) -> int:
        """Updates applied so far (a host read of the device count on the fused path: rare)."""
        return int(self._step_t.item()) if self._step_t is not None else self._steps

    @step_count.setter
    def step_count(self, n: int) -> None:
        self._steps = n
        if self._step_t is not None:
            self._step_t.fill_(float(n))

    def step(
        self,
        grads: list[torch.Tensor],
        lr: float,
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor | None = None,
        updated: Callable[[int], None] | None = None,
    ) -> None:
        """AdamW on the owned slices with gradients `grads` (per bucket, reduced), multiplied
        first by `grad_scale` (clip coefficient / loss scale) when given. `found_inf` (the
        fused path only): a 0-d fp32 flag on the device; 1 leaves every tensor untouched.
        Bucket by bucket, the last first (it holds the first layers, which the next forward
        needs first); `updated(b)` is called as soon as bucket b's working slice is final
        (ZeRO 1/2 launch its all-gather there). Per bucket, the same element-wise operations
        as one call over all buckets: the same bits."""
        if grads[0].dtype != torch.float32:
            grads = [g.float() for g in grads]  # the update is always computed in fp32
        fused = self.fused or found_inf is not None  # a skip decided on the device needs the kernel's flag
        if fused:
            self._prepare_fused()
            self._step_t += 1
            inv = None if grad_scale is None else torch.reciprocal(grad_scale.float())  # the kernel divides
        else:
            if grad_scale is not None:
                torch._foreach_mul_(grads, grad_scale)
            self._steps += 1
        for b in range(len(self.layout.buckets) - 1, -1, -1):
            if fused:
                self._fused_bucket(b, grads[b], lr, inv, found_inf)
            else:
                adamw_update(
                    [self.master[b]],
                    [grads[b]],
                    [self.exp_avg[b]],
                    [self.exp_avg_sq[b]],
                    self.decay_views[b],
                    self._steps,
                    lr,
                    self.betas,
                    self.eps,
                    self.weight_decay,
                )
            if self.master_flat is not None:
                self.param_owned[b].copy_(self.master[b])  # round the fp32 master down
            if updated is not None:
                updated(b)
        if fused and found_inf is not None:
            self._step_t -= found_inf  # a skipped step does not count (torch's fused Adam does the same)

    def _prepare_fused(self) -> None:
        # Per bucket, one view per owned segment, grouped by weight decay (the kernel takes one
        # decay per call); the step count as a 0-d tensor on the device.
        if self._fused_state is not None:
            return
        segs = self.layout.segments(self.rank)
        self._step_t = torch.full((), float(self._steps), dtype=torch.float32, device=self.exp_avg_flat.device)
        self._fused_state = [
            {
                decay: [
                    [(s.lo, s.hi) for s in segs if s.bucket == b and s.key == decay],
                    *(
                        [kind[b][s.lo : s.hi] for s in segs if s.bucket == b and s.key == decay]
                        for kind in (self.master, self.exp_avg, self.exp_avg_sq)
                    ),
                ]
                for decay in (True, False)
            }
            for b in range(len(self.layout.buckets))
        ]

    def _fused_bucket(self, b: int, grad: torch.Tensor, lr: float, inv, found_inf) -> None:
        groups = []
        for decay, weight_decay in ((True, self.weight_decay), (False, 0.0)):
            ranges, params, exp_avgs, exp_avg_sqs = self._fused_state[b][decay]
            groups.append((params, [grad[lo:hi] for lo, hi in ranges], exp_avgs, exp_avg_sqs, weight_decay))
        fused_adamw_update(groups, self._step_t, lr, self.betas, self.eps, inv, found_inf)

    # --- state ------------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor | None]:
        """Optimizer-owned storage, for memory accounting (master is None when aliased)."""
        return {"master": self.master_flat, "exp_avg": self.exp_avg_flat, "exp_avg_sq": self.exp_avg_sq_flat}

    def state_dict(self) -> dict:
        master = self.master_flat if self.master_flat is not None else torch.cat(self.master)
        return {
            "step": self.step_count,
            "master": master.clone(),
            "exp_avg": self.exp_avg_flat.clone(),
            "exp_avg_sq": self.exp_avg_sq_flat.clone(),
            "zero": self.zero,
            "shards": self.layout.shards,
            "rank": self.rank,
        }
