"""The GPT-J-style model of own_model_gptj.py written by the compose-the-layers route: the block
builds threefold's ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding itself, from
the Parallel context threefold hands its factories (ModelSpec.composed), with no plan.

    --model.arch own_model_composed:build
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from threefold import ColumnParallelLinear, ModelSpec, RowParallelLinear, VocabParallelEmbedding


class Embed(nn.Module):
    def __init__(self, vocab: int, hidden: int, par):
        super().__init__()
        self.wte = VocabParallelEmbedding(vocab, hidden, par.tp)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.wte(tokens)


class ParallelBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, eps: float, par):
        super().__init__()
        self.head_dim = hidden // heads

        def column(i, o, bias=False):
            return ColumnParallelLinear(i, o, par.tp, bias=bias, sp=par.sp, overlap=par.overlap)

        self.ln = nn.LayerNorm(hidden, eps=eps)
        self.q, self.k, self.v = column(hidden, hidden), column(hidden, hidden), column(hidden, hidden)
        self.out = RowParallelLinear(hidden, hidden, par.tp, sp=par.sp)
        self.fc_in = column(hidden, ffn, bias=True)
        self.fc_out = RowParallelLinear(ffn, hidden, par.tp, bias=True, sp=par.sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln(x)
        q, k, v = self.q(y), self.k(y), self.v(y)
        s, b = q.shape[0], q.shape[1]
        q, k, v = (t.view(s, b, -1, self.head_dim).permute(1, 2, 0, 3) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        attn = self.out(attn.permute(2, 0, 1, 3).reshape(s, b, -1))
        return x + attn + self.fc_out(F.gelu(self.fc_in(y)))


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float, par):
        super().__init__()
        self.ln_f = nn.LayerNorm(hidden, eps=eps)
        # Vocabulary-split logits: threefold's loss for a composed model is the vocab-parallel one.
        self.proj = ColumnParallelLinear(hidden, vocab, par.tp, sp=par.sp, overlap=par.overlap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln_f(x))


def build(cfg) -> ModelSpec:
    h = cfg.hidden
    return ModelSpec(
        embed=lambda par: Embed(cfg.vocab, h, par),
        block=lambda i, par: ParallelBlock(h, cfg.heads, cfg.ffn_hidden, cfg.norm_eps, par),
        head=lambda par: Head(h, cfg.vocab, cfg.norm_eps, par),
        composed=True,
    )
