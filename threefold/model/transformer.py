"""Decoder-only transformer (Llama-style, or GPT-2 style), usable whole or as a pipeline stage.

A stage is the same class holding a contiguous range of blocks: the first stage owns the
embeddings, the last the final norm, the head and the loss. Blocks live in a ModuleDict keyed
by their global index, so parameter names ("layers.7.attn.wq.weight") are the same in every
layout; initialization and checkpoints key on those names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from threefold.config import ModelConfig
from threefold.model.layers import Block, Linear, make_norm
from threefold.model.loss import chunked_cross_entropy_sum


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of token losses in fp32: the caller divides by the global token count,
    which makes the loss independent of how the global batch is split. Only one chunk of tokens'
    logits is in fp32 at a time (model/loss.py)."""
    return chunked_cross_entropy_sum(logits, targets)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_ids: Iterable[int] | None = None, first: bool = True, last: bool = True):
        super().__init__()
        self.cfg = cfg
        layer_ids = list(range(cfg.layers) if layer_ids is None else layer_ids)
        self.first, self.last = first, last
        self.tok_embed = nn.Embedding(cfg.vocab, cfg.hidden) if first else None
        self.pos_embed = nn.Embedding(cfg.seq_len, cfg.hidden) if first and cfg.arch == "gpt2" else None
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in layer_ids})
        self.norm = make_norm(cfg) if last else None
        self.head = Linear(cfg.hidden, cfg.vocab, bias=False) if last else None
        if first and last and cfg.tie_embeddings:
            self.head.weight = self.tok_embed.weight
        # Swapped for the vocab-parallel version by tensor parallelism.
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum
        # Global positions of this rank's tokens [seq] (context parallelism; None: 0..seq-1).
        self.positions: torch.Tensor | None = None
        # Hooks tensor/sequence parallelism installs at the stage boundaries (identity here).
        self.embed_out: Callable[[torch.Tensor], torch.Tensor] = _identity

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [batch, seq] -> hidden [seq, batch, hidden]; `positions` [batch, seq] index the
        learned position table per token (document masking restarts them per document)."""
        x = self.tok_embed(tokens.t())
        if self.pos_embed is not None:
            if positions is None and self.positions is not None:
                x = x + self.pos_embed.weight[self.positions, None, :]
            elif positions is None:
                x = x + self.pos_embed.weight[: tokens.shape[1], None, :]
            else:
                x = x + self.pos_embed.weight[positions.t()]
        return self.embed_out(x)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, documents=None) -> torch.Tensor:
        """First stage takes tokens [batch, seq]; others hidden [seq, batch, hidden].
        The last stage returns the summed loss when `targets` is given, else logits [seq, batch, vocab].
        `documents` (threefold.data.documents.Documents of this micro-batch, or None): attention
        stays inside documents and positions (RoPE, or GPT-2's learned table) restart per document."""
        if self.first:
            x = self.embed(x, None if documents is None else documents.positions)
        for block in self.layers.values():
            x = block(x) if documents is None else block(x, documents=documents)
        if not self.last:
            return x
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return self.loss_fn(logits, targets.t())


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x
