"""Splitting a linear layer's backward into B (input gradient) and W (weight gradient).

Zero-bubble schedules (Qi et al. 2023) run dX = dY W right away, since the previous stage is
waiting for it, and defer dW = dY^T X into the pipeline's idle slots. Linear layers whose
`weight_grad_store` is set route through `_DeferrableLinear`: while the store is deferring
(inside a B action) their backward returns dX and queues the dW matmul under the B action's
key; the W action with the same key runs the queue and accumulates into `weight.grad`.
Everything else (norms, embeddings, biases) keeps computing its gradient inside B: they are
cheap, and the linear layers carry nearly all of the weight-gradient FLOPs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn


class WeightGradStore:
    """Queued weight-gradient work per (micro-batch, chunk)."""

    def __init__(self):
        self._key: Hashable | None = None
        self._queues: dict[Hashable, list[Callable[[], None]]] = {}
        # How a deferred dW joins the parameter's gradient; data parallelism replaces it with
        # its own (bucket bookkeeping: the reduction starts once every gradient has arrived).
        self.accumulate: Callable[[torch.Tensor, torch.Tensor], None] = _accumulate

    @contextlib.contextmanager
    def defer(self, key: Hashable):
        """Within this block, linear backwards queue their dW under `key`."""
        self._key = key
        self._queues.setdefault(key, [])
        try:
            yield
        finally:
            self._key = None

    @property
    def deferring(self) -> bool:
        return self._key is not None

    @property
    def pending(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def put(self, work: Callable[[], None]) -> None:
        self._queues[self._key].append(work)

    def run(self, key: Hashable) -> None:
        for work in self._queues.pop(key, []):
            work()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _DeferrableLinear.apply(x, weight, bias, self)


@torch.no_grad()
def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.has_bias = store, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight.to(grad_out.dtype)) if ctx.needs_input_grad[0] else None
        grad_bias = grad_out.flatten(0, -2).sum(0) if ctx.has_bias else None
        g2, x2 = grad_out.flatten(0, -2), x.flatten(0, -2)
        if not ctx.needs_input_grad[1]:  # a frozen weight: no dW at all
            return grad_x, None, grad_bias, None
        if ctx.store.deferring:

            def weight_grad(g2=g2, x2=x2, weight=weight, store=ctx.store):
                with torch.no_grad():
                    store.accumulate(weight, g2.t().matmul(x2.to(g2.dtype)).to(weight.dtype))

            ctx.store.put(weight_grad)
            return grad_x, None, grad_bias, None
        return grad_x, g2.t().matmul(x2.to(g2.dtype)).to(weight.dtype), grad_bias, None


def attach_weight_grad_store(modules: list[nn.Module], store: WeightGradStore) -> int:
    """Point every linear layer that supports deferral at `store`; returns how many."""
    count = 0
    for root in modules:
        for module in root.modules():
            if hasattr(module, "weight_grad_store"):
                module.weight_grad_store = store
                count += 1
    return count
