"""Data parallelism: bucket layout, AdamW arithmetic, invalid settings, and multi-process parity
of the DataParallel engine (dp 1/2/4 x ZeRO 0-3) against single-process torch AdamW and against
torch DDP, memory against the ZeRO formulas, mixed precision, loss scaling and overlap.

The multi-process tests each run many configurations inside one spawned group of gloo ranks,
splitting the world into dp sub-groups that work side by side.
"""
from __future__ import annotations

import contextlib
import os
import statistics

import numpy as np
import pytest
import torch
import torch.distributed as dist

from harness import CALM_LR, PARITY, run_ranks, within
from threefold.config import build_config
from threefold.data import GlobalBatchSampler, load_tokens
from threefold.distributed.data_parallel import DataParallel, MixedPrecision, measure_memory, predict_memory
from threefold.distributed.data_parallel.adamw import adamw_update
from threefold.distributed.data_parallel.layout import ALIGN, build_layout
from threefold.distributed.data_parallel.state import owned_pieces, refresh_params
from threefold.distributed.grid import Grid, Group, RankLayout
from threefold.distributed.parallelize import build_model
from threefold.errors import ConfigError
from threefold.train.optim import build_optimizer, clip_gradients, global_grad_norm, lr_at
from threefold.train.trainer import Trainer
from threefold.validate import validate

SMALL = {"model.preset": "tiny", "model.layers": 2, "model.seq_len": 64, "train.global_batch": 8,
         "train.micro_batch": 2, "train.warmup_steps": 5, "train.steps": 20, "train.lr": CALM_LR,
         "parallel.bucket_mb": 1.0}
STEPS = 20
CPU = torch.device("cpu")


# --- helpers (module level: spawned ranks import them) --------------------------------------


def make_cfg(data: str, **extra):
    """SMALL on the stdlib corpus's token file `data` (see the `data` fixture), validated; logs
    (rank 0's) next to the data. Set parallel.dp to the data-parallel group it trains on."""
    pairs = {**SMALL, "data.path": data, "data.vocab": 256, "log.quiet": True,
             "log.dir": os.path.join(os.path.dirname(data), "logs"), **extra}
    return validate(build_config(None, [(k, str(v)) for k, v in pairs.items()]))


def make_grid(dp_ranks: list[int] | None = None, dp_pg=None) -> Grid:
    """A grid whose only non-trivial group is dp (sub-groups of one spawned world)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if dp_ranks and len(dp_ranks) > 1:
        return Grid.alone(rank, dp=Group("dp", dp_ranks, dp_pg))
    return Grid.alone(rank)


def open_data(cfg):
    tokens = load_tokens(cfg.data.path, cfg.data.vocab, cfg.data.dtype, cfg.data.cache_dir)
    return tokens, GlobalBatchSampler(len(tokens.tokens), cfg.model.seq_len, cfg.train.global_batch, cfg.train.seed)


class _MemoryAfterStep:
    """A Trainer probe: the engine's memory after the update, before zero_grad."""

    def watch(self, chunks):
        return contextlib.nullcontext()

    def after_step(self, engine) -> None:
        self.report = measure_memory(engine)


def train_engine(cfg, grid: Grid, steps: int = STEPS, snapshot_at: int | None = None, measure: bool = False) -> dict:
    """threefold's Trainer on `grid`: per step the loss, whether the update was applied and the
    loss scale it ran with (+ the parameters after `snapshot_at`, the memory after the last update)."""
    probe = _MemoryAfterStep() if measure else None
    trainer = Trainer(cfg, grid, CPU, log=lambda *args: None, probe=probe)
    out = {"losses": [], "applied": [], "scales": [], "engine": trainer.engine}
    for step in range(steps):
        out["scales"].append(trainer.engine.loss_scale)
        result = trainer.train_step(step)
        out["losses"].append(result.loss)
        out["applied"].append(result.applied)
        if snapshot_at == step + 1:
            out["params"] = trainer.engine.full_parameters()
    if probe is not None:
        out["memory"] = probe.report
    return out


