"""Data parallelism: bucket layout, AdamW arithmetic, invalid settings, and multi-process parity
of the DataParallel engine (dp 1/2/4 x ZeRO 0-3) against single-process torch AdamW and against
torch DDP, memory against the ZeRO formulas, mixed precision, loss scaling and overlap.

The multi-process tests each run many configurations inside one spawned group of gloo ranks,
splitting the world into dp sub-groups that work side by side.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from threefold.distributed.data_parallel import DataParallel, MixedPrecision, predict_memory
from threefold.distributed.data_parallel.adamw import adamw_update
from threefold.distributed.data_parallel.layout import ALIGN, build_layout, share_of
from threefold.distributed.grid import Grid, RankLayout
from threefold.distributed.parallelize import build_model
from threefold.errors import ConfigError

from dp_checks import (
    CPU,
    STEPS,
    flat_params,
    make_cfg,
    make_grid,
    max_delta,
    open_data,
    rank_pairs,
    train_ddp,
    train_engine,
)
from harness import PARITY, run_ranks, within

# --- pure units --------------------------------------------------------------------------------


def test_layout_buckets_follow_backward_order_and_shard_evenly():
    shapes = [(64, 32), (32,), (128, 32), (32,), (10, 3)]  # already in gradient-ready order
    layout = build_layout(shapes, bucket_bytes=4 * 2048, elem_bytes=4, shards=4)
    # Buckets close once they reach 8 KiB; parameters are never split.
    assert [b.slots for b in layout.buckets] == [(0,), (1, 2), (3, 4)]
    for b in layout.buckets:
        assert b.numel % (4 * ALIGN) == 0
        ranges = [b.shard_range(r) for r in range(4)]
        assert ranges[0][0] == b.start and ranges[-1][1] == b.start + b.numel
        assert all(ranges[r][1] == ranges[r + 1][0] for r in range(3))
    # Every element of every parameter is owned by exactly one rank, decay marks ndim >= 2.
    owned = {}
    for r in range(4):
        for seg in layout.segments(r):
            b = layout.buckets[seg.bucket]
            lo = b.shard_range(r)[0]
            for x in range(lo + seg.lo, lo + seg.hi):
                assert x not in owned
                owned[x] = seg.key
    expected = {}
    for s in layout.slots:
        expected.update({x: s.decay for x in range(s.start, s.start + s.numel)})
    assert owned == expected
    units = build_layout(shapes, 1.0, 4, 2, groups=[[0, 1], [2, 3, 4]])
    assert [b.slots for b in units.buckets] == [(0, 1), (2, 3, 4)]


def test_zero_0_replicas_square_shares_that_partition_the_gradient():
    """ZeRO 0's norm: each replica squares a share of the pieces of the (identical) reduced
    gradient; the shares must cover every piece once and carry similar sizes."""
    layout = build_layout([(64, 32), (32,), (128, 32), (32,), (10, 3), (96, 32)], 4 * 2048, 4, 1)
    pieces = layout.segments(0, key=lambda slot: slot.index)
    for parts in (1, 2, 3, 4, 8):
        shares = [share_of(pieces, parts, r) for r in range(parts)]
        assert sorted(seg.key for share in shares for seg in share) == [seg.key for seg in pieces]  # each once
        assert all(share == [seg for seg in pieces if seg in share] for share in shares)  # in order
        loads = [sum(seg.hi - seg.lo for seg in share) for share in shares]
        assert max(loads) - min(loads) <= max(seg.hi - seg.lo for seg in pieces), loads


def test_solo_parameter_is_sliced_the_same_whatever_surrounds_it():
    """A tied embedding (first pipeline stage) and its copy in the head (last stage) sit among
    different parameters; alone in a bucket, rank r owns the same elements of both."""

    def owned_elements(layout, index, rank):
        s = layout.slots[index]
        lo, hi = layout.buckets[s.bucket].shard_range(rank)
        return max(lo, s.start) - s.start, min(hi, s.start + s.numel) - s.start

    first = build_layout([(64, 32), (256, 32), (32,)], 4 * 4096, 4, 4, solo={1})  # block, embedding, norm
    last = build_layout([(256, 32), (32,), (96, 32)], 4 * 4096, 4, 4, solo={0})  # head copy, norm, block
    assert [b.slots for b in first.buckets] == [(0,), (1,), (2,)]
    assert all(owned_elements(first, 1, r) == owned_elements(last, 0, r) for r in range(4))


def test_adamw_update_is_bit_identical_to_torch():
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(7, 5, generator=gen), torch.randn(5, generator=gen)]
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(
        [{"params": [ref[0]], "weight_decay": 0.1}, {"params": [ref[1]], "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=True,
    )
    flat = torch.cat([p.reshape(-1) for p in params])
    m, v = torch.zeros_like(flat), torch.zeros_like(flat)
    for step in range(1, 6):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
        adamw_update(
            [flat],
            [torch.cat([g.reshape(-1) for g in grads])],
            [m],
            [v],
            [flat[:35]],
            step,
            3e-3,
            (0.9, 0.95),
            1e-8,
            0.1,
        )
    assert torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in ref]))


def test_invalid_settings_give_one_line(data):
    model = build_model(make_cfg(data), make_grid(), CPU)
    for kwargs, key in [
        (dict(bucket_mb=0), "parallel.bucket_mb"),
        (dict(bucket_mb=-1.0), "parallel.bucket_mb"),
        (dict(zero=4), "parallel.zero"),
    ]:
        with pytest.raises(ConfigError) as info:
            DataParallel(model, make_grid(), **kwargs)
        assert info.value.key == key and "\n" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        MixedPrecision(torch.float16)
    assert info.value.key == "train.loss_scale" and "\n" not in str(info.value)
    with pytest.raises(ConfigError):
        MixedPrecision.from_names("fp16", loss_scale="none")
    assert MixedPrecision.from_names("fp16").loss_scale == "dynamic"


def test_predicted_memory_matches_the_zero_paper():
    P, N = 1000, 4
    mixed = [predict_memory(P, N, z, torch.bfloat16) for z in range(4)]
    assert [sum(m[c] for c in ("params", "grads", "optimizer")) for m in mixed] == [
        16 * P,
        4 * P + 12 * P / N,
        2 * P + 14 * P / N,
        16 * P / N,
    ]
    fp32 = [predict_memory(P, N, z, torch.float32) for z in range(4)]
    assert [sum(m[c] for c in ("params", "grads", "optimizer")) for m in fp32] == [
        16 * P,
        8 * P + 8 * P / N,
        4 * P + 12 * P / N,
        16 * P / N,
    ]
    assert mixed[2]["formula"] == "2P + 2P/N + 12P/N"


def test_second_synchronized_backward_is_refused_for_zero_0_and_1(data):
    cfg = make_cfg(data)
    model = build_model(cfg, make_grid(), CPU)
    engine = DataParallel(model, make_grid(), zero=0, bucket_mb=1.0)
    tokens, sampler = open_data(cfg)
    x, y = sampler.microbatches(tokens.tokens, 0, 0, 1, 2)[0]
    engine.backward(model(x, y))
    with pytest.raises(RuntimeError, match="no_sync"):
        engine.backward(model(x, y))


def test_dp1_engine_matches_reference_for_fp32_and_tracks_it_in_bf16_and_fp16(data, dp_reference):
    cfg = make_cfg(data)
    # ZeRO at dp 1 is allowed and a no-op: every stage runs as stage 0, the same code path.
    model = build_model(cfg, make_grid(), CPU)
    assert [DataParallel(model, make_grid(), zero=z).zero for z in range(4)] == [0, 0, 0, 0]
    zero3 = make_cfg(data, **{"parallel.zero": 3})
    within(
        "dp1 engine fp32 vs reference loss", max_delta(train_engine(zero3, make_grid())["losses"], dp_reference), PARITY
    )
    # Low precision on CPU is slow: 10 steps.
    bf16 = train_engine(
        make_cfg(data, **{"train.dtype": "bf16", "train.grad_reduce_dtype": "fp32"}), make_grid(), steps=10
    )
    assert bf16["engine"].chunks[0].layers["0"].attn.wq.weight.dtype == torch.bfloat16
    within("dp1 engine bf16 vs fp32 loss", max_delta(bf16["losses"], dp_reference[:10]), 2e-2)
    fp16 = train_engine(make_cfg(data, **{"train.dtype": "fp16"}), make_grid(), steps=10)
    assert all(fp16["applied"])
    within("dp1 engine fp16 vs fp32 loss", max_delta(fp16["losses"], dp_reference[:10]), 2e-3)


# --- multi-process ----------------------------------------------------------------------------


def _parity_worker(data: str) -> dict:
    """Returns losses and parameter differences only: big results through the queue can be
    cut short by a rank's exit."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dp2 = {z: make_cfg(data, **{"parallel.dp": 2, "parallel.zero": z}) for z in range(4)}
    # Against torch.optim.AdamW bit for bit: the engine's foreach arithmetic (train.adamw foreach).
    dp2[0] = make_cfg(data, **{"parallel.dp": 2, "parallel.zero": 0, "train.adamw": "foreach"})
    no_clip = make_cfg(data, **{"parallel.dp": 2, "train.grad_clip": 0, "train.adamw": "foreach"})
    cfg = dp2[0]
    pair_grid, world_grid = rank_pairs()
    out: dict = {}
    flat = {}
    if rank < 2:  # dp 2, pair {0,1}: zero 0 and 1, and threefold for the comparison with DDP
        for zero in (0, 1):
            res = train_engine(dp2[zero], pair_grid, snapshot_at=10 if zero == 0 else None)
            out[(2, zero)] = res["losses"]
            if zero == 0:
                flat["clip"] = flat_params(res["params"])  # after 10 of its 20 steps
        flat["no_clip"] = flat_params(train_engine(no_clip, pair_grid, steps=10, snapshot_at=10)["params"])
        every = make_cfg(data, **{"parallel.dp": 2, "parallel.zero": 2, "parallel.grad_reduce": "every"})
        out["sync_every"] = train_engine(every, pair_grid, steps=5)["losses"]
        recompute = make_cfg(data, **{"parallel.dp": 2, "parallel.zero": 3, "train.recompute": "full"})
        out["zero3_variant"] = train_engine(recompute, pair_grid, steps=10)["losses"]  # blocks rerun in backward
    else:  # dp 2, pair {2,3}: zero 2 and 3, and torch DDP + AdamW
        for zero in (2, 3):
            out[(2, zero)] = train_engine(dp2[zero], pair_grid)["losses"]
        flat["clip"] = flat_params(train_ddp(cfg, pair_grid, 10))
        flat["no_clip"] = flat_params(train_ddp(no_clip, pair_grid, 10))
        every = make_cfg(data, **{"parallel.dp": 2, "parallel.zero": 3, "parallel.grad_reduce": "every"})
        out["sync_every"] = train_engine(every, pair_grid, steps=5)["losses"]
        after = make_cfg(data, **{"parallel.dp": 2, "parallel.zero": 3, "parallel.grad_reduce": "after"})
        out["zero3_variant"] = train_engine(after, pair_grid, steps=10)["losses"]  # reduced after backward
    for key, mine in flat.items():  # rank 0 holds threefold's parameters, rank 2 DDP's
        theirs = mine.clone()
        dist.broadcast(theirs, src=2)
        out[f"ddp_delta_{key}"] = (mine - theirs).abs().max().item()
    final = {}
    for zero in range(4):  # dp 4
        res = train_engine(make_cfg(data, **{"parallel.dp": 4, "parallel.zero": zero}), world_grid, snapshot_at=STEPS)
        out[(4, zero)] = res["losses"]
        final[zero] = flat_params(res["params"])
    out["zero_param_delta"] = max((final[z] - final[0]).abs().max().item() for z in (1, 2, 3))
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_parity_over_dp_and_zero_and_against_torch_ddp(data, dp_reference):
    results = run_ranks(_parity_worker, 4, data, timeout=300)
    deltas = {}
    for res in results:
        for key, losses in res.items():
            if isinstance(key, tuple):
                deltas[key] = max(deltas.get(key, 0.0), max_delta(losses, dp_reference))
    assert sorted(deltas) == [(2, z) for z in range(4)] + [(4, z) for z in range(4)]
    for (dp, zero), delta in sorted(deltas.items()):
        within(f"engine dp{dp} zero{zero} vs reference loss", delta, PARITY)
    for rank in (0, 2):  # ZeRO 2 and 3 reduce-scattering after every micro-batch
        within(
            f"engine zero{2 + rank // 2} sync every micro-batch loss",
            max_delta(results[rank]["sync_every"], dp_reference[:5]),
            PARITY,
        )
    # ZeRO 3 with full recomputation (rank 0), and over two pipeline chunks on one rank (rank 2).
    for rank, what in ((0, "full recompute"), (2, "reduced after backward")):
        within(f"engine zero3 {what} loss", max_delta(results[rank]["zero3_variant"], dp_reference[:10]), PARITY)
    # threefold dp 2 zero 0 vs torch DDP + torch AdamW after 10 steps. Without clipping the
    # gradients and the update arithmetic are the same, bit for bit. With clipping, the norms
    # differ in the last bits (different summation order; torch's clip_grad_norm_ is itself
    # ~3e-7 relative from the float64 norm) and Adam amplifies that where gradients are ~eps.
    within("zero 0 vs DDP params, no clipping", results[0]["ddp_delta_no_clip"], 0)  # bit for bit
    within("zero 0 vs DDP params, clipping", results[0]["ddp_delta_clip"], 1.2e-7)
    # Sharded optimizers end where the replicated one does, up to the same clip-norm rounding.
    within("zero 1-3 vs zero 0 params", results[0]["zero_param_delta"], 2.5e-6)
    print(
        f"\nparity: max loss delta {max(deltas.values()):.2e}; vs DDP no clip "
        f"{results[0]['ddp_delta_no_clip']:.2e}, clip {results[0]['ddp_delta_clip']:.2e}; "
        f"zero 1-3 vs 0 params {results[0]['zero_param_delta']:.2e}"
    )


