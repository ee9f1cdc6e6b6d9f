"""FLOPs and parameter counts of a dense transformer LM, from its config alone.

A multiply-add is 2 FLOPs. Only matmuls are counted: norms, activations, softmax, residual
adds, the loss and the optimizer step are a few per element and vanish next to the matmuls
at any size worth measuring (Kaplan et al. 2020, sec. 2.1; Narayanan et al. 2021, app.).
The config is duck-typed: `arch` ("llama" | "gpt2"), `hidden`, `layers`, `heads`,
`kv_heads`, `ffn_hidden`, `vocab`, `seq_len`, `tie_embeddings`, and for mixture-of-experts
models `num_experts`, `top_k`, `moe_every`, `shared_expert`. See docs/flops.md.

MoE: a token multiplies through the router (hidden x experts), its top_k experts and the
shared expert, so FLOPs (and MFU) count active parameters only; total_params counts every
expert. Experts have no biases (the shared expert is a plain MLP, biases included for gpt2).
"""

from __future__ import annotations

from threefold.config import ModelConfig

_RECOMPUTE = ("none", "selective", "full")


def _head_dim(cfg: ModelConfig) -> int:
    return cfg.hidden // cfg.heads


def _mlp_matrices(cfg: ModelConfig) -> int:
    # SwiGLU has gate, up and down; the GPT-2 MLP has in and out.
    if cfg.arch == "llama":
        return 3
    if cfg.arch == "gpt2":
        return 2
    raise ValueError(f"unknown arch {cfg.arch!r} (valid: 'llama', 'gpt2')")


def moe_layers(cfg: ModelConfig) -> int:
    """How many blocks are MoE: every moe_every-th (0 without experts)."""
    if not getattr(cfg, "num_experts", 0):
        return 0
    return cfg.layers // getattr(cfg, "moe_every", 1)


def _attention_weights(cfg: ModelConfig) -> int:
    h, hd = cfg.hidden, _head_dim(cfg)
    q = h * cfg.heads * hd
    kv = 2 * h * cfg.kv_heads * hd  # GQA: k and v are narrower than q
    o = cfg.heads * hd * h
    return q + kv + o


def _moe_mlp_weights(cfg: ModelConfig, experts: int) -> int:
    """Router + `experts` expert MLPs + the shared expert."""
    mlp = _mlp_matrices(cfg) * cfg.hidden * cfg.ffn_hidden
    return cfg.hidden * cfg.num_experts + experts * mlp + (mlp if getattr(cfg, "shared_expert", False) else 0)


def matmul_weights_per_layer(cfg: ModelConfig) -> float:
    """Weight elements one token multiplies through in one layer (attention + MLP), the mean
    over layers when some are MoE (times `layers` it is exact)."""
    if ":" in cfg.arch:  # a user model (model/custom.py): the weights of its blocks' nn.Linear modules
        from threefold.model.custom import counts

        return counts(cfg).matmul_weights_per_layer
    mlp = _mlp_matrices(cfg) * cfg.hidden * cfg.ffn_hidden
    n_moe = moe_layers(cfg)
    if not n_moe:
        return _attention_weights(cfg) + mlp
    moe = _moe_mlp_weights(cfg, cfg.top_k)
    return _attention_weights(cfg) + ((cfg.layers - n_moe) * mlp + n_moe * moe) / cfg.layers


def _s_eff(seq_len: int, causal: bool) -> float:
    # Causal: token i (1-based) attends to i keys, so the mean over a sequence of s is
    # (s + 1) / 2. Full attention: every token attends to all s keys.
    return (seq_len + 1) / 2 if causal else float(seq_len)


def attention_flops_per_token_per_layer(cfg: ModelConfig, seq_len: int | None = None, causal: bool = True) -> float:
    """Forward FLOPs of QK^T and (softmax)V for one token in one layer.

    Each is `heads` dot products of length hd against s_eff keys: 2 * heads * hd * s_eff
    FLOPs, two of them. KV heads do not matter here: GQA shares K/V, not the work.
    """
    s = cfg.seq_len if seq_len is None else seq_len
    return 2 * 2 * cfg.heads * _head_dim(cfg) * _s_eff(s, causal)


def _layer_forward(cfg: ModelConfig, seq_len: int | None, causal: bool) -> float:
    attention = attention_flops_per_token_per_layer(cfg, seq_len, causal)
    return 2 * matmul_weights_per_layer(cfg) + attention


def _head_forward(cfg: ModelConfig) -> float:
    # The logit matmul hidden x vocab is paid whether or not its weight is tied.
    return 2 * cfg.hidden * cfg.vocab


def forward_flops_per_token(cfg: ModelConfig, seq_len: int | None = None, causal: bool = True) -> float:
    """Forward FLOPs per token: 2 * (matmul weights) + attention scores/values.

    = layers * (2 * W_layer + 4 * heads * hd * s_eff) + 2 * hidden * vocab.
    The embedding lookup (and GPT-2's learned positions) is a gather, not a matmul.
    """
    return cfg.layers * _layer_forward(cfg, seq_len, causal) + _head_forward(cfg)