def train_reference(cfg, steps: int = STEPS) -> list[float]:
    """The pre-existing single-process loop: torch AdamW, global_grad_norm, clip_gradients."""
    t = cfg.train
    model = build_model(cfg, make_grid(), CPU)
    optimizer = build_optimizer(model, t)
    tokens, sampler = open_data(cfg)
    per_step = t.global_batch * cfg.model.seq_len
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, t)
        total = 0.0
        for x, y in sampler.microbatches(tokens.tokens, step, 0, 1, t.micro_batch):
            loss = model(x, y)
            (loss / per_step).backward()
            total += loss.item()
        clip_gradients(model, t.grad_clip, global_grad_norm(model, []))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / per_step)
    return losses


def train_ddp(cfg, grid: Grid, steps: int) -> dict[str, torch.Tensor]:
    """torch DistributedDataParallel + torch.optim.AdamW + clip_grad_norm_ on the same data."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    t = cfg.train
    model = build_model(cfg, grid, CPU)
    ddp = DDP(model, process_group=grid.dp.pg)
    optimizer = build_optimizer(model, t)
    tokens, sampler = open_data(cfg)
    local_tokens = t.global_batch * cfg.model.seq_len / grid.dp.size  # DDP averages over ranks
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, t)
        batches = sampler.microbatches(tokens.tokens, step, grid.dp_rank, grid.dp.size, t.micro_batch)
        for i, (x, y) in enumerate(batches):
            with ddp.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                (ddp(x, y) / local_tokens).backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _max_delta(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def data(tmp_path_factory, cache_dir) -> str:
    """The stdlib corpus as a token file: every Trainer in every rank maps it (fast) instead of
    checking the stdlib cache again (about a second each)."""
    path = tmp_path_factory.mktemp("data") / "stdlib.bin"
    load_tokens("", 0, "uint16", cache_dir).tokens.astype(np.uint16).tofile(path)
    return str(path)


@pytest.fixture(scope="module")
def reference(data) -> list[float]:
    return train_reference(make_cfg(data))


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
    opt = torch.optim.AdamW([{"params": [ref[0]], "weight_decay": 0.1}, {"params": [ref[1]], "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    flat = torch.cat([p.reshape(-1) for p in params])
    m, v = torch.zeros_like(flat), torch.zeros_like(flat)
    for step in range(1, 6):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
        adamw_update([flat], [torch.cat([g.reshape(-1) for g in grads])], [m], [v], [flat[:35]], step,
                     3e-3, (0.9, 0.95), 1e-8, 0.1)
    assert torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in ref]))


def test_invalid_settings_give_one_line(data):
    model = build_model(make_cfg(data), make_grid(), CPU)
    for kwargs, key in [(dict(bucket_mb=0), "parallel.bucket_mb"), (dict(bucket_mb=-1.0), "parallel.bucket_mb"),
                        (dict(zero=4), "parallel.zero")]:
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
    assert [sum(m[c] for c in ("params", "grads", "optimizer")) for m in mixed] == \
        [16 * P, 4 * P + 12 * P / N, 2 * P + 14 * P / N, 16 * P / N]
    fp32 = [predict_memory(P, N, z, torch.float32) for z in range(4)]
    assert [sum(m[c] for c in ("params", "grads", "optimizer")) for m in fp32] == \
        [16 * P, 8 * P + 8 * P / N, 4 * P + 12 * P / N, 16 * P / N]
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


def test_dp1_engine_matches_reference_for_fp32_and_tracks_it_in_bf16_and_fp16(data, reference):
    cfg = make_cfg(data)
    # ZeRO at dp 1 is allowed and a no-op: every stage runs as stage 0, the same code path.
    model = build_model(cfg, make_grid(), CPU)
    assert [DataParallel(model, make_grid(), zero=z).zero for z in range(4)] == [0, 0, 0, 0]
    zero3 = make_cfg(data, **{"parallel.zero": 3})
    within("dp1 engine fp32 vs reference loss", _max_delta(train_engine(zero3, make_grid())["losses"], reference),
           PARITY)
    # Low precision on CPU is slow: 10 steps.
    bf16 = train_engine(make_cfg(data, **{"train.dtype": "bf16", "train.grad_reduce_dtype": "fp32"}), make_grid(),
                        steps=10)
    assert bf16["engine"].chunks[0].layers["0"].attn.wq.weight.dtype == torch.bfloat16
    within("dp1 engine bf16 vs fp32 loss", _max_delta(bf16["losses"], reference[:10]), 2e-2)
    fp16 = train_engine(make_cfg(data, **{"train.dtype": "fp16"}), make_grid(), steps=10)
    assert all(fp16["applied"])
    within("dp1 engine fp16 vs fp32 loss", _max_delta(fp16["losses"], reference[:10]), 2e-3)


# --- multi-process ----------------------------------------------------------------------------


def _pairs():
    """Sub-groups {0,1} and {2,3} of a 4-rank world (every rank creates every group)."""
    groups = {(0, 1): dist.new_group([0, 1]), (2, 3): dist.new_group([2, 3])}
    pair = (0, 1) if dist.get_rank() < 2 else (2, 3)
    return make_grid(list(pair), groups[pair]), make_grid([0, 1, 2, 3], dist.group.WORLD)


def _flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([params[n].float().reshape(-1) for n in sorted(params)])


def _parity_worker(data: str) -> dict:
    """Returns losses and parameter differences only: big results through the queue can be
    cut short by a rank's exit."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dp2 = {z: make_cfg(data, **{"parallel.dp": 2, "parallel.zero": z}) for z in range(4)}
    no_clip = make_cfg(data, **{"parallel.dp": 2, "train.grad_clip": 0})
    cfg = dp2[0]
    pair_grid, world_grid = _pairs()
    out: dict = {}
    flat = {}
    if rank < 2:  # dp 2, pair {0,1}: zero 0 and 1, and threefold for the comparison with DDP
        for zero in (0, 1):
            res = train_engine(dp2[zero], pair_grid, snapshot_at=10 if zero == 0 else None)
            out[(2, zero)] = res["losses"]
            if zero == 0:
                flat["clip"] = _flat(res["params"])  # after 10 of its 20 steps
        flat["no_clip"] = _flat(train_engine(no_clip, pair_grid, steps=10, snapshot_at=10)["params"])
        every = make_cfg(data, **{"parallel.dp": 2, "parallel.zero": 2, "parallel.grad_reduce": "every"})
        out["sync_every"] = train_engine(every, pair_grid, steps=5)["losses"]
        recompute = make_cfg(data, **{"parallel.dp": 2, "parallel.zero": 3, "train.recompute": "full"})
        out["zero3_variant"] = train_engine(recompute, pair_grid, steps=10)["losses"]  # blocks rerun in backward
    else:  # dp 2, pair {2,3}: zero 2 and 3, and torch DDP + AdamW
        for zero in (2, 3):
            out[(2, zero)] = train_engine(dp2[zero], pair_grid)["losses"]
        flat["clip"] = _flat(train_ddp(cfg, pair_grid, 10))
        flat["no_clip"] = _flat(train_ddp(no_clip, pair_grid, 10))
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
        final[zero] = _flat(res["params"])
    out["zero_param_delta"] = max((final[z] - final[0]).abs().max().item() for z in (1, 2, 3))
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_parity_over_dp_and_zero_and_against_torch_ddp(data, reference):
    results = run_ranks(_parity_worker, 4, data, timeout=300)
    deltas = {}
    for res in results:
        for key, losses in res.items():
            if isinstance(key, tuple):
                deltas[key] = max(deltas.get(key, 0.0), _max_delta(losses, reference))
    assert sorted(deltas) == [(2, z) for z in range(4)] + [(4, z) for z in range(4)]
    for (dp, zero), delta in sorted(deltas.items()):
        within(f"engine dp{dp} zero{zero} vs reference loss", delta, PARITY)
    for rank in (0, 2):  # ZeRO 2 and 3 reduce-scattering after every micro-batch
        within(f"engine zero{2 + rank // 2} sync every micro-batch loss",
               _max_delta(results[rank]["sync_every"], reference[:5]), PARITY)
    # ZeRO 3 with full recomputation (rank 0), and over two pipeline chunks on one rank (rank 2).
    for rank, what in ((0, "full recompute"), (2, "reduced after backward")):
        within(f"engine zero3 {what} loss", _max_delta(results[rank]["zero3_variant"], reference[:10]), PARITY)
    # threefold dp 2 zero 0 vs torch DDP + torch AdamW after 10 steps. Without clipping the
    # gradients and the update arithmetic are the same, bit for bit. With clipping, the norms
    # differ in the last bits (different summation order; torch's clip_grad_norm_ is itself
    # ~3e-7 relative from the float64 norm) and Adam amplifies that where gradients are ~eps.
    within("zero 0 vs DDP params, no clipping", results[0]["ddp_delta_no_clip"], 0)  # bit for bit
    within("zero 0 vs DDP params, clipping", results[0]["ddp_delta_clip"], 1.2e-7)
    # Sharded optimizers end where the replicated one does, up to the same clip-norm rounding.
    within("zero 1-3 vs zero 0 params", results[0]["zero_param_delta"], 2.5e-6)
    print(f"\nparity: max loss delta {max(deltas.values()):.2e}; vs DDP no clip "
          f"{results[0]['ddp_delta_no_clip']:.2e}, clip {results[0]['ddp_delta_clip']:.2e}; "
          f"zero 1-3 vs 0 params {results[0]['zero_param_delta']:.2e}")


