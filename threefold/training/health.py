"""Per-step health on a flat control plane: one small fused MAX all-reduce per step, after the
update, tells every rank whether any rank's loss or gradient was non-finite, and the slowest rank's
memory, data wait, pipeline wait and compute time, and whether any rank was asked to stop (a
signal); per-rank detail reaches rank 0 only on report steps.

Every rank takes the same two decisions: skip the step when any rank saw a NaN/Inf, on the device
and before the update, from the global norm and loss (skip_nonfinite: a NaN norm, which the
engine's found-inf path turns into an update that changes nothing, so AdamW never sees it and no
host sync precedes it); and, once the step's scalars are read, roll back to the last checkpoint
after `train.nan_rollback_after` such steps in a row (from the reduced flags). The all-reduce
carries a fixed number of values: its bytes per rank do not grow with the world.

Stragglers: each rank keeps its compute time of every step; on report steps (every log.interval
steps, the last step, traced steps) one gather brings them to rank 0 (O(world) there, rarely,
O(1) bytes elsewhere), which replays the steps since the last report: a rank whose compute time
stays above 1.5x the median of its peers for `train.straggler_steps` steps in a row is named.
Peers are the ranks of the same pipeline stage (stages do different work: the last one computes
the head and loss); with one rank per stage, all ranks.
"""

from __future__ import annotations

import torch

from threefold.distributed import comm

STRAGGLER_RATIO = 1.5
WORST = ("peak_mem_bytes", "data_wait_s", "pp_idle_s", "pp_idle_fraction", "compute_s_max", "stop")
"""The slowest or largest value over ranks of each, after the two flags in the reduced vector
(`stop`: a signal some rank received, training/signals.py: every rank stops after the same step)."""


class NonFiniteRollback(RuntimeError):
    """K steps in a row had a non-finite loss or gradient: reload the last checkpoint."""

    def __init__(self, step: int, count: int):
        super().__init__(f"{count} steps in a row had a non-finite loss or gradient (last: step {step + 1})")
        self.step, self.count = step, count


def host_values(values: list[float], device: torch.device) -> torch.Tensor:
    """Host floats as a device tensor without waiting for the device: on CUDA a pinned staging
    copy, queued behind the work in flight (a pageable copy would block the host until then)."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=torch.float64, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=torch.float64, device=device)


def skip_nonfinite(grad_norm: torch.Tensor, world_loss: torch.Tensor) -> torch.Tensor:
    """The norm every rank steps with: NaN (skip the update) when the step's gradient or loss is
    non-finite on any rank. Both are the same on every rank, so every rank decides alike, on the
    device and without a collective of its own: the norm's sums run over every group that holds
    a part of the gradient (a non-finite square of a replicated gradient reaches the others
    through them, DataParallel._local_sq), and the step's loss rides the same sums."""
    bad = ~torch.isfinite(grad_norm).reshape(()) | ~torch.isfinite(world_loss).all()
    return torch.where(bad, torch.full_like(grad_norm, float("nan")), grad_norm)


class StepHealth:
    def __init__(
        self, world_group, rollback_after: int, straggler_steps: int, log=print, stage_of: list[int] | None = None
    ):
        """`stage_of[r]`: rank r's pipeline stage (None: all ranks do the same work); only the
        group's first rank, which names stragglers, needs it."""
        self.world, self.rollback_after, self.straggler_steps, self.log = (
            world_group,
            rollback_after,
            straggler_steps,
            log,
        )
        n = world_group.size
        self.names_stragglers = getattr(world_group, "rank", 0) == 0
        if self.names_stragglers:
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
        self.stop = 0
        """The signal any rank received, known once a step's vector is read: stop after that step."""
        self.pending: torch.Tensor | None = None
        """The step's reduced vector (flags, then WORST), until settle() reads it."""
        self._times: list[float] = []

    def agree(
        self,
        grad_norm: torch.Tensor,
        loss_sum: torch.Tensor,
        compute_s: float,
        scaler_enabled: bool,
        worst: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0),
        stop: int = 0,
    ) -> None:
        """The step's agreement, after its update: whether any rank's loss or gradient was
        non-finite (with loss scaling a non-finite gradient alone is an fp16 overflow, which the
        scaler handles and which is not counted as a divergence), this rank's `worst` (peak
        memory, data wait, pipeline wait and idle fraction) and `stop` (the signal it received,
        0: none). One all-reduce, the step's last blocking collective: the ranks leave the step
        together, so the next step's first parameter gathers do not wait for a late rank.
        settle() (or record()) does the host's bookkeeping later."""
        device = grad_norm.device
        bad_grad = ~torch.isfinite(grad_norm).reshape(())
        diverged = ~torch.isfinite(loss_sum).all()
        if not scaler_enabled:
            diverged = diverged | bad_grad
        mine = torch.cat([torch.stack([diverged, bad_grad]).double(), host_values([*worst, compute_s, stop], device)])
        self.pending = comm.all_reduce_max(mine, self.world)
        self._times.append(compute_s)

    def settle(self, values: list[float] | None = None) -> dict:
        """The host's side of a step once its reduced vector is read (`values`: read by the
        caller with the step's other scalars, one host read per step, perhaps after the next step
        was queued; None reads the pending vector here):
        divergence counters; returns the slowest rank's WORST values."""
        if values is None:
            if self.pending is None:
                return {}
            values, self.pending = self.pending.tolist(), None
        diverged = values[0] > 0
        self.nonfinite += diverged
        self.in_a_row = self.in_a_row + 1 if diverged else 0
        worst = dict(zip(WORST, values[2:]))
        self.last["compute_s_max"] = worst["compute_s_max"]  # beside a report's median, if one came first
        self.stop = max(self.stop, int(worst["stop"]))
        return worst

    def report(self) -> None:
        """On a report step (collective over the world): every rank's compute times since the
        last report to rank 0, which names and clears stragglers over those steps."""
        if not self._times:
            return
        device = self.world.device or torch.device("cpu")
        table = comm.gather_dim0(torch.tensor([self._times], dtype=torch.float64, device=device), self.world)
        self._times = []
        if table is None or not self.names_stragglers:
            return
        table = table.cpu()
        for column in table.T:
            self._stragglers(column)
        self.last["compute_s_median"] = float(table[:, -1].median())

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
        self.settle()
        self.skipped += not applied
        out = {"steps_skipped": self.skipped, "nonfinite_steps": self.nonfinite, "stragglers": sorted(self.named)}
        out.update(self.last)
        self.last.pop("compute_s_median", None)  # a report step's figure, not carried to the next steps
        return out

    @property
    def rollback_due(self) -> bool:
        return bool(self.rollback_after) and self.in_a_row >= self.rollback_after
