"""What a layer's kernels cost beyond its FLOPs at peak: small GEMMs and memory-bound work.

Two effects make achieved throughput depend on the model's shape rather than being one
constant of the device:

- A GEMM runs below its large-shape rate when one of its sides is small (too few tiles to fill
  the machine, too little reuse per byte). The planner uses a saturating curve in the GEMM's
  smallest dimension n: efficiency(n) = compute_efficiency * n / (n + gemm_half_dim), so the
  time at peak is multiplied by 1 + gemm_half_dim / n. A layer's factor is the FLOP-weighted
  mean over its GEMMs, each taken per tensor-parallel shard (tp splits one side of each).
- Norms, residual adds, rotary embeddings, the activation function and the softmax read and
  write activations and do little arithmetic: bytes moved / elementwise_bw_gbps, not FLOPs.

Both are per token, so they scale with the micro-batch and the model's width the way the GEMMs
do not (a GEMM is h^2 per token, element-wise work h).
"""

from __future__ import annotations

BACKWARD_TRAFFIC = 2.0  # a backward reads the forward's inputs and the incoming gradient, writes one


def _dims(cfg, tokens: int, t: int) -> list[tuple[float, float]]:
    """(forward FLOPs per token, smallest side) of each GEMM of one dense layer on a TP rank."""
    h, f, s = cfg.hidden, cfg.ffn_hidden, cfg.seq_len
    head_dim = h // cfg.heads
    kvd = head_dim * (getattr(cfg, "kv_heads", 0) or cfg.heads)
    mats = 3 if cfg.arch == "llama" else 2
    return [
        (2 * h * (h + 2 * kvd) / t, min(tokens, h, (h + 2 * kvd) / t)),  # q, k, v projections (column-parallel)
        (2 * h * h / t, min(tokens, h / t, h)),  # output projection (row-parallel)
        (2 * mats * h * f / t, min(tokens, h, f / t)),  # MLP matrices
        (2 * s * h / t, min(s, head_dim)),  # causal attention: QK^T and PV over half the keys, per head
    ]


def gemm_factor(cfg, tokens: int, t: int, half_dim: float) -> float:
    """FLOP-weighted mean of 1 + half_dim / n over one layer's GEMMs (n: each one's smallest
    side), for `tokens` tokens per micro-batch on one of `t` TP ranks; 1 when half_dim is 0."""
    if half_dim <= 0:
        return 1.0
    dims = _dims(cfg, tokens, t)
    total = sum(fl for fl, _ in dims)
    return sum(fl * (1.0 + half_dim / max(n, 1.0)) for fl, n in dims) / total


def head_factor(cfg, tokens: int, t: int, half_dim: float) -> float:
    """The vocabulary head's GEMM, tokens x hidden x vocab/tp."""
    if half_dim <= 0:
        return 1.0
    return 1.0 + half_dim / max(1.0, min(tokens, cfg.hidden, cfg.vocab / t))


def elementwise_bytes(cfg, t: int, act: int, sp: bool = False, fused_attention: bool = False) -> float:
    """Bytes one TP rank's memory-bound work moves per token of one layer, forward and backward.

    Forward, in elements per token: two norms (read and write h each), two residual adds (read
    2h, write h), rotary embedding of q and k (llama), the attention probabilities (heads x s/2
    keys, written and read: what a non-fused softmax moves) and the activation function (SwiGLU
    reads gate and up, writes one; GELU reads and writes f). The norms and residuals act on the
    whole hidden state unless sequence parallelism splits it; the rest is split over tp. A fused
    attention kernel (flash attention on GPUs) keeps the probabilities on chip: none of them move."""
    h, f, s = cfg.hidden, cfg.ffn_hidden, cfg.seq_len
    head_dim = h // cfg.heads
    kvd = head_dim * (getattr(cfg, "kv_heads", 0) or cfg.heads)
    replicated = (4 * h + 6 * h) / (t if sp else 1)
    rope = 2 * (h + kvd) if cfg.arch == "llama" else 0
    act_fn = 3 * f if cfg.arch == "llama" else 2 * f
    split = (rope + (0 if fused_attention else cfg.heads * s) + act_fn) / t
    return (1.0 + BACKWARD_TRAFFIC) * (replicated + split) * act