def _pieces_round_trip(engine) -> bool:
    """The checkpoint pieces of all dp ranks tile every parameter exactly once, hold its fp32
    master, and what is loaded into them becomes the working parameters after refresh_params."""
    pieces = owned_pieces(engine)
    names = {id(p): n for n, p in engine.chunks[0].named_parameters()}
    assembled = {id(p): torch.zeros(p.shape) for p in engine.params}
    for piece in pieces:
        index = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.tensors["master"].shape))
        assembled[id(piece.param)][index] += piece.tensors["master"]
    for full in assembled.values():
        dist.all_reduce(full, group=engine.group.pg)
    before = engine.full_parameters()
    tiled = all(torch.equal(assembled[id(p)].to(p.dtype), before[names[id(p)]]) for p in engine.params)
    for piece in pieces:  # "load" a checkpoint whose value is the element's index in its parameter
        rows = torch.arange(piece.offsets[0], piece.offsets[0] + piece.tensors["master"].shape[0])
        value = rows[:, None] * piece.param.shape[-1] + torch.arange(piece.tensors["master"].shape[-1]) \
            + piece.offsets[-1] if piece.param.ndim == 2 else rows
        piece.tensors["master"].copy_(value.float() / 1024)
    refresh_params(engine, step=7)
    after = engine.full_parameters()
    loaded = all(torch.equal(after[names[id(p)]], (torch.arange(p.numel()).float() / 1024).view(p.shape).to(p.dtype))
                 for p in engine.params)
    return tiled and loaded and engine.optimizer.step_count == 7


