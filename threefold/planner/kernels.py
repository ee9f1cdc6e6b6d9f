"""What a layer's kernels cost beyond its FLOPs at peak: GEMM shapes, attention, memory-bound work.

Achieved throughput depends on the model's shape, not only on the device:

- **GEMMs** (`gemm_factor`). A GEMM's time at `compute_efficiency` of peak is multiplied by
    waves(m, n) * (1 + gemm_half_dim / min(m, n, k))
  `waves` is wave quantization on a GPU: the output is cut into TILE x TILE tiles, one per SM
  at a time, and the last wave runs part-empty (ceil(tiles / sm_count) * sm_count / tiles; 1
  without `sm_count`, cpu). The second factor is the saturating curve of a small side (too
  little reuse per byte, too short a k loop to fill the pipeline). `compute_efficiency` is the
  large-shape rate: an 8192^3 bf16 GEMM through PyTorch on an H200 runs at 769-798 TFLOP/s,
  78-81% of the 989 datasheet peak (issue 36's measurement), which these factors put at 0.82
  for the profile. Each GEMM is taken per tensor-parallel shard; backward's two GEMMs of a
  forward one are charged its factor (the same three sizes, permuted).
- **Attention** (`attention_factor`). Unfused, `attention_scores` says whether the kernels skip
  the masked half (causal) or compute every score of the s x s square and mask it in the softmax
  (square: Megatron-LM's baddbmm and scaled masked softmax, twice the FLOPs and probabilities).
  Unfused, `attention_dropout` adds dropout's own pass over the probabilities
  (`attention_dropout_bytes`), and selective recompute reruns the softmax and the dropout with
  the attention core's GEMMs (`rerun_attention_bytes`).
  A fused kernel (flash attention) has a rate of its own:
  `attention_efficiency` of peak at head dim 128 and long sequences, times s / (s +
  attention_half_seq) (short sequences do not fill the SMs with query tiles) and
  hd (128 + 16) / (128 (hd + 16)) (a head dim of 64 halves the work per loaded tile; FlashAttention-2's
  H100 figures run hd 64 about a tenth below hd 128). Without `attention_efficiency` (cpu) the
  attention core is a GEMM of smallest side min(s, head_dim) like the others.
- **Memory-bound work** (`elementwise_bytes`): norms, residual adds, rotary embeddings, the
  activation function and, unfused, the softmax read and write activations and do little
  arithmetic: bytes moved / elementwise_bw_gbps, not FLOPs (about 4.3 TB/s device to device on
  an H200 through PyTorch, counting bytes read and written). Backward also sums each bias's
  gradient over the tokens (a read of the biased outputs' gradients). Beside the layers, the
  loss streams every logit several times (`LOSS_BYTES_PER_LOGIT`), and each micro-batch's
  weight gradients are added into the fp32 gradient buffers unless the weight-gradient GEMM
  accumulates into them itself (`accumulation_bytes`; cluster.grad_accumulation). A profile of
  gpt-1.3b on one H200 (bench/gpu.py's breakdown) found these three at about a third of the
  step's memory-bound time.

The factors are per token, so they scale with micro-batch and width the way the GEMMs do not.
"""

from __future__ import annotations

import math

# torch's fused AdamW in fp32: parameter, gradient and both moments read, three written back.
ADAM_BYTES_PER_ELEMENT = 28.0
# threefold's chunked cross-entropy (model/loss.py) per logit: forward reads the bf16 logits
# twice into fp32 chunks (max, then shifted exp and sum: 36 bytes), backward recomputes the
# softmax and writes the bf16 gradient (44 bytes).
LOSS_BYTES_PER_LOGIT = 80.0
BACKWARD_TRAFFIC = 2.0  # a backward reads the forward's inputs and the incoming gradient, writes one
# torch's dropout keeps a 1-byte mask an element: Korthikanti et al. 2022 (arXiv 2205.05198) §4.1
# count the attention dropout's mask at a s^2 b bytes beside the 2 a s^2 b of the probabilities.
DROPOUT_MASK_BYTES = 1.0
TILE = 128  # output tile side of the large-shape GEMM kernels (cuBLAS/CUTLASS on Ampere and Hopper)
HEAD_DIM_HALF = 16.0  # attention: head dim at which a loaded tile's work would halve (relative to 128)


