"""A stage of known cost, for measuring the schedules themselves.

`SleepStage` takes a fixed time for forward, input-gradient and weight-gradient work (the way
a linear layer's dX and dW each cost one forward) without using a CPU core, so p ranks on a
machine with fewer cores still run the way p devices would. Bubble measurements against the
(p-1)/(m+p-1) family of formulas need exactly that: equal stage costs and no contention.
"""

from __future__ import annotations

import time

import torch
from torch import nn


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, seconds, store):
        ctx.seconds, ctx.store = seconds, store
        time.sleep(seconds)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)  # dX
        if ctx.store is not None and ctx.store.deferring:
            ctx.store.put(lambda: time.sleep(ctx.seconds))  # dW later, in W
        else:
            time.sleep(ctx.seconds)
        return grad, None, None, None


class SleepStage(nn.Module):
    """Forward sleeps `forward_s`; backward 2x that (or 1x + 1x in W when split)."""

    weight_grad_store = None

    def __init__(self, forward_s: float, last: bool = False):
        super().__init__()
        self.forward_s, self.last = forward_s, last
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        y = _Sleep.apply(x.float(), self.weight, self.forward_s, self.weight_grad_store)
        return y.sum() if self.last else y