def _memory_precision_worker(data: str) -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pair_grid, world_grid = _pairs()
    out: dict = {"memory": {}}
    # Memory after one step, between steps. N = 2: each pair takes one precision; N = 4: both.
    runs = [(2, pair_grid, "fp32" if rank < 2 else "bf16"), (4, world_grid, "fp32"), (4, world_grid, "bf16")]
    for n, grid, name in runs:
        for zero in range(4):
            cfg = make_cfg(data, **{"parallel.dp": n, "parallel.zero": zero, "train.dtype": name,
                                    "parallel.bucket_mb": 0.5})
            res = train_engine(cfg, grid, steps=1, measure=True)
            report = res["memory"]
            out["memory"][(n, name, zero)] = (report.measured, report.predicted, report.ratio())
            if zero > 0 and (n, name) in ((4, "fp32"), (4, "bf16"), (2, "bf16" if rank < 2 else "fp32")):
                out.setdefault("pieces", []).append(_pieces_round_trip(res["engine"]))
    if rank < 2:  # fp16, ZeRO 2: an overflowing start is skipped, the scale halves, then grows back
        cfg = make_cfg(data, **{"parallel.dp": 2, "parallel.zero": 2, "train.dtype": "fp16",
                                "train.initial_loss_scale": 2.0 ** 20, "train.loss_scale_window": 2})
        res = train_engine(cfg, pair_grid, steps=9, snapshot_at=1)
        initial = build_model(cfg, make_grid(), CPU)
        before = _flat({n: p.detach().half() for n, p in initial.named_parameters()})
        out["fp16"] = {"applied": res["applied"], "scales": res["scales"], "losses": res["losses"],
                       "unchanged_after_skip": torch.equal(before, _flat(res["params"]))}
    else:  # bf16 parameters, fp32 master and fp32 reduce-scatter, ZeRO 3
        cfg = make_cfg(data, **{"parallel.dp": 2, "parallel.zero": 3, "train.dtype": "bf16",
                                "train.grad_reduce_dtype": "fp32"})
        res = train_engine(cfg, pair_grid, steps=6)
        out["bf16_losses"] = res["losses"]
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_memory_matches_zero_formulas_and_mixed_precision(data, reference):
    results = run_ranks(_memory_precision_worker, 4, data, timeout=300)
    memory = {**results[0]["memory"], **results[2]["memory"]}
    assert len(memory) == 16
    assert all(r["pieces"] for r in results) and all(all(r["pieces"]) for r in results)
    for (n, name, zero), (measured, predicted, ratio) in sorted(memory.items()):
        # Byte for byte: the formula counts the padded buckets the engine allocates.
        within(f"memory / ZeRO formula - 1, N{n} {name} zero {zero}", abs(ratio - 1), 0)
        for c in ("params", "grads", "optimizer"):
            within(f"{c} bytes vs ZeRO formula, N{n} {name} zero {zero}", abs(measured[c] - predicted[c]), 0)
    # Sharding pays: ZeRO 3 at N = 4 holds about a quarter of ZeRO 0's model state.
    assert sum(memory[(4, "bf16", 3)][0].values()) < 0.27 * sum(memory[(4, "bf16", 0)][0].values())
    fp16 = results[0]["fp16"]
    assert not fp16["applied"][0] and fp16["unchanged_after_skip"]
    for i in range(len(fp16["applied"]) - 1):
        if not fp16["applied"][i]:
            assert fp16["scales"][i + 1] == fp16["scales"][i] / 2
    assert any(fp16["applied"]) and max(fp16["scales"][1:]) <= 2.0 ** 19
    good = [i for i in range(1, len(fp16["applied"])) if fp16["applied"][i] and fp16["applied"][i - 1]]
    assert any(fp16["scales"][i + 1] == 2 * fp16["scales"][i] for i in good if i + 1 < len(fp16["scales"]))
    assert fp16["losses"][-1] < fp16["losses"][0]
    within("engine bf16 zero3 fp32 reduce vs fp32 loss", _max_delta(results[2]["bf16_losses"], reference[:6]), 2e-2)
    print("\nmemory measured/predicted: " + ", ".join(f"N{n} {name} z{z} {r:.3f}"
                                                       for (n, name, z), (_, _, r) in sorted(memory.items())))
    print(f"fp16 applied {fp16['applied']} scales {fp16['scales']}")