def layer_gemms(cfg, tokens: int, t: int) -> list[tuple[float, tuple[float, float, float]]]:
    """(forward FLOPs per token, (m, n, k)) of each GEMM of one dense layer on a TP rank."""
    h, f = cfg.hidden, cfg.ffn_hidden
    head_dim = h // cfg.heads
    kvd = head_dim * (getattr(cfg, "kv_heads", 0) or cfg.heads)
    mats = 3 if cfg.arch == "llama" else 2
    qkv = (h + 2 * kvd) / t
    return [
        (2 * h * qkv, (tokens, qkv, h)),  # q, k, v projections (column-parallel)
        (2 * h * h / t, (tokens, h, h / t)),  # output projection (row-parallel)
        (2 * (mats - 1) * h * f / t, (tokens, (mats - 1) * f / t, h)),  # MLP up (and gate), column-parallel
        (2 * h * f / t, (tokens, h, f / t)),  # MLP down, row-parallel
    ]


def attention_flops(cfg, t: int) -> float:
    """Forward FLOPs per token of the causal attention core on a TP rank: QK^T and PV over half the keys."""
    return 2 * cfg.seq_len * cfg.hidden / t


def shape_factor(m: float, n: float, k: float, cluster) -> float:
    """Time of an (m x k) @ (k x n) GEMM over its FLOPs at compute_efficiency of peak."""
    factor = 1.0
    if cluster.sm_count > 0:
        tiles = math.ceil(m / TILE) * math.ceil(n / TILE)
        factor = math.ceil(tiles / cluster.sm_count) * cluster.sm_count / tiles
    if cluster.gemm_half_dim > 0:
        factor *= 1.0 + cluster.gemm_half_dim / max(1.0, min(m, n, k))
    return factor


def attention_factor(cfg, cluster) -> float:
    """Time of the attention core over its FLOPs at compute_efficiency of peak."""
    s, head_dim = cfg.seq_len, cfg.hidden // cfg.heads
    if cluster.attention_efficiency <= 0:
        # The square computes every score, twice the causal half's FLOPs at the same rate.
        square = 2.0 if cluster.attention_scores == "square" else 1.0
        small_side = 1.0 + cluster.gemm_half_dim / max(1.0, min(s, head_dim)) if cluster.gemm_half_dim > 0 else 1.0
        return square * small_side
    by_seq = s / (s + cluster.attention_half_seq)
    by_head = head_dim * (128 + HEAD_DIM_HALF) / (128 * (head_dim + HEAD_DIM_HALF))
    return cluster.compute_efficiency / (cluster.attention_efficiency * by_seq * by_head)


def gemm_factor(cfg, tokens: int, t: int, cluster) -> float:
    """FLOP-weighted mean time factor of one layer's GEMMs and attention core, for `tokens`
    tokens per micro-batch on one of `t` TP ranks."""
    parts = [(fl, shape_factor(*mnk, cluster)) for fl, mnk in layer_gemms(cfg, tokens, t)]
    parts.append((attention_flops(cfg, t), attention_factor(cfg, cluster)))
    return sum(fl * x for fl, x in parts) / sum(fl for fl, _ in parts)


def head_factor(cfg, tokens: int, t: int, cluster) -> float:
    """The vocabulary head's GEMM, tokens x hidden x vocab/tp."""
    return shape_factor(tokens, cfg.vocab / t, cfg.hidden, cluster)


def region_gemm_seconds(cfg, tokens: int, t: int, cluster) -> dict[str, tuple[float, float]]:
    """Per tensor-parallel region ("attention", "mlp"), one micro-batch's (entry projection's
    GEMM, the region's forward GEMMs) seconds on a TP rank: the first is the window that hides
    backward's dX collective (behind dW) and SP's re-gather (behind dX), each the forward
    GEMM's size; the second what pipelined forward collectives can hide behind."""
    rate = cluster.peak_flops * cluster.compute_efficiency / tokens

    def took(flops: float, mnk) -> float:
        return flops * shape_factor(*mnk, cluster) / rate

    qkv, out, up, down = (took(fl, mnk) for fl, mnk in layer_gemms(cfg, tokens, t))
    return {"attention": (qkv, qkv + out), "mlp": (up, up + down)}


def bias_grad_elements(cfg, t: int) -> float:
    """Elements per token one TP rank reads to sum its biases' gradients over the tokens: q/k/v
    (column-parallel) on gpt2 and on llama with qkv_bias; gpt2's output projection and MLP
    (the row-parallel ones' biases are whole on every rank)."""
    head_dim = cfg.hidden // cfg.heads
    kvd = head_dim * (getattr(cfg, "kv_heads", 0) or cfg.heads)
    qkv = (cfg.hidden + 2 * kvd) / t
    if cfg.arch != "gpt2":
        return qkv if getattr(cfg, "qkv_bias", False) else 0.0
    return qkv + cfg.hidden + cfg.ffn_hidden / t + cfg.hidden


