"""Context-parallel attention (threefold.distributed.context_parallel) against unsharded causal
SDPA: forward rows and q/k/v gradients at 1e-5 (fp32) for cp 2 and 4, ring and a2a, with and
without GQA; the bytes each rank records in group.stats equal analytic_bytes exactly; the
load-balanced layout and the one-line refusals need no processes.

Each world size spawns once (module fixture) and runs every case; the tests assert on results.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from threefold.distributed.comm import Group
from threefold.distributed.context_parallel import (
    RingTiming,
    analytic_bytes,
    context_parallel_attention,
    gathered_order,
    local_indices,
    measure_overlap,
    shard_sequence,
    unshard_sequence,
)
from threefold.distributed.context_parallel.overlap import exposed_after_peers
from threefold.distributed.context_parallel.ring import block_plan
from threefold.errors import ConfigError

from harness import run_ranks, within

# fp32: max |diff|. bf16: max |diff| / max |reference|; the ring (fp32 inside) against fp32
# attention of the same bf16 inputs (bf16 keeps 2^-9 of a value, 0.2%), a2a against bf16 SDPA
# over the whole sequence (the same kernel on the same heads).
TOL = {"fp32": 1e-5, "bf16": 1e-2}
BATCH, SEQ, HD = 2, 32, 8


def cases(cp: int) -> list[tuple[str, int, int, str]]:
    """(impl, heads, kv_heads, dtype): MHA and GQA for both in fp32, one bf16 case each (the
    ring's gradient accumulators travel in fp32); a2a's GQA needs kv heads divisible by cp."""
    gqa_a2a = (4, 2) if 2 % cp == 0 else (8, 4)
    fp32 = [("ring", 4, 4), ("ring", 4, 2), ("a2a", 4, 4), ("a2a", *gqa_a2a)]
    return [(*c, "fp32") for c in fp32] + [("ring", 4, 2, "bf16"), ("a2a", 4, 4, "bf16")]


def _inputs(heads: int, kv_heads: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, heads, SEQ, HD, generator=g)
    k, v = (torch.randn(BATCH, kv_heads, SEQ, HD, generator=g) for _ in range(2))
    return q, k, v, torch.randn(BATCH, heads, SEQ, HD, generator=g)  # the last: d loss / d out


def _attention_worker(cases: list) -> dict:
    from threefold.distributed import comm
    from threefold.distributed.runtime import init_distributed, shutdown_distributed

    init_distributed(torch.device("cpu"), timeout_s=60)
    cp = comm.world_size()
    group = Group("cp", list(range(cp)), comm.world_handle(), device=torch.device("cpu"), span_category="cp_comm")
    rank = group.rank
    results = []
    for n, (impl, heads, kv_heads, dtype) in enumerate(cases):
        q, k, v, w = _inputs(heads, kv_heads, seed=n)
        if dtype == "bf16":
            q, k, v = (x.bfloat16() for x in (q, k, v))
        ref_dtype = torch.bfloat16 if (dtype, impl) == ("bf16", "a2a") else torch.float32
        ref = [x.to(ref_dtype).clone().requires_grad_() for x in (q, k, v)]
        out_ref = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=heads != kv_heads)
        (out_ref * w).sum().backward()
        mine = [shard_sequence(x, 2, cp, rank).requires_grad_() for x in (q, k, v)]
        timing = RingTiming() if impl == "ring" else None
        group.stats.reset()
        group.p2p_log = []  # what a traced step's replay would post again
        out = context_parallel_attention(*mine, group, impl, timing=timing)
        forward = group.stats.total_bytes
        (out * shard_sequence(w, 2, cp, rank)).sum().backward()
        log, group.p2p_log = group.p2p_log, None
        logged = [sum(math.prod(shape) * dt.itemsize for kind, shape, dt, _ in b.ops if kind == "send") for b in log]
        stamped = all(b.posted <= b.waited <= b.done for b in log)  # every batch posted, then waited on
        waited = sum(b.done - b.waited for b in log)
        own = exposed_after_peers(log, group)

        def diff(got, want, dtype=dtype):
            want = shard_sequence(want.float(), 2, cp, rank)
            scale = 1.0 if dtype == "fp32" else want.abs().max().item()
            return (got.float() - want).abs().max().item() / scale

        diffs = {"out": diff(out, out_ref)}
        for name, a, b in zip("qkv", mine, ref):
            assert a.grad.dtype == a.dtype
            diffs["d" + name] = diff(a.grad, b.grad)
        results.append(
            {
                "case": (impl, heads, kv_heads, dtype),
                "diffs": diffs,
                "bytes": (forward, group.stats.total_bytes - forward),
                "logged": logged,
                "stamped": stamped,
                "own_within_waits": 0 <= own <= waited,
                "timing": None if timing is None else (timing.compute_s, timing.wait_s, timing.transfers),
            }
        )
    chunked = _chunked_ring(group)
    q, k, v, _ = _inputs(4, 2, seed=0)
    before = group.stats.snapshot()
    overlap = measure_overlap(*(shard_sequence(x, 2, cp, rank) for x in (q, k, v)), group, repeats=1)
    unchanged = group.stats.snapshot() == before
    shutdown_distributed()
    return {
        "cases": results,
        "overlap": (overlap.compute_s, overlap.wait_s, overlap.alone_s, overlap.hidden),
        "stats_kept": unchanged,
        "chunked": chunked,
    }


def _chunked_ring(group) -> dict:
    """The ring with row chunks of a few rows (BLOCK_ELEMENTS tiny) against unsharded SDPA:
    max |diff| of the output and q/k/v gradients, fp32, GQA."""
    from threefold.distributed.context_parallel import ring

    cp, rank = group.size, group.rank
    q, k, v, w = _inputs(4, 2, seed=7)
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    out_ref = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    (out_ref * w).sum().backward()
    mine = [shard_sequence(x, 2, cp, rank).requires_grad_() for x in (q, k, v)]
    saved = ring.BLOCK_ELEMENTS, ring.MIN_ROWS
    ring.BLOCK_ELEMENTS, ring.MIN_ROWS = 3 * BATCH * 4 * SEQ // cp, 1  # ~3 rows of a product
    try:
        out = context_parallel_attention(*mine, group, "ring")
        (out * shard_sequence(w, 2, cp, rank)).sum().backward()
    finally:
        ring.BLOCK_ELEMENTS, ring.MIN_ROWS = saved
    pairs = [("out", out, out_ref)] + [("d" + n, a.grad, b.grad) for n, a, b in zip("qkv", mine, ref)]
    return {name: (got - shard_sequence(want, 2, cp, rank)).abs().max().item() for name, got, want in pairs}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda cp: f"cp{cp}")
def spawned(request):
    cp = request.param
    return cp, run_ranks(_attention_worker, cp, cases(cp), timeout=120)


def _case(ranks: list[dict], n: int) -> list[dict]:
    return [r["cases"][n] for r in ranks]


def test_matches_unsharded_attention_and_gradients(spawned):
    cp, ranks = spawned
    for n, (impl, heads, kv_heads, dtype) in enumerate(cases(cp)):
        for name in ("out", "dq", "dk", "dv"):
            worst = max(r["diffs"][name] for r in _case(ranks, n))
            within(f"cp{cp} {impl} heads {heads} kv {kv_heads} {dtype} {name} diff", worst, TOL[dtype])


def test_bytes_equal_analytic(spawned):
    cp, ranks = spawned
    for n, (impl, heads, kv_heads, dtype) in enumerate(cases(cp)):
        expected = analytic_bytes(impl, BATCH, heads, kv_heads, SEQ, HD, cp, 2 if dtype == "bf16" else 4)
        for r in _case(ranks, n):
            assert r["bytes"] == (expected.forward, expected.backward), (impl, heads, kv_heads, r["bytes"])
            # The p2p log that traced steps replay holds the ring's exchanges, every byte of them.
            assert sum(r["logged"]) == (expected.total if impl == "ring" else 0)
            assert len(r["logged"]) == (3 * cp - 2 if impl == "ring" else 0)
            assert r["stamped"] and r["own_within_waits"]


def test_ring_records_compute_and_waits(spawned):
    cp, ranks = spawned
    for n, (impl, *_) in enumerate(cases(cp)):
        if impl != "ring":
            continue
        for r in _case(ranks, n):
            compute, wait, transfers = r["timing"]
            # forward waits cp-1 blocks; backward cp-1 blocks and cp gradient accumulators
            assert transfers == 3 * cp - 2 and compute > 0 and wait >= 0


def test_overlap_measurement(spawned):
    """measure_overlap reports compute, exposed wait and transfer-alone time, and leaves the
    group's accounting untouched (it is not the run's traffic)."""
    _, ranks = spawned
    for r in ranks:
        compute, wait, alone, hidden = r["overlap"]
        assert r["stats_kept"] and compute > 0 and alone > 0 and wait >= 0
        assert hidden == max(0.0, min(1.0, 1 - wait / alone))


def test_one_rank_is_plain_causal_attention():
    q, k, v, _ = _inputs(4, 2, seed=3)
    out = context_parallel_attention(q, k, v, Group("cp", [0], None), "ring")
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_layout_round_trip_and_balance(cp):
    seq = 24 if cp == 3 else 16
    x = torch.arange(seq)
    parts = [shard_sequence(x, 0, cp, r) for r in range(cp)]
    for r, part in enumerate(parts):
        assert torch.equal(part, local_indices(seq, cp, r))  # the positions are the tokens here
    assert torch.equal(unshard_sequence(parts, 0, cp), x)
    assert torch.equal(gathered_order(seq, cp), torch.cat(parts))
    c = seq // (2 * cp)
    assert torch.equal(parts[0][:c], torch.arange(c)) and torch.equal(parts[0][c:], torch.arange(seq - c, seq))
    # causal work (visible query-key pairs) is the same on every rank
    work = [sum(int(p) + 1 for p in part) for part in parts]
    assert len(set(work)) == 1, work


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_block_plan_is_the_causal_mask(cp):
    """Every (rank, block) pair's products cover exactly the query-key pairs causal attention
    keeps, each once."""
    seq = 4 * cp
    c = seq // (2 * cp)
    for i in range(cp):
        rows = local_indices(seq, cp, i)
        for j in range(cp):
            cols = local_indices(seq, cp, j)
            keep = rows[:, None] >= cols[None, :]
            count = torch.zeros(keep.shape, dtype=torch.long)
            for r, k, diagonal in block_plan(i, j, c):
                part = torch.ones(2 * c, 2 * c, dtype=torch.long)[r, k]
                count[r, k] += part if diagonal is None else part.tril(diagonal)
            assert torch.equal(count, keep.long()), (i, j)


def test_ring_in_row_chunks_matches_unsharded(spawned):
    """Products split into row chunks of ~3 rows give the same rows and gradients (1e-5)."""
    cp, ranks = spawned
    for name in ("out", "dq", "dk", "dv"):
        within(f"cp{cp} chunked ring {name} diff", max(r["chunked"][name] for r in ranks), TOL["fp32"])


@pytest.mark.parametrize("limit", [1, 40, 100, 1 << 20])
def test_row_chunks_cover_each_product_once(limit, monkeypatch):
    """Row chunks of every block_plan product cover exactly the product's causal pairs, each once,
    and hold at most BLOCK_ELEMENTS scores (MIN_ROWS rows at the least: 1 here, 64 by default)."""
    from threefold.distributed.context_parallel import ring

    monkeypatch.setattr(ring, "BLOCK_ELEMENTS", limit)
    monkeypatch.setattr(ring, "MIN_ROWS", 1)
    cp, c, width = 4, 6, 2
    for i in range(cp):
        for j in range(cp):
            for rows, cols, diagonal in block_plan(i, j, c):
                n_cols = cols.stop - cols.start
                want = torch.zeros(2 * c, n_cols, dtype=torch.long)
                part = torch.ones(rows.stop - rows.start, n_cols, dtype=torch.long)
                want[rows] = part if diagonal is None else part.tril(diagonal)
                got = torch.zeros_like(want)
                for sub, seen, diag in ring.row_chunks(rows, n_cols, diagonal, width):
                    ones = torch.ones(sub.stop - sub.start, seen, dtype=torch.long)
                    got[sub, :seen] += ones if diag is None else ones.tril(diag)
                    assert (sub.stop - sub.start) == 1 or (sub.stop - sub.start) * n_cols * width <= limit
                assert torch.equal(got, want), (i, j, rows, limit)
    monkeypatch.setattr(ring, "MIN_ROWS", 4)
    monkeypatch.setattr(ring, "BLOCK_ELEMENTS", 1)
    assert [r for r, _, _ in ring.row_chunks(slice(0, 12), 12, None, 2)] == [slice(0, 4), slice(4, 8), slice(8, 12)]


def test_sequence_not_divisible_is_refused():
    with pytest.raises(ConfigError, match=r"^parallel\.cp: sequence length 30 is not divisible by 2\*cp = 4") as err:
        local_indices(30, 2, 0)
    assert "\n" not in str(err.value) and "multiple of 4" in str(err.value)
    q = torch.zeros(1, 2, 5, 4)  # 5 local rows cannot be two equal chunks
    with pytest.raises(ConfigError, match=r"^parallel\.cp: sequence length 10 is not divisible by 2\*cp = 4"):
        context_parallel_attention(q, q, q, Group("cp", [0, 1], None), "ring")


def test_a2a_heads_not_divisible_is_refused():
    q, kv = torch.zeros(1, 4, 8, 4), torch.zeros(1, 2, 8, 4)
    with pytest.raises(
        ConfigError, match=r"^parallel\.cp_impl: .*kv_heads 2 \(after tp\) is not divisible by cp 4"
    ) as err:
        context_parallel_attention(q, kv, kv, Group("cp", [0, 1, 2, 3], None), "a2a")
    assert "\n" not in str(err.value) and "valid: ring" in str(err.value)
    with pytest.raises(ConfigError, match=r"^parallel\.cp_impl: unknown attention 'zigzag'"):
        context_parallel_attention(q, kv, kv, Group("cp", [0, 1], None), "zigzag")


@pytest.mark.parametrize("impl", ["ring", "a2a"])
def test_analytic_bytes_formula(impl):
    b, h, kv, s, d, cp = 2, 8, 2, 64, 16, 4
    got = analytic_bytes(impl, b, h, kv, s, d, cp, 2)
    local = b * (s // cp) * d
    if impl == "ring":
        assert got == ((cp - 1) * 2 * kv * local * 2, (cp - 1) * 2 * kv * local * 2 + cp * 2 * kv * local * 4)
    else:
        assert got.forward == got.backward == (h + 2 * kv + h) * local * 2
    assert analytic_bytes(impl, b, h, kv, s, d, 1, 2).total == 0