def test_gradients_from_outside_autograd_are_folded_in(data):
    """A zero-bubble pipeline's deferred weight gradient goes through accumulate_grad; a .grad
    assigned directly is folded in by finish()."""
    model = build_model(make_cfg(data), make_grid(), CPU)
    engine = DataParallel(model, make_grid(), precision=MixedPrecision(torch.bfloat16, torch.float32))
    p, slot = engine.params[0], engine.layout.slots[0]
    engine.accumulate_grad(p, torch.ones_like(p))
    p.grad = torch.full_like(p, 2.0)
    engine.finish()
    assert p.grad is None
    assert torch.equal(engine.grads.flat[slot.start : slot.start + slot.numel], torch.full((slot.numel,), 3.0))


def _tp_worker(data: str) -> dict:
    dist.init_process_group("gloo")
    grid = Grid.build(RankLayout(tp=2, dp=2))
    out = {
        zero: train_engine(
            make_cfg(data, **{"parallel.tp": 2, "parallel.dp": 2, "parallel.sp": "true", "parallel.zero": zero}), grid
        )["losses"]
        for zero in (1, 3)
    }
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_composes_with_tensor_and_sequence_parallelism(data, dp_reference):
    """dp 2 x tp 2 with SP: tensor-parallel shards in the buckets, partial norm gradients
    summed over tp on the owned slices, the clip norm counting every element once."""
    pytest.importorskip("threefold.distributed.tensor_parallel")
    results = run_ranks(_tp_worker, 4, data, timeout=300)
    for z in (1, 3):
        within(
            f"engine tp2 sp dp2 zero{z} vs reference loss", max(max_delta(r[z], dp_reference) for r in results), PARITY
        )