def accumulation_bytes(numel: float, act: int, cluster) -> float:
    """One micro-batch's weight gradients added into their buffers: the new gradient read (act
    bytes), the buffer read and written (fp32 main gradients, or 16-bit ones under
    cluster.grad_reduce 16bit); none where the weight-gradient GEMM accumulates in place
    (cluster.grad_accumulation = fused: Megatron-LM's gradient accumulation fusion)."""
    if cluster.grad_accumulation == "fused":
        return 0.0
    buffer = 4.0 if cluster.grad_reduce == "fp32" else act
    return numel * (act + 2.0 * buffer)


def elementwise_bytes(
    cfg, t: int, act: int, sp: bool = False, fused_attention: bool = False, square: bool = False
) -> float:
    """Bytes one TP rank's streaming element-wise work moves per token of one layer, forward and
    backward (at elementwise_bw_gbps).

    Forward, in elements per token: two residual adds (read 2h, write h), rotary embedding of q
    and k (llama), the attention probabilities (heads x s/2 keys, written and read: what a
    non-fused softmax moves) and the activation function (SwiGLU reads gate and up, writes one;
    GELU reads and writes f). The residuals act on the whole hidden state unless sequence
    parallelism splits it; the rest is split over tp. A fused attention kernel (flash attention
    on GPUs) keeps the probabilities on chip: none of them move. `square` (unfused, every score
    computed, the causal mask applied inside the softmax): the softmax reads and writes all s
    keys, twice the causal half."""
    h, f = cfg.hidden, cfg.ffn_hidden
    head_dim = h // cfg.heads
    kvd = head_dim * (getattr(cfg, "kv_heads", 0) or cfg.heads)
    replicated = 6 * h / (t if sp else 1)
    rope = 2 * (h + kvd) if cfg.arch == "llama" else 0
    act_fn = 3 * f if cfg.arch == "llama" else 2 * f
    split = (rope + act_fn) / t * act + (0.0 if fused_attention else softmax_bytes(cfg, t, act, square))
    return (1.0 + BACKWARD_TRAFFIC) * (replicated * act + split)


def _scores(cfg, t: int, square: bool) -> float:
    """Attention scores one TP rank's unfused kernels hold per token: heads x keys, all s of the
    square or the causal half."""
    return cfg.heads / t * (cfg.seq_len if square else cfg.seq_len / 2)


def softmax_bytes(cfg, t: int, act: int, square: bool = False) -> float:
    """Forward bytes per token of an unfused softmax on one TP rank: the scores read and the
    probabilities written (elementwise_bytes charges backward twice that)."""
    return 2 * _scores(cfg, t, square) * act


def attention_dropout_bytes(cfg, t: int, act: int, square: bool = False) -> float:
    """Bytes per token, each way, of dropout on the unfused attention probabilities on one TP
    rank (Megatron-LM's attention_dropout, 0.1 by default): forward reads the probabilities and
    writes the dropped ones and the mask; backward reads the gradient and the mask and writes
    the gradient. A fused kernel drops on chip and moves none of them."""
    return _scores(cfg, t, square) * (2 * act + DROPOUT_MASK_BYTES)


def rerun_attention_bytes(cfg, t: int, act: int, square: bool = False, dropout: bool = False) -> float:
    """Element-wise bytes per token selective recompute moves again on one TP rank: the unfused
    attention core reruns its softmax (and dropout) with its GEMMs in backward."""
    rerun = softmax_bytes(cfg, t, act, square)
    return rerun + (attention_dropout_bytes(cfg, t, act, square) if dropout else 0.0)


def reduction_bytes(cfg, t: int, act: int, sp: bool = False, fused_attention: bool = False) -> float:
    """Bytes one TP rank's normalisation and reduction kernels move per token of one layer,
    forward and backward (at reduction_bw_gbps: they reach well below a copy's bandwidth).

    Two norms (forward reads and writes h each, backward twice that; on the whole hidden state
    unless sequence parallelism splits it), the biases' gradient sums (bias_grad_elements) and,
    with a fused attention kernel, its backward's own passes: the rowsum of dO x O (reads both)
    and the fp32 dQ accumulator converted down (3 elements' worth)."""
    norms = (1.0 + BACKWARD_TRAFFIC) * 4 * cfg.hidden / (t if sp else 1)
    attention = 5 * cfg.hidden / t if fused_attention else 0.0
    return (norms + bias_grad_elements(cfg, t) + attention) * act
