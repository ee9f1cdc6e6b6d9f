"""A model threefold does not ship, written as a user would, outside the package: GPT-J-style
blocks (attention and a non-gated GELU MLP in parallel, from one LayerNorm), plain nn.Linear /
nn.Embedding modules, and a tensor-parallel plan by module name (the TP-plan route).

    --model.arch own_model_gptj:build
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from threefold import ModelSpec


class Embed(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [seq, batch] -> [seq, batch, hidden]
        return self.wte(tokens)


class ParallelBlock(nn.Module):
    """x + attn(ln(x)) + mlp(ln(x)): one norm, two branches summed into the residual."""

    def __init__(self, hidden: int, heads: int, ffn: int, eps: float):
        super().__init__()
        self.head_dim = hidden // heads
        self.ln = nn.LayerNorm(hidden, eps=eps)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.fc_in = nn.Linear(hidden, ffn)
        self.fc_out = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln(x)
        q, k, v = self.q(y), self.k(y), self.v(y)
        # Shapes from the projections, not from y: under TP a rank holds heads/tp of the heads,
        # and under SP y is this rank's seq/tp rows while the projections see the whole sequence.
        s, b = q.shape[0], q.shape[1]
        q, k, v = (t.view(s, b, -1, self.head_dim).permute(1, 2, 0, 3) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        attn = self.out(attn.permute(2, 0, 1, 3).reshape(s, b, -1))
        return x + attn + self.fc_out(F.gelu(self.fc_in(y)))


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float):
        super().__init__()
        self.ln_f = nn.LayerNorm(hidden, eps=eps)
        self.proj = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln_f(x))


PLAN = {
    "tok_embed.wte": "vocab",
    "layers.*.q": "column",
    "layers.*.k": "column",
    "layers.*.v": "column",
    "layers.*.out": "row",
    "layers.*.fc_in": "column",
    "layers.*.fc_out": "row",
    "head.proj": "vocab",
}


def build(cfg) -> ModelSpec:
    h = cfg.hidden
    return ModelSpec(
        embed=lambda: Embed(cfg.vocab, h),
        block=lambda i: ParallelBlock(h, cfg.heads, cfg.ffn_hidden, cfg.norm_eps),
        head=lambda: Head(h, cfg.vocab, cfg.norm_eps),
        plan=PLAN,
    )
