"""The fused AdamW path (the default on CUDA): the same update as the foreach path on every slice
a rank owns, within fp32 rounding, and a skip decided on the device that changes nothing."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from threefold.distributed.data_parallel import build_data_parallel
from threefold.distributed.data_parallel.layout import build_layout
from threefold.distributed.data_parallel.zero import ZeroAdamW
from threefold.distributed.grid import Grid

SHAPES = [(6, 5), (5,), (7, 3), (3,), (11,)]


def _optimizers(rank: int, shards: int = 2):
    """Two ZeroAdamW of rank `rank` of `shards` (ZeRO 1 slices: segments cut inside buckets),
    one fused, from the same initial values."""
    layout = build_layout(SHAPES, 64, 4, shards)
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(layout.numel, generator=gen)
    out = []
    for fused in (False, True):
        owned = [full[b.start : b.start + b.numel].clone()[slice(*_local(b, rank))] for b in layout.buckets]
        opt = ZeroAdamW(layout, SimpleNamespace(rank=rank, size=shards), 1, owned, None, (0.9, 0.95), 1e-8, 0.1)
        opt.fused = fused
        out.append(opt)
    return layout, out


def _local(bucket, rank):
    lo, hi = bucket.shard_range(rank)
    return lo - bucket.start, hi - bucket.start


def test_fused_update_matches_foreach_on_sharded_slices():
    kinds = set()
    for rank in (0, 1):
        layout, (foreach, fused) = _optimizers(rank)
        kinds |= {s.key for s in layout.segments(rank)}
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            grads = [torch.randn(b.shard_numel, generator=gen) for b in layout.buckets]
            clip = torch.tensor(0.7)
            foreach.step([g.clone() for g in grads], 1e-2, clip)
            fused.step([g.clone() for g in grads], 1e-2, clip)
        for seg in layout.segments(rank):  # padding is no parameter's: the fused path leaves it
            a, b = (o.master[seg.bucket][seg.lo : seg.hi] for o in (foreach, fused))
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        assert fused.step_count == foreach.step_count == 5
    assert kinds == {True, False}  # decayed and undecayed slices both met


def test_fused_skip_flag_leaves_every_tensor_and_the_step_count_alone():
    layout, (_, fused) = _optimizers(1)
    grads = [torch.ones(b.shard_numel) for b in layout.buckets]
    fused.step(grads, 1e-2, None, torch.zeros(()))
    before = [t.clone() for t in (torch.cat(fused.master), fused.exp_avg_flat, fused.exp_avg_sq_flat)]
    fused.step(grads, 1e-2, torch.tensor(float("nan")), torch.ones(()))
    after = (torch.cat(fused.master), fused.exp_avg_flat, fused.exp_avg_sq_flat)
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and fused.step_count == 1
    fused.step_count = 7  # a checkpoint's count, loaded: the device count follows
    fused.step(grads, 1e-2, None, torch.zeros(()))
    assert fused.step_count == 8


def test_engine_decides_the_skip_on_the_device():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    engine = build_data_parallel([model], Grid.alone(), fused_adamw=True, weight_decay=0.1)
    engine.backward(model(torch.randn(3, 4)).square().sum())
    engine.finish()
    before = [p.detach().clone() for p in model.parameters()]
    applied = engine.step(1e-2, torch.tensor(float("nan")), 1.0)
    assert isinstance(applied, torch.Tensor) and not applied  # a device flag, read with the step's scalars
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    applied = engine.step(1e-2, engine.grad_norm(), 1.0)
    assert applied and not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