def _replicated_nan_worker(data: str) -> dict:
    """tp 2 without SP: the norms' weights are replicated, their gradients made on each tp rank.
    Step 2's gradient of one of them is NaN on tp rank 1 only."""
    from threefold.model.sharding import sharding_of
    from threefold.training.trainer import Trainer

    dist.init_process_group("gloo")
    grid = Grid.build(RankLayout(tp=2))
    trainer = Trainer(make_cfg(data, **{"parallel.tp": 2}), grid, CPU, log=lambda *args: None)
    replicated = [p for c in trainer.chunks for p in c.parameters() if not sharding_of(p).split]
    step = [0]
    if grid.tp.rank == 1:
        replicated[0].register_hook(lambda g: g * float("nan") if step[0] == 1 else g)
    applied = []
    for s in range(3):
        step[0] = s
        applied.append(bool(trainer.train_step(s).applied))
    params = [p.detach().reshape(-1).tolist() for p in replicated]  # plain lists: the worker exits
    dist.destroy_process_group()
    return {"applied": applied, "params": params}


def test_a_nan_in_one_tp_ranks_replicated_gradient_skips_the_step_on_every_rank(data):
    """The skip is decided from each rank's global norm: a non-finite copy of a replicated
    gradient on one tp rank reaches the other through the norm's tp sums, so both skip step 2,
    and the replicated weights stay equal."""
    results = run_ranks(_replicated_nan_worker, 2, data, timeout=300)
    assert [r["applied"] for r in results] == [[True, False, True]] * 2
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert a == b and torch.isfinite(torch.tensor(a)).all()


