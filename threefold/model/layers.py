"""Transformer building blocks, written free of parallel plumbing.

Activations are laid out [seq, batch, hidden] (as in Megatron): sequence parallelism shards
dimension 0, which keeps the all-gather / reduce-scatter buffers contiguous.

Tensor parallelism is applied afterwards by swapping the `nn.Linear`s for column/row-parallel
ones; the code below therefore derives head counts from the projected tensors (``-1`` in the
views) instead of from the config, so the same forward serves a shard of the heads.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend

from threefold.config import ModelConfig
from threefold.model.moe import MoE, is_moe_layer


class Linear(nn.Linear):
    """nn.Linear whose backward a zero-bubble pipeline can split: with `weight_grad_store` set,
    the store computes dX at once and queues dW for a later W action."""

    weight_grad_store = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_grad_store is None:
            return F.linear(x, self.weight, self.bias)
        return _deferred_linear(self.weight_grad_store, x, self.weight, self.bias)


def _deferred_linear(store, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # Eager even inside a compiled block (train.compile; see mark_for_compile): the store queues
    # dW closures for W.
    return store.linear(x, weight, bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even under bf16 autocast: the mean of squares loses precision.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self.weight.float()).to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.arch == "gpt2":
        return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
    return RMSNorm(cfg.hidden, cfg.norm_eps)


@functools.lru_cache(maxsize=16)
def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [seq, 1, 1, head_dim/2], computed in fp32 (cached per shape and device)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return (angles.cos().float().to(device)[:, None, None, :], angles.sin().float().to(device)[:, None, None, :])


def _rope_constants(seq_len: int, head_dim: int, theta: float, device: torch.device):
    # Inside a compiled block (train.compile; see mark_for_compile) the tables are constants of
    # the graph, computed once at trace time, not fp64 host arithmetic and a copy to the device
    # in every call.
    return rope_tables(seq_len, head_dim, theta, device)


def mark_for_compile() -> None:
    """Before the first torch.compile of a block (model/compile.py): the dW store stays eager,
    the RoPE tables and the attention kernel choice become graph constants. Applied then, not
    at import: the compiler's markers import the compiler stack (dynamo, sympy: seconds), which
    an eager run never needs. The markers leave eager calls as they were."""
    global _deferred_linear, _rope_constants, _attention_form
    if not getattr(_rope_constants, "marked", False):
        _deferred_linear = torch.compiler.disable(_deferred_linear)
        _rope_constants = torch.compiler.assume_constant_result(_rope_constants)
        # The kernel choice is host logic dynamo cannot trace; constant for a compiled graph.
        _attention_form = torch.compiler.assume_constant_result(_attention_form)
        _rope_constants.marked = True


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x: [seq, batch, heads, head_dim]."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


def expand_kv_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V [batch, kv_heads, seq, hd] repeated to `heads` query heads, query head i reading
    kv head i // (heads / kv_heads) as SDPA's enable_gqa does (an expand and one copy: the
    repeat count comes from shapes, so nothing is read from the device)."""
    b, kv, s, hd = t.shape
    return t[:, :, None].expand(b, kv, heads // kv, s, hd).reshape(b, heads, s, hd)


_BACKEND_NAMES = {
    SDPBackend.MATH: "math",
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "efficient",
    SDPBackend.CUDNN_ATTENTION: "cudnn",
    SDPBackend.OVERRIDEABLE: "overrideable",
}
FUSED_BACKENDS = ("flash", "efficient", "cudnn", "overrideable")
"""SDPA kernels that never materialize the seq x seq scores (all but "math")."""


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> str:
    """The SDPA kernel that serves this call (causal when `mask` is None, GQA when k has fewer
    heads than q) under the current sdpa_kernel settings: one of FUSED_BACKENDS, "math" (the
    one that materializes the scores) or "none" (every kernel refuses). Host-side dispatch
    logic on shapes, dtypes and devices: no device work, no sync."""
    gqa = q.shape[1] != k.shape[1]
    try:
        choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, mask is None, enable_gqa=gqa)
    except RuntimeError:  # "No viable backend": sdpa_kernel left no kernel that takes the call
        return "none"
    return _BACKEND_NAMES.get(SDPBackend(choice), "none")


# SDPA's kernel rules that decide here (device, dtype, head dim, heads, a mask, GQA, grad) do
# not read the sequence length; a short probe keeps the check from allocating a layer's worth.
_PROBE_SEQ = 128


@functools.lru_cache(maxsize=64)
def _served_by(device, dtype, heads, kv_heads, head_dim, grad, masked, settings) -> str:
    """sdpa_backend of an attention call of this kind, on empty probe tensors (cached per
    kind and sdpa_kernel `settings`)."""
    q, k, v = (
        torch.empty(1, h, _PROBE_SEQ, head_dim, device=device, dtype=dtype, requires_grad=grad)
        for h in (heads, kv_heads, kv_heads)
    )
    mask = torch.empty(1, 1, _PROBE_SEQ, _PROBE_SEQ, device=device, dtype=torch.bool) if masked else None
    return sdpa_backend(q, k, v, mask)


def _sdpa_settings() -> tuple:
    """What sdpa_kernel sets and the dispatcher reads: the enabled kernels and their priority."""
    b = torch.backends.cuda
    enabled = (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(), b.cudnn_sdp_enabled())
    return enabled + tuple(torch._C._get_sdp_priority_order())