def _overlap_worker(data: str) -> dict:
    """dp 2, ZeRO 0 and 2, small buckets: are buckets launched inside backward, and how much of
    the reduction is left once the slower rank's backward has ended?"""
    dist.init_process_group("gloo")
    cfg = make_cfg(data, **{"parallel.dp": 2})
    grid = make_grid([0, 1], dist.group.WORLD)
    tokens, sampler = open_data(cfg)
    per_step = cfg.train.global_batch * cfg.model.seq_len
    out = {}
    for zero in (0, 2):
        model = build_model(cfg, grid, CPU)
        engine = DataParallel(model, grid, zero=zero, bucket_mb=0.125)
        launched, exposed = [], []
        for step in range(6):
            batches = sampler.microbatches(tokens.tokens, step, grid.dp_rank, 2, cfg.train.micro_batch)
            for i, (x, y) in enumerate(batches):
                with engine.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                    engine.backward(model(x, y) / per_step)
                launched.append(engine.grads.launched_in_backward)
            engine.finish()
            exposed.append(engine.exposed_comm_s())
            engine.step(1e-3, engine.grad_norm(), 1.0)
            engine.zero_grad()
        serial = engine.time_serial_comm(repeats=5)
        out[zero] = {"buckets": len(engine.layout.buckets), "launched": launched, "serial_s": serial,
                     "exposed_s": statistics.median(exposed[2:])}
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_bucket_reduction_overlaps_backward(data):
    """Buckets leave during the synchronized backward, none during no_sync ones; prints how
    much communication was left after the slower rank's backward ended."""
    results = run_ranks(_overlap_worker, 2, data, timeout=180)
    for zero in (0, 2):
        res = results[0][zero]
        n = res["buckets"]
        assert n >= 2
        # Nothing is sent during no_sync micro-batches; every bucket leaves during the last backward.
        assert res["launched"] == [0, n] * 6
        hidden = [1 - r[zero]["exposed_s"] / r[zero]["serial_s"] for r in results]
        print(f"\nzero {zero}: {n} buckets, serial {res['serial_s'] * 1e3:.1f} ms, exposed "
              f"{[round(r[zero]['exposed_s'] * 1e3, 2) for r in results]} ms, hidden {[round(h, 3) for h in hidden]}")
        # Not asserted here: with a real CPU backward on two shared cores the hidden fraction ranges
        # 0.2-0.99 from run to run (gloo's thread competes with backward for the CPU). The >= 70%
        # goal is asserted where backward leaves the host free, as device compute does
        # (test_reduction_is_hidden_behind_backward), and measured by bench/dp_vs_ddp.py.