def train_flops_per_token(cfg: ModelConfig, seq_len: int | None = None, causal: bool = True) -> float:
    """Model FLOPs per trained token (MFU's numerator): forward + backward = 3 * forward.

    The backward of y = xW needs dx = dy W^T and dW = x^T dy, two matmuls of the forward's
    size (Kaplan et al. 2020; Narayanan et al. 2021); likewise for QK^T and softmax-V.
    """
    return 3 * forward_flops_per_token(cfg, seq_len, causal)


def hardware_flops_per_token(
    cfg: ModelConfig, seq_len: int | None = None, causal: bool = True, recompute: str = "none"
) -> float:
    """FLOPs the device actually executes per token (HFU's numerator).

    Model FLOPs plus the forward work that activation recomputation does again:
      "none":      nothing.
      "selective": the attention scores/values of every layer (Korthikanti et al. 2022
                   recompute QK^T, softmax and softmax-V, not the projections).
      "full":      one more forward of every transformer layer, but NOT of the vocab head:
                   checkpointing wraps layers, and the logits are computed once. This is
                   exactly what Megatron's 96*B*s*l*h^2*(1 + s/6h + V/16lh) counts:
                   4 passes of (24h^2 + 4sh) per layer-token and 3 passes of 2hV for the
                   logit layer (see megatron_flops_per_iteration and docs/flops.md).
    """
    if recompute not in _RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r} (valid: {', '.join(_RECOMPUTE)})")
    extra = 0.0
    if recompute == "full":
        extra = cfg.layers * _layer_forward(cfg, seq_len, causal)
    elif recompute == "selective":
        extra = cfg.layers * attention_flops_per_token_per_layer(cfg, seq_len, causal)
    return train_flops_per_token(cfg, seq_len, causal) + extra


def megatron_flops_per_iteration(batch: int, seq_len: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. 2021 (eq. 3): FLOPs of one iteration of a GPT with a 4h MLP,
    full (non-causal) attention and full activation recomputation.

    Kept as a reference: hardware_flops_per_token(gpt2 cfg with ffn=4h, kv_heads=heads,
    causal=False, recompute="full") * batch * seq_len reproduces it exactly.
    """
    b, s, n, h, v = batch, seq_len, layers, hidden, vocab
    return 96 * b * s * n * h**2 * (1 + s / (6 * h) + v / (16 * n * h))


def total_params(cfg: ModelConfig, experts: int | None = None) -> int:
    """Every parameter of the model, the token embedding included; a tied head once.

    llama: no biases, RMSNorm weight before attention, before the MLP and at the end.
    gpt2:  biases on every linear except the head, LayerNorm weight+bias (same three
           places), learned positions of seq_len x hidden.
    a user model (model.arch module:function): counted from its modules (model/custom.py).
    """
    if ":" in cfg.arch:
        from threefold.model.custom import counts

        return counts(cfg).total_params
    h, hd, v = cfg.hidden, _head_dim(cfg), cfg.vocab
    per_layer = _attention_weights(cfg) + _mlp_matrices(cfg) * h * cfg.ffn_hidden
    embed = v * h
    head = 0 if cfg.tie_embeddings else h * v
    if cfg.arch == "llama":
        norms_per_layer, final_norm, positions = 2 * h, h, 0
    else:  # gpt2 (matmul_weights_per_layer already rejected anything else)
        per_layer += (cfg.heads + 2 * cfg.kv_heads) * hd + h  # qkv bias, o bias
        per_layer += cfg.ffn_hidden + h  # MLP in and out biases
        norms_per_layer, final_norm, positions = 2 * 2 * h, 2 * h, cfg.seq_len * h
    per_layer += norms_per_layer
    n_moe = moe_layers(cfg)
    # An MoE block's MLP is the router, the experts (no biases) and the shared expert.
    dense_mlp = _mlp_matrices(cfg) * h * cfg.ffn_hidden + (cfg.ffn_hidden + h if cfg.arch == "gpt2" else 0)
    shared = dense_mlp if getattr(cfg, "shared_expert", False) else 0
    moe_mlp = (
        (
            h * cfg.num_experts
            + (cfg.num_experts if experts is None else experts) * _mlp_matrices(cfg) * h * cfg.ffn_hidden
            + shared
        )
        if n_moe
        else 0
    )
    return cfg.layers * per_layer + n_moe * (moe_mlp - dense_mlp) + embed + head + final_norm + positions


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token uses: every parameter of a dense model; of an MoE model only the
    router, the top_k routed experts and the shared expert of each MoE block."""
    return total_params(cfg, experts=cfg.top_k if moe_layers(cfg) else None)
