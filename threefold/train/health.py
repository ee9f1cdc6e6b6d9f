"""Per-step health: one small all_gather tells every rank each rank's compute time and
whether its loss or gradient was finite.

From it every rank takes the same two decisions: skip the step when any rank saw a NaN/Inf
(the engine's overflow path, so AdamW never sees it), and roll back to the last checkpoint
after `train.nan_rollback_after` such steps in a row. Rank 0 also names stragglers: a rank
whose compute time stays above 1.5x the median of its peers for `train.straggler_steps` steps
in a row. Peers are the ranks of the same pipeline stage (stages do different work: the last
one computes the head and loss); with one rank per stage, all ranks.
"""

from __future__ import annotations

import math

import torch

from threefold.distributed import comm

STRAGGLER_RATIO = 1.5


class NonFiniteRollback(RuntimeError):
    """K steps in a row had a non-finite loss or gradient: reload the last checkpoint."""

    def __init__(self, step: int, count: int):
        super().__init__(f"{count} steps in a row had a non-finite loss or gradient (last: step {step + 1})")
        self.step, self.count = step, count


class StepHealth:
    def __init__(
        self, world_group, rollback_after: int, straggler_steps: int, log=print, stage_of: list[int] | None = None
    ):
        """`stage_of[r]`: rank r's pipeline stage (None: all ranks do the same work)."""
        self.world, self.rollback_after, self.straggler_steps, self.log = (
            world_group,
            rollback_after,
            straggler_steps,
            log,
        )
        n = world_group.size
        stage_of = stage_of or [0] * n
        peers = [[r for r in range(n) if stage_of[r] == s] for s in sorted(set(stage_of))]
        self.peers = peers if any(len(g) > 1 for g in peers) else [list(range(n))]
        self.slow_streak = [0] * n
        self.fast_streak = [0] * n
        self.named: set[int] = set()
        self.skipped = 0
        self.nonfinite = 0
        self.in_a_row = 0
        self.last: dict = {}

    def agree(
        self, grad_norm: torch.Tensor, loss_sum: torch.Tensor, compute_s: float, scaler_enabled: bool
    ) -> torch.Tensor:
        """The gradient norm every rank must step with: NaN on all ranks when any rank's loss
        or gradient was non-finite (with loss scaling a non-finite gradient alone is an fp16
        overflow, which the scaler handles and which is not counted as a divergence)."""
        bad_loss = not bool(torch.isfinite(loss_sum).all())
        bad_grad = not math.isfinite(float(grad_norm))
        # On the gradient's device: the world group is NCCL on CUDA.
        mine = torch.tensor(
            [compute_s, float(bad_loss or (bad_grad and not scaler_enabled)), float(bad_grad)], device=grad_norm.device
        )
        table = comm.all_gather_dim0(mine.view(1, 3), self.world).cpu()
        self._stragglers(table[:, 0])
        diverged = bool(table[:, 1].any())
        self.nonfinite += diverged
        self.in_a_row = self.in_a_row + 1 if diverged else 0
        self.last = {"compute_s_max": float(table[:, 0].max()), "compute_s_median": float(table[:, 0].median())}
        if diverged or bool(table[:, 2].any()):
            return torch.full_like(grad_norm, float("nan"))
        return grad_norm

    def _stragglers(self, times: torch.Tensor) -> None:
        if not self.straggler_steps:
            return
        for group in self.peers:
            if len(group) < 2:
                continue
            # The lower median (torch.median) of two ranks is the faster one: a rank is measured
            # against the typical rank, not against an average it drags up itself.
            median = float(times[group].median())
            for r in group:
                t = float(times[r])
                slow = t > STRAGGLER_RATIO * median
                self.slow_streak[r] = self.slow_streak[r] + 1 if slow else 0
                self.fast_streak[r] = 0 if slow else self.fast_streak[r] + 1
                if self.slow_streak[r] >= self.straggler_steps and r not in self.named:
                    self.named.add(r)
                    self.log(
                        f"threefold: straggler: rank {r} computed {t / median:.1f}x the median "
                        f"({t * 1e3:.0f} ms vs {median * 1e3:.0f} ms) for {self.slow_streak[r]} steps in a row"
                    )
                # As many normal steps to be cleared as slow ones to be named: one noisy step of
                # its peers does not toggle a rank in and out of the list.
                elif self.fast_streak[r] >= self.straggler_steps and r in self.named:
                    self.named.discard(r)
                    self.log(f"threefold: rank {r} is no longer a straggler")

    def record(self, step: int, applied: bool) -> dict:
        """Counters of the run so far, for the metrics of the step just taken."""
        self.skipped += not applied
        return {
            "steps_skipped": self.skipped,
            "nonfinite_steps": self.nonfinite,
            "stragglers": sorted(self.named),
            **self.last,
        }

    @property
    def rollback_due(self) -> bool:
        return bool(self.rollback_after) and self.in_a_row >= self.rollback_after