class _BusyBackward(torch.autograd.Function):
    """Identity whose backward keeps the host away for `seconds`, as device compute would: the
    CPU is free meanwhile, so what overlap can hide depends on the engine alone."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import time

        time.sleep(ctx.seconds)
        return grad, None


class _SlowBackwardStack(torch.nn.Module):
    """Six 4 MiB layers whose gradients leave in their own buckets, then two small first layers
    (the last bucket, which no backward can hide). Buckets this size make the reductions long
    next to the scheduler's noise of a few milliseconds on shared cores."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(1024, 8)
        self.up = torch.nn.Linear(8, 1024)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(6))

    def forward(self, x):
        # Backward computes (sleeps) after every big layer's gradient, the first one's included,
        # so only the small last bucket's reduction can be left when backward ends.
        x = _BusyBackward.apply(self.up(self.first(x)), 0.05)
        for layer in self.layers:
            x = _BusyBackward.apply(layer(x), 0.05)
        return x.square().mean()


def _hidden_worker() -> dict:
    dist.init_process_group("gloo")
    grid = make_grid([0, 1], dist.group.WORLD)
    out = {}
    for zero in (0, 2):
        torch.manual_seed(0)
        model = _SlowBackwardStack()
        engine = DataParallel(model, grid, zero=zero, bucket_mb=4.0)
        x = torch.randn(4, 1024)
        exposed = []
        for _ in range(6):
            engine.backward(model(x))
            engine.finish()
            exposed.append(engine.exposed_comm_s())
            engine.step(1e-3, engine.grad_norm(), 1.0)
            engine.zero_grad()
        out[zero] = {"buckets": len(engine.layout.buckets), "serial_s": engine.time_serial_comm(repeats=7),
                     "exposed_s": statistics.median(exposed[1:])}
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_reduction_is_hidden_behind_backward(cache_dir):
    """Done-when of data parallelism: with >= 2 buckets at least 70% of the gradient
    communication is hidden behind backward, for all-reduce (ZeRO 0) and reduce-scatter (ZeRO 2)."""
    results = run_ranks(_hidden_worker, 2, timeout=180)
    for zero in (0, 2):
        res = results[0][zero]
        assert res["buckets"] >= 7
        hidden = 1 - res["exposed_s"] / res["serial_s"]
        print(f"\nzero {zero}: {res['buckets']} buckets, serial {res['serial_s'] * 1e3:.2f} ms, exposed "
              f"{res['exposed_s'] * 1e3:.2f} ms, hidden {hidden:.3f}")
        assert hidden >= 0.7


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
    assert torch.equal(engine.grads.flat[slot.start:slot.start + slot.numel], torch.full((slot.numel,), 3.0))


def _tp_worker(data: str) -> dict:
    dist.init_process_group("gloo")
    grid = Grid.build(RankLayout(tp=2, dp=2))
    out = {zero: train_engine(make_cfg(data, **{"parallel.tp": 2, "parallel.dp": 2, "parallel.sp": "true",
                                                "parallel.zero": zero}), grid)["losses"] for zero in (1, 3)}
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_composes_with_tensor_and_sequence_parallelism(data, reference):
    """dp 2 x tp 2 with SP: tensor-parallel shards in the buckets, partial norm gradients
    summed over tp on the owned slices, the clip norm counting every element once."""
    pytest.importorskip("threefold.distributed.tensor_parallel")
    results = run_ranks(_tp_worker, 4, data, timeout=300)
    for z in (1, 3):
        within(f"engine tp2 sp dp2 zero{z} vs reference loss", max(_max_delta(r[z], reference) for r in results),
               PARITY)
