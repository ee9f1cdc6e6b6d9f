"""One block of ring attention on SDPA's fused kernels, and the log-sum-exp merge of blocks.

A block is q rows against one kv block, either fully visible or causal on a square diagonal
(ring.block_plan). It runs through the SDPA op that also returns the rows' log-sum-exp, in the
inputs' dtype, so no score matrix is ever held:

    cpu:  aten._scaled_dot_product_flash_attention_for_cpu (and its _backward)
    cuda: aten._scaled_dot_product_flash_attention (fp16/bf16, sm80+, head dim <= 256, multiple of 8),
          else aten._scaled_dot_product_efficient_attention (fp32, older GPUs)

Backward calls the block's backward op with the FINAL output and log-sum-exp of the merged
rows (FlashAttention-2's ring form): the op's p = exp(s - lse) and delta = rowsum(dout * out)
are then those of the whole row, so each block's dq, dk, dv are its exact share of the
gradient. The CPU and flash ops take fewer kv heads than q heads (GQA) themselves; the
efficient op does not, so its kv heads are repeated and their gradients summed back.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

LSE_ALIGN = 32
"""The efficient kernel writes its lse rows padded to 32 and its backward checks that the head
and batch strides of the lse it is given are multiples of 8: a merged lse is laid out the same."""


class CpuFlash:
    """CPU's flash kernel: any dtype it supports, GQA native, any strides."""

    name = "flash_cpu"

    def forward(self, q, k, v, causal: bool):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse, ()

    def backward(self, dout, q, k, v, out, lse, causal: bool, state):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)

    def backward_lse(self, lse):
        return lse


class CudaFlash:
    """FlashAttention-2 on CUDA (fp16/bf16): GQA native; lse rows must be contiguous."""

    name = "flash"

    def forward(self, q, k, v, causal: bool):
        out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)
        return out, lse, (seed, offset)

    def backward(self, dout, q, k, v, out, lse, causal: bool, state):
        seed, offset = state
        sq, sk = q.shape[2], k.shape[2]
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, sq, sk, 0.0, causal, seed, offset
        )

    def backward_lse(self, lse):
        return lse.contiguous()


class CudaEfficient:
    """The memory-efficient kernel on CUDA (fp32 too): no GQA, so kv heads are repeated."""

    name = "efficient"

    def forward(self, q, k, v, causal: bool):
        k, v = (_repeat_heads(x, q.shape[1]) for x in (k, v))
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
        return out, lse[..., : q.shape[2]], (seed, offset)

    def backward(self, dout, q, k, v, out, lse, causal: bool, state):
        seed, offset = state
        kvh = k.shape[1]
        k, v = (_repeat_heads(x, q.shape[1]) for x in (k, v))
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal
        )
        return dq, _sum_heads(dk, kvh), _sum_heads(dv, kvh)

    def backward_lse(self, lse):
        b, h, sq = lse.shape
        padded = lse.new_empty(b, h, -(-sq // LSE_ALIGN) * LSE_ALIGN)
        padded[..., :sq].copy_(lse)
        return padded[..., :sq]


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, kvh, s, d] -> [b, heads, s, d], head j reading kv head j // (heads/kvh) (SDPA's GQA)."""
    b, kvh, s, d = x.shape
    if kvh == heads:
        return x
    return x[:, :, None].expand(b, kvh, heads // kvh, s, d).reshape(b, heads, s, d)


def _sum_heads(dx: torch.Tensor, kvh: int) -> torch.Tensor:
    b, h, s, d = dx.shape
    return dx if h == kvh else dx.view(b, kvh, h // kvh, s, d).sum(2)


def block_kernel(q: torch.Tensor):
    """The fused kernel for blocks of q's device, dtype and head dim."""
    if q.device.type == "cpu":
        return CpuFlash()
    if q.device.type == "cuda":
        hd = q.shape[-1]
        flash = (
            q.dtype in (torch.float16, torch.bfloat16)
            and hd % 8 == 0
            and hd <= 256
            and torch.cuda.get_device_capability(q.device) >= (8, 0)
        )
        return CudaFlash() if flash else CudaEfficient()
    raise ValueError(f"ring attention runs its blocks on cpu or cuda, not {q.device.type}")


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's rows into the running (out, lse) in place: the online softmax's merge,
    out <- out + sigmoid(lse_b - lse) (out_b - out), lse <- logaddexp(lse, lse_b). sigmoid is
    the block's share exp(lse_b) / (exp(lse) + exp(lse_b)), bounded however far apart the two
    are. `out` accumulates in fp32 whatever the blocks' dtype."""
    share = torch.sigmoid(block_lse - lse).unsqueeze(-1)
    out.lerp_(block_out.to(out.dtype), share)
    torch.logaddexp(lse, block_lse, out=lse)
