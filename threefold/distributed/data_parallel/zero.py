"""The distributed optimizer: AdamW on this rank's slices, global norm, clipping, re-gather.

ZeRO (Rajbhandari et al. 2020) stage by stage, with N = dp size:
- 0: every rank owns every bucket (plain data parallelism; optimizer state replicated).
- 1: rank r owns slice r of every bucket: fp32 master weights and both Adam moments exist
     only for that slice (12P/N bytes in mixed precision); after the update the new
     parameters are all-gathered, bucket by bucket, into the replicated flat buffer.
- 2: as 1, and gradients arrive already reduce-scattered: only the owned slice is kept.
- 3: as 2, and the parameters themselves are sharded (see params.py): the updated slice
     simply stays where it is; the next forward gathers it.
When the working parameters are fp32, the master weights *are* the owned parameter slices (no
copy); otherwise a separate fp32 master is kept and copied down after each update.
"""

from __future__ import annotations

import torch

from threefold.distributed import comm
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
        # parts of parameters that fall into this rank's slices.
        self.decay_views = [self.master[s.bucket][s.lo : s.hi] for s in layout.segments(self.rank) if s.key]
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
    ) -> None:
        """AdamW on the owned slices with gradients `grads` (per bucket, reduced), multiplied
        first by `grad_scale` (clip coefficient / loss scale) when given. `found_inf` (the
        fused path only): a 0-d fp32 flag on the device; 1 leaves every tensor untouched."""
        if grads[0].dtype != torch.float32:
            grads = [g.float() for g in grads]  # the update is always computed in fp32
        if self.fused:
            self._fused_step(grads, lr, grad_scale, found_inf)
        else:
            if grad_scale is not None:
                torch._foreach_mul_(grads, grad_scale)
            self._steps += 1
            adamw_update(
                self.master,
                grads,
                self.exp_avg,
                self.exp_avg_sq,
                self.decay_views,
                self._steps,
                lr,
                self.betas,
                self.eps,
                self.weight_decay,
            )
        if self.master_flat is not None:
            torch._foreach_copy_(self.param_owned, self.master)  # round the fp32 master down

    def _fused_step(self, grads, lr: float, grad_scale, found_inf) -> None:
        # One view per owned segment, grouped by weight decay (the kernel takes one decay per call).
        if self._fused_state is None:
            self._fused_segs = segs = self.layout.segments(self.rank)
            self._step_t = torch.full((), float(self._steps), dtype=torch.float32, device=self.exp_avg_flat.device)
            self._fused_state = {
                decay: [
                    [kind[s.bucket][s.lo : s.hi] for s in segs if s.key == decay]
                    for kind in (self.master, self.exp_avg, self.exp_avg_sq)
                ]
                for decay in (True, False)
            }
        segs = self._fused_segs
        self._step_t += 1
        groups = []
        for decay, weight_decay in ((True, self.weight_decay), (False, 0.0)):
            params, exp_avgs, exp_avg_sqs = self._fused_state[decay]
            views = [grads[s.bucket][s.lo : s.hi] for s in segs if s.key == decay]
            groups.append((params, views, exp_avgs, exp_avg_sqs, weight_decay))
        inv = None if grad_scale is None else torch.reciprocal(grad_scale.float())  # the kernel divides
        fused_adamw_update(groups, self._step_t, lr, self.betas, self.eps, inv, found_inf)
        if found_inf is not None:
            self._step_t -= found_inf  # a skipped step does not count (torch's fused Adam does the same)

    def gather(self, param_bucket: list[torch.Tensor]) -> None:
        """ZeRO 1/2: every rank contributes its updated slice of each bucket; the all-gather is
        in place (each input is this rank's slice of the output)."""
        if self.group.size == 1:
            return
        works = [
            comm.all_gather_into(full, owned, self.group, async_op=True)
            for full, owned in zip(param_bucket, self.param_owned)
        ]
        for work in works:
            comm.wait(work, self.group, spans=False)

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
