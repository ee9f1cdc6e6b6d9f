"""Document boundaries inside packed sequences (data.document_mask, as Llama 3 trained).

The sampler cuts windows across documents; each document ends with the end-of-document id
(the tokenizer's separator; id 0 in a byte-level stream). With document masking, a token
attends only to earlier tokens of its own document and its position restarts at 0 where a
document starts. As in Megatron-LM's reset_attention_mask / reset_position_ids, the separator
belongs to the document it ends: the token after it starts the next one. The loss is still
taken at every position (the separator's target, the next document's first token, is predicted
from the separator's own document).

Built per micro-batch from the token ids on the run's device, with no host sync: every
pipeline stage has its micro-batches' ids (each rank reads its data-parallel share, targets
included), so each stage builds the same layout locally and nothing extra crosses the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Documents:
    """Where documents start and end inside one micro-batch of token windows."""

    positions: torch.Tensor
    """[batch, seq] int64: each token's position inside its own document."""
    mask: torch.Tensor
    """[batch, 1, seq, seq] bool: True where query i may attend key j (same document, j <= i)."""


def document_layout(tokens: torch.Tensor, separator: int) -> Documents:
    """The block-diagonal causal mask and per-document positions of `tokens` [batch, seq]."""
    is_sep = tokens == separator
    # Exclusive prefix count: a separator closes its own document, the next token opens one.
    segment = torch.cumsum(is_sep, dim=1) - is_sep.long()
    seq = tokens.shape[1]
    index = torch.arange(seq, device=tokens.device).expand_as(tokens)
    opens = torch.zeros_like(is_sep)
    opens[:, 1:] = is_sep[:, :-1]
    start = torch.where(opens, index, torch.zeros_like(index)).cummax(dim=1).values
    causal = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).tril()
    same = segment[:, :, None] == segment[:, None, :]
    return Documents(positions=index - start, mask=(same & causal).unsqueeze(1))


def document_separator(tokenizer: str) -> int:
    """The end-of-document id of data.tokenizer ('' = byte-level: id 0); raises when it has none."""
    from threefold.data.tokenizer import open_tokenizer
    from threefold.errors import ConfigError

    sep = open_tokenizer(tokenizer).separator
    if sep is None:
        raise ConfigError(
            "data.document_mask",
            f"data.tokenizer {tokenizer} has no end-of-document token, so documents cannot be found",
            "a tokenizer with <|endoftext|> or </s>, or data.document_mask false",
        )
    return int(sep)
