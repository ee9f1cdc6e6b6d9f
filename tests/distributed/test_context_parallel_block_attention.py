"""The ring's fused block attention and its log-sum-exp merge (context_parallel/block_attention.py),
in one process: every cp rank's blocks (ring.block_plan) through the fused kernel, merged and
differentiated as RingAttention does but without transport, against SDPA over the full
sequence (forward and q/k/v gradients, fp32 and bf16, MHA, GQA and MQA); the merge alone
against SDPA over the union of two blocks, however far apart their log-sum-exps; the CUDA
kernels' calls checked against torch's meta kernels (shapes and dtypes: no GPU here).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from threefold.distributed.context_parallel import shard_sequence, unshard_sequence
from threefold.distributed.context_parallel.block_attention import (
    CpuFlash,
    CudaEfficient,
    CudaFlash,
    block_kernel,
    merge_block,
)
from threefold.distributed.context_parallel.ring import block_plan

from harness import within

# fp32: max |diff|. bf16: max |diff| / max |reference| against fp32 attention of the same bf16
# inputs: bf16 keeps 2^-9 of a value (0.2%) and each of the cp blocks' outputs and gradients is
# rounded once before its fp32 sum, so a few roundings of 0.2-0.4% stay below 1%.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
BATCH, SEQ, HD = 2, 48, 16  # 48 tokens cut into 2cp chunks for cp 2, 3 and 4


def _inputs(heads: int, kv_heads: int, seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, heads, SEQ, HD, generator=g) * scale
    k, v = (torch.randn(BATCH, kv_heads, SEQ, HD, generator=g) for _ in range(2))
    return q, k, v, torch.randn(BATCH, heads, SEQ, HD, generator=g)


def ring_without_transport(q, k, v, dout, cp: int):
    """Every cp rank's ring forward (the fused block of block_plan, merged in ring order) and
    backward (each block's backward kernel with the rank's FINAL output and lse; dk/dv summed
    where the ring's accumulators would carry them), in one process: (out, dq, dk, dv) in the
    full sequence's order."""
    kernel = block_kernel(q)
    c = q.shape[2] // (2 * cp)
    qs, ks, vs, ds = ([shard_sequence(x, 2, cp, r) for r in range(cp)] for x in (q, k, v, dout))
    outs, lses = [], []
    for i in range(cp):
        out = lse = None
        for t in range(cp):
            j = (i - t) % cp
            rows, cols, causal = block_plan(i, j, c)
            block_out, block_lse, _ = kernel.forward(qs[i][:, :, rows], ks[j][:, :, cols], vs[j][:, :, cols], causal)
            if t == 0:
                out, lse = block_out.to(torch.float32), block_lse
            else:
                merge_block(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        outs.append(out.to(q.dtype))
        lses.append(lse)
    grads = [[torch.zeros(x.shape, dtype=torch.float32) for x in xs] for xs in (qs, ks, vs)]
    for i in range(cp):
        for j in range(cp):
            rows, cols, causal = block_plan(i, j, c)
            dq, dk, dv = kernel.backward(
                ds[i][:, :, rows],
                qs[i][:, :, rows],
                ks[j][:, :, cols],
                vs[j][:, :, cols],
                outs[i][:, :, rows],
                kernel.backward_lse(lses[i][:, :, rows]),
                causal,
                (),
            )
            assert dq.dtype == dk.dtype == q.dtype  # the kernel ran in the inputs' dtype
            grads[0][i][:, :, rows] += dq
            grads[1][j][:, :, cols] += dk
            grads[2][j][:, :, cols] += dv
    return tuple(unshard_sequence(parts, 2, cp) for parts in (outs, *grads))


def _reference(q, k, v, dout):
    """fp32 causal SDPA over the whole sequence: out, dq, dk, dv."""
    ref = [x.float().clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=ref[0].shape[1] != ref[1].shape[1])
    out.backward(dout.float())
    return out.detach(), *(x.grad for x in ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_blocks_match_full_sequence_attention(cp, heads, kv_heads, dtype):
    q, k, v, dout = (x.to(dtype) for x in _inputs(heads, kv_heads, seed=cp * 10 + kv_heads))
    got = ring_without_transport(q, k, v, dout, cp)
    want = _reference(q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, name
        scale = 1.0 if dtype == torch.float32 else b.abs().max().item()
        within(f"cp{cp} h{heads} kv{kv_heads} {dtype} {name}", (a.float() - b).abs().max().item() / scale, TOL[dtype])


@pytest.mark.parametrize("gap", [0.0, 30.0, 200.0, -200.0])
def test_merge_is_the_softmax_over_both_blocks(gap):
    """Two blocks of columns merged by merge_block equal SDPA over their union (fp32), also when
    every score of the second block is raised by `gap` (its lse by as much; exp(200) overflows
    fp32): the merge weighs by a sigmoid of the lse difference, never by exp of an lse."""
    q, k, v, _ = _inputs(4, 4, seed=5)
    kernel = CpuFlash()
    first, second = slice(0, SEQ // 2), slice(SEQ // 2, SEQ)
    out, lse, _ = kernel.forward(q, k[:, :, first], v[:, :, first], False)
    out_b, lse_b, _ = kernel.forward(q, k[:, :, second], v[:, :, second], False)
    out = out.clone()
    merge_block(out, lse, out_b, lse_b + gap)
    bias = torch.zeros(SEQ)
    bias[second] = gap
    q, k, v, bias = (x.double() for x in (q, k, v, bias))  # a reference whose scores + 200 keep their digits
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.expand(SEQ, SEQ))
    want_lse = torch.logsumexp(q @ k.transpose(-1, -2) / HD**0.5 + bias, dim=-1)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    within(f"merge gap {gap} out", (out - want).abs().max().item(), 1e-5)
    within(f"merge gap {gap} lse", ((lse - want_lse).abs() / want_lse.abs().clamp_min(1)).max().item(), 1e-6)


@pytest.mark.parametrize("kernel", [CudaFlash(), CudaEfficient()], ids=lambda k: k.name)
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_kernel_calls_fit_the_ops(kernel, causal):
    """The CUDA kernels' forward and backward calls, on meta tensors (torch's shape functions
    of the same ops, with their argument checks): out like q, lse [b, heads, rows] fp32, and
    gradients shaped like q, k and v, with fewer kv heads than q heads (GQA)."""
    b, heads, kvh, sq, d = 2, 8, 2, 40, 64
    dtype = torch.bfloat16 if kernel.name == "flash" else torch.float32
    q = torch.empty(b, heads, sq, d, dtype=dtype, device="meta")
    k, v = (torch.empty(b, kvh, sq if causal else 2 * sq, d, dtype=dtype, device="meta") for _ in range(2))
    out, lse, state = kernel.forward(q, k, v, causal)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (b, heads, sq) and lse.dtype == torch.float32
    lse = kernel.backward_lse(lse)
    assert lse.shape == (b, heads, sq) and lse.stride(1) % 8 == 0
    dq, dk, dv = kernel.backward(out, q, k, v, out, lse, causal, state)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == dtype


def test_kernel_by_device():
    assert isinstance(block_kernel(torch.zeros(1, 1, 2, 4)), CpuFlash)
    with pytest.raises(ValueError, match=r"^ring attention runs its blocks on cpu or cuda, not meta$"):
        block_kernel(torch.zeros(1, 1, 2, 4, device="meta"))
