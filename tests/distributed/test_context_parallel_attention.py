"""Context-parallel attention (threefold.distributed.context_parallel) against unsharded causal
SDPA: forward rows and q/k/v gradients at 1e-5 (fp32) for cp 2 and 4, ring and a2a, with and
without GQA; the ring's bf16 blocks run on SDPA's fused kernel in bf16 (no matmul of their own);
the bytes each rank records in group.stats equal analytic_bytes exactly; the load-balanced
layout and the one-line refusals need no processes.

Each world size spawns once (module fixture) and runs every case; the tests assert on results.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

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

# fp32: max |diff|. bf16: max |diff| / max |reference|; the ring (bf16 blocks, fp32 merge and
# accumulators) against fp32 attention of the same bf16 inputs (bf16 keeps 2^-9 of a value, 0.2%,
# and each block's output and gradients are rounded once), a2a against bf16 SDPA over the whole
# sequence (the same kernel on the same heads).
TOL = {"fp32": 1e-5, "bf16": 1e-2}
BATCH, SEQ, HD = 2, 32, 8


MATMULS = {"aten.mm", "aten.bmm", "aten.matmul", "aten.addmm", "aten.baddbmm"}
FUSED = {
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward",
}


class OpDtypes(TorchDispatchMode):
    """The aten ops run below autograd, each with the dtypes of its floating tensor arguments."""

    def __enter__(self):
        self.seen = set()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        dtypes = {str(a.dtype) for a in tensors if a.is_floating_point()}
        self.seen.add((f"aten.{func._schema.name.split('::')[-1]}", tuple(sorted(dtypes))))
        return func(*args, **kwargs)


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
        with OpDtypes() as ops:
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
                "ops": ops.seen,
            }
        )
    q, k, v, _ = _inputs(4, 2, seed=0)
    before = group.stats.snapshot()
    overlap = measure_overlap(*(shard_sequence(x, 2, cp, rank) for x in (q, k, v)), group, repeats=1)
    unchanged = group.stats.snapshot() == before
    shutdown_distributed()
    return {
        "cases": results,
        "overlap": (overlap.compute_s, overlap.wait_s, overlap.alone_s, overlap.hidden),
        "stats_kept": unchanged,
    }


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


def test_ring_blocks_run_on_the_fused_kernel_in_the_runs_dtype(spawned):
    """Every ring block is one call of SDPA's fused CPU kernel (forward and backward) in the
    inputs' dtype, bf16 included, and the ring runs no matmul of its own (today's fp32 block
    products did)."""
    cp, ranks = spawned
    for n, (impl, heads, kv_heads, dtype) in enumerate(cases(cp)):
        if impl != "ring":
            continue
        want = "torch.bfloat16" if dtype == "bf16" else "torch.float32"
        for r in _case(ranks, n):
            names = {name for name, _ in r["ops"]}
            assert not names & MATMULS, (impl, heads, kv_heads, dtype, names & MATMULS)
            fused = {(name, dts) for name, dts in r["ops"] if name in FUSED}
            assert {name for name, _ in fused} == FUSED, names
            assert all(want in dts for _, dts in fused), fused  # q, k, v in the run's dtype


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
    """Every (rank, block) pair's fused call covers exactly the query-key pairs causal attention
    keeps, each once: a causal call is square (the kernel's causal mask is the plain lower
    triangle only there)."""
    seq = 4 * cp
    c = seq // (2 * cp)
    for i in range(cp):
        rows = local_indices(seq, cp, i)
        for j in range(cp):
            cols = local_indices(seq, cp, j)
            keep = rows[:, None] >= cols[None, :]
            count = torch.zeros(keep.shape, dtype=torch.long)
            r, k, causal = block_plan(i, j, c)
            part = torch.ones(2 * c, 2 * c, dtype=torch.long)[r, k]
            count[r, k] += part.tril() if causal else part
            assert torch.equal(count, keep.long()), (i, j)
            if causal:
                assert r == k


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