def test_zero3_keeps_at_most_prefetch_plus_one_blocks_whole():
    """ZeRO 3's in-flight limit, on the store alone: with prefetch 1 a third block's prefetch
    waits until a block is freed, then goes; roots are outside the limit."""
    from threefold.distributed.comm import Group
    from threefold.distributed.data_parallel.params import ShardedParams

    params = [torch.nn.Parameter(torch.randn(32, 16)) for _ in range(4)] + [torch.nn.Parameter(torch.randn(64))]
    layout = build_layout([tuple(p.shape) for p in params], 1.0, 4, 1, groups=[[0], [1], [2], [3], [4]])
    store = ShardedParams(params, layout, torch.float32, Group("dp", [0], None), prefetch=1)
    store.blocks.update({0, 1, 2, 3})
    block = layout.buckets[0].numel * 4
    for b in (4, 0, 1, 2):  # the root, then three blocks ahead
        store.prefetch(b)
    assert store.wanted == [2] and store.held_bytes == layout.buckets[4].numel * 4 + 2 * block
    store.free(0)
    assert store.wanted == [] and store.state[2] is not None and store.state[0] is None
    assert store.take_peak_held() == layout.buckets[4].numel * 4 + 2 * block


def test_zero_2_bucket_starts_uninitialised_and_reduces_an_unused_parameter_as_zero(monkeypatch):
    """ZeRO 2/3 allocate a bucket's gradient uninitialised and copy each first gradient in: a
    parameter that got no gradient this step must reduce as zero, not as whatever the memory
    held (here: NaN, as torch.empty may give)."""
    from torch import nn

    from threefold.distributed.comm import Group
    from threefold.distributed.data_parallel.buckets import GradBuckets

    used, unused = nn.Parameter(torch.ones(40)), nn.Parameter(torch.ones(20))  # + 4 elements of padding
    params = [used, unused]
    layout = build_layout([tuple(p.shape) for p in params], 1 << 20, 4, 1)
    grads = GradBuckets(params, layout, Group("dp", [0], None), 2, torch.float32, torch.device("cpu"), False)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    for _ in range(2):  # the second step's bucket is allocated anew
        (used * 3.0).sum().backward()
        grads.finish()
        (owned,) = grads.owned()
        assert owned[:40].tolist() == [3.0] * 40 and owned[40:].tolist() == [0.0] * (owned.numel() - 40)
        grads.zero_grad()
