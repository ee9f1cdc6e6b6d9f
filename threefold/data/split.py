"""The held-out split: the last `data.val_fraction` of the token stream.

Training samples only the tokens before the split point; evaluation reads non-overlapping
windows from the split point on. The split is a function of the stream length alone, so a run,
its in-training evaluation and a later `threefold eval` agree on it. With val_fraction 0 there
is no split: training samples the whole stream (exactly as before the split existed) and
`threefold eval` reads the whole stream.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from threefold.data.blend import Blend
from threefold.data.corpus import TokenFile
from threefold.errors import ConfigError, DataError


def split_point(num_tokens: int, val_fraction: float) -> int:
    """Index of the first held-out token (num_tokens when nothing is held out)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError("data.val_fraction", f"{val_fraction} is outside [0, 1)")
    return num_tokens - int(num_tokens * val_fraction)


def training_part(tokens: TokenFile, val_fraction: float) -> TokenFile:
    """The tokens training may sample (all of them when val_fraction is 0)."""
    if val_fraction == 0:
        return tokens
    if isinstance(tokens.tokens, Blend):
        # Evaluation reads the tail of one stream; a blend has no single tail to hold out.
        raise ConfigError(
            "data.val_fraction",
            f"{val_fraction} with a blend of datasets",
            "0 for a blend; hold out data by evaluating on a separate dataset",
        )
    end = split_point(len(tokens), val_fraction)
    return dataclasses.replace(
        tokens, tokens=tokens.tokens[:end], source=f"{tokens.source}; last {len(tokens) - end:,} held out"
    )


def heldout_starts(num_tokens: int, seq_len: int, val_fraction: float, limit: int = 0) -> np.ndarray:
    """Start offsets of the evaluation windows (seq_len inputs + 1 target each, stride seq_len):
    from the split point on, or over the whole stream when val_fraction is 0; the first
    `limit` of them when limit > 0."""
    start = split_point(num_tokens, val_fraction) if val_fraction > 0 else 0
    count = max(0, (num_tokens - start - 1) // seq_len)
    if limit > 0:
        count = min(count, limit)
    if count == 0:
        raise DataError(
            f"the held-out part has {num_tokens - start:,} tokens, fewer than one window of "
            f"{seq_len + 1} (raise data.val_fraction or use a shorter model.seq_len)"
        )
    return start + seq_len * np.arange(count, dtype=np.int64)
