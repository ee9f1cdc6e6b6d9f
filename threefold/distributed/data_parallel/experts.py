"""Data parallelism for a mixture-of-experts model: two engines, one optimizer step.

Dense parameters are replicated over grid.dp_cp (grid.dp without context parallelism). A routed
expert lives on one expert-parallel rank and is replicated over grid.expert_dp (the tp x cp x edp
ranks with the same ep index: the TP and CP ranks split the tokens, the edp ranks the batch), so
its gradient is reduced, and under ZeRO its optimizer state sharded, over that group instead. Each group gets its own
`DataParallel` (buckets, ZeRO stage, AdamW); this class makes them act as one: one loss
scaler, one skip decision, one global gradient norm.

    engine = build_data_parallel(chunks, grid, zero=1, ...)   # DataParallel when there are no experts
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from threefold.distributed.data_parallel.engine import DataParallel, step_engines, sum_over
from threefold.model.moe import expert_parameters


def build_data_parallel(chunks: list[nn.Module], grid, fused_adamw: bool | None = None, **kwargs):
    """One engine over grid.dp_cp, or the dense + expert pair when `chunks` hold routed experts.
    `fused_adamw`: torch's fused AdamW kernel (train.adamw fused, what `threefold train` runs;
    None: where the parameters live on CUDA), or the foreach path, whose updates are
    bit-identical to torch.optim.AdamW's (train.adamw foreach)."""
    experts = expert_parameters(chunks)
    if not experts:
        engine = DataParallel(chunks, grid, **kwargs)
    else:
        engine = ExpertDataParallel(chunks, grid, {id(p) for p in experts}, **kwargs)
    if fused_adamw is None:
        fused_adamw = next(p for c in chunks for p in c.parameters()).device.type == "cuda"
    for part in engine.parts:
        part.optimizer.fused = fused_adamw
    return engine


class ExpertDataParallel:
    def __init__(self, chunks: list[nn.Module], grid, expert_ids: set[int], own_bucket=(), **kwargs):
        self.dense = DataParallel(chunks, grid, own_bucket=own_bucket, only=lambda p: id(p) not in expert_ids, **kwargs)
        self.experts = DataParallel(
            chunks, grid, group=grid.expert_dp, only=lambda p: id(p) in expert_ids, scaler=self.dense.scaler, **kwargs
        )
        self.parts = [self.dense, self.experts]
        self.scaler = self.dense.scaler

    @property
    def zero(self) -> int:
        return self.dense.zero

    @property
    def loss_scale(self) -> float:
        return self.scaler.value()

    @contextlib.contextmanager
    def no_sync(self):
        with self.dense.no_sync(), self.experts.no_sync():
            yield

    def finish(self) -> None:
        for e in self.parts:
            e.finish()

    def _owner(self, param: nn.Parameter) -> DataParallel:
        return self.experts if self.experts.owns(param) else self.dense

    def accumulate_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        self._owner(param).accumulate_grad(param, grad)

    def all_reduce_grads_of(self, params: list[nn.Parameter], group) -> None:
        for e in self.parts:
            e.all_reduce_grads_of([p for p in params if e.owns(p)], group)

    def grad_norm(
        self, groups: list = (), exclude: list[nn.Parameter] = (), carry: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Both engines' squares (each over its own groups: experts once per ep shard), then
        summed over `groups` once (pipeline stages may have no experts at all); `carry` rides
        the dense engine's sums and then those over `groups` (DataParallel.grad_sq)."""
        total = self.dense.grad_sq([], exclude, carry) + self.experts.grad_sq([])
        total = sum_over(total, groups, carry)
        return total.sqrt() / self.scaler.scale if self.scaler.enabled else total.sqrt()

    def step(self, lr: float, grad_norm: torch.Tensor, max_norm: float = 0.0) -> bool | torch.Tensor:
        """DataParallel.step's decision (overflow, NaN/Inf: skip) once, then both updates."""
        return step_engines(self.parts, lr, grad_norm, max_norm)

    def zero_grad(self) -> None:
        for e in self.parts:
            e.zero_grad()

    def wait_params(self) -> None:
        for e in self.parts:
            e.wait_params()

    def time_serial_comm(self, repeats: int = 5) -> float:
        """Blocking cost of one step's gradient collectives: each engine's replay (the dense
        buckets over dp, the experts' over expert_dp), summed, as their exposed waits are in
        the step's record. Collective over both groups, in the same order on every rank."""
        return sum(e.time_serial_comm(repeats) for e in self.parts)

    def time_serial_gather(self, repeats: int = 5) -> float:
        """Blocking cost of one step's parameter all-gathers: each engine's replay, summed."""
        return sum(e.time_serial_gather(repeats) for e in self.parts)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {**self.dense.full_parameters(), **self.experts.full_parameters()}

    def close(self) -> None:
        for e in self.parts:
            e.close()
