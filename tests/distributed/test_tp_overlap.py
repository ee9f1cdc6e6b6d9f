"""Tensor-parallel backward overlap: the column-parallel layers' weight-gradient matmuls run
between the start of the input gradient's collective and the wait for it, and give the same
gradients as computing them in the layer's own backward. One process: the collectives are
stand-ins that record the order (the values are checked across ranks by test_tensor_parallel)."""

import pytest
import torch

from threefold.distributed import comm
from threefold.distributed.comm import Group
from threefold.distributed.tensor_parallel import ColumnParallelLinear
from threefold.distributed.tensor_parallel import region as region_mod
from threefold.distributed.tensor_parallel.region import Region


class _Work:
    def __init__(self, events, what):
        self.events, self.what = events, what

    def wait(self):
        self.events.append(f"wait {self.what}")


@pytest.fixture
def events(monkeypatch):
    """Record each collective's start and wait, and when the deferred dW matmuls run. Group
    "ranks" all hold the same values: an all-reduce is the identity, a gather repeats the shard."""
    log = []

    def all_reduce(x, group, op=comm.SUM, async_op=False):
        log.append("start all_reduce")
        return _Work(log, "all_reduce") if async_op else x

    def reduce_scatter_into(out, x, group, async_op=False):
        log.append("start reduce_scatter")
        out.copy_(x[: out.shape[0]])
        return _Work(log, "reduce_scatter") if async_op else None

    def all_gather_into(out, x, group, async_op=False):
        log.append("start all_gather")
        out.copy_(x.repeat(group.size, *[1] * (x.dim() - 1)))
        return _Work(log, "all_gather") if async_op else None

    real = Region.weight_grads

    def weight_grads(self):
        log.append(f"dW x{len(self.deferred)}")
        return real(self)

    monkeypatch.setattr(comm, "all_reduce", all_reduce)
    monkeypatch.setattr(comm, "reduce_scatter_into", reduce_scatter_into)
    monkeypatch.setattr(comm, "all_gather_into", all_gather_into)
    monkeypatch.setattr(region_mod, "all_gather_dim0", lambda x, g: x.repeat(g.size, *[1] * (x.dim() - 1)))
    monkeypatch.setattr(Region, "weight_grads", weight_grads)
    return log


def _backward(overlap: bool, sp: bool):
    torch.manual_seed(0)
    tp = Group("tp", [0, 1], None)
    layer = ColumnParallelLinear(16, 8, tp, bias=True, sp=sp, overlap=overlap)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(4, 2, 16, requires_grad=True)
    layer(x).square().sum().backward()
    return layer.weight.grad, layer.bias.grad, x.grad


@pytest.mark.parametrize("sp", [False, True])
def test_weight_gradients_run_while_the_input_gradient_is_reduced(events, sp):
    collective = "reduce_scatter" if sp else "all_reduce"
    plain = _backward(overlap=False, sp=sp)
    without = list(events)
    events.clear()
    overlapped = _backward(overlap=True, sp=sp)
    # Without overlap the layer computes dW itself and the entry waits on its collective at once.
    assert without[-3:] == [f"start {collective}", "dW x0", f"wait {collective}"]
    # With overlap: the collective starts, dW runs, then the wait. Under SP the shard's gather
    # (dW's input) starts in the layer's backward, before its dX matmul, and is waited on first.
    if sp:
        assert events == ["start all_gather", "start reduce_scatter", "wait all_gather", "dW x1", "wait reduce_scatter"]
    else:
        assert events == ["start all_reduce", "dW x1", "wait all_reduce"]
    for got, want in zip(overlapped, plain):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