def _attention_form(device, dtype, heads, kv_heads, head_dim, grad, masked) -> tuple[bool, str]:
    """(expand K/V to the query heads, the kernel that then serves the call). GQA calls stay
    GQA (K/V kept at kv heads, in memory and in what backward saves) unless no fused kernel
    takes them and one takes the expanded form: on CUDA flash refuses a mask and the efficient
    kernel refuses enable_gqa, so a masked GQA call would fall to the math kernel. CPU's flash
    kernel takes both; bench/document_mask_attention.py times the two forms alike there."""
    settings = _sdpa_settings()
    served = _served_by(device, dtype, heads, kv_heads, head_dim, grad, masked, settings)
    if heads == kv_heads or served in FUSED_BACKENDS:
        return False, served
    expanded = _served_by(device, dtype, heads, heads, head_dim, grad, masked, settings)
    return (True, expanded) if expanded in FUSED_BACKENDS else (False, served)


class AttentionCore(nn.Module):
    """softmax(QK^T/sqrt(d))V with a causal mask, or the boolean `mask` [batch, 1, seq, seq]
    (data.document_mask: block-diagonal causal), on a fused SDPA kernel wherever one takes the
    call (_attention_form); its own module so selective recompute can wrap it."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        # q: [batch, heads, seq, hd]; k, v: [batch, kv_heads, seq, hd]
        if self._form(q, k, v, mask)[0]:
            k, v = expand_kv_heads(k, q.shape[1]), expand_kv_heads(v, q.shape[1])
        gqa = q.shape[1] != k.shape[1]
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    @staticmethod
    def _form(q, k, v, mask) -> tuple[bool, str]:
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        return _attention_form(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[3], grad, mask is not None)

    def expands_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> bool:
        """Whether forward(q, k, v, mask) expands K/V to the query heads."""
        return self._form(q, k, v, mask)[0]

    def served_by(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> str:
        """The SDPA kernel that serves forward(q, k, v, mask) (see sdpa_backend)."""
        return self._form(q, k, v, mask)[1]

    def materializes_scores(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> bool:
        """Whether forward(q, k, v, mask) runs on the math kernel, which saves the seq x seq
        probabilities for backward: what selective recompute drops (model/recompute.py)."""
        return self.served_by(q, k, v, mask) == "math"


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hd, bias = cfg.head_dim, cfg.arch == "gpt2"
        qkv_bias = bias or cfg.qkv_bias
        self.head_dim, self.rope_theta, self.seq_len = hd, cfg.rope_theta, cfg.seq_len
        self.use_rope = cfg.arch == "llama"
        # Global positions of this rank's tokens [s] when its sequence is a subset of the whole
        # one (context parallelism sets them); None: positions 0..s-1.
        self.positions: torch.Tensor | None = None
        self.wq = Linear(cfg.hidden, cfg.heads * hd, bias=qkv_bias)
        self.wk = Linear(cfg.hidden, cfg.kv_heads * hd, bias=qkv_bias)
        self.wv = Linear(cfg.hidden, cfg.kv_heads * hd, bias=qkv_bias)
        self.core = AttentionCore()
        self.wo = Linear(cfg.heads * hd, cfg.hidden, bias=bias)

    def forward(self, x: torch.Tensor, documents=None) -> torch.Tensor:
        """`documents` (threefold.data.documents.Documents, or None): attend within documents,
        rotate by positions inside them. A keyword, so TP's entry pre-hook passes it untouched."""
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        s, b = q.shape[0], q.shape[1]  # the full sequence: under SP the entry gathered it
        q, k, v = (t.view(s, b, -1, self.head_dim) for t in (q, k, v))
        if self.use_rope:
            cos, sin = _rope_constants(
                s if self.positions is None else self.seq_len, self.head_dim, self.rope_theta, q.device
            )
            if self.positions is not None:  # rows of the global table: RoPE sees global positions
                cos, sin = cos[self.positions], sin[self.positions]
            if documents is not None:  # [s, 1, 1, hd/2] tables -> [s, b, 1, hd/2] per token
                at = documents.positions.t()
                cos, sin = cos[:, 0, 0][at].unsqueeze(2), sin[:, 0, 0][at].unsqueeze(2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask = None if documents is None else documents.mask
        out = self.core(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), mask=mask)  # -> [b, heads, s, hd]
        return self.wo(out.permute(2, 0, 1, 3).reshape(s, b, -1))


class MLP(nn.Module):
    """SwiGLU (w2(silu(w1 x) * w3 x)) for llama, GeLU (w2(gelu(w1 x))) for gpt2."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.arch == "llama"
        bias = not self.gated
        self.w1 = Linear(cfg.hidden, cfg.ffn_hidden, bias=bias)
        self.w3 = Linear(cfg.hidden, cfg.ffn_hidden, bias=False) if self.gated else None
        self.w2 = Linear(cfg.ffn_hidden, cfg.hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        if is_moe_layer(cfg, layer):
            self.mlp = MoE(cfg, shared=MLP(cfg) if cfg.shared_expert else None)
        else:
            self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, documents=None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), documents=documents))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


def output_std(cfg: ModelConfig) -> float:
    """GPT-2's scaled init for projections that write into the residual stream."""
    return cfg.init_std / math.sqrt(2 * cfg.layers)
