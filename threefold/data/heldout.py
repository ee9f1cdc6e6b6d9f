"""A run's evaluation windows: the last data.val_fraction of its token stream (data/split.py),
cut into non-overlapping windows of seq_len + 1 tokens. The same windows for in-training
evaluation and a later `threefold eval`, whatever the layout."""

from __future__ import annotations

import numpy as np
import torch

from threefold.config import Config
from threefold.data.corpus import load_tokens
from threefold.data.split import heldout_starts


class HeldOut:
    """The held-out token stream of a run and the start of each of its evaluation windows."""

    def __init__(self, cfg: Config):
        d = cfg.data
        stream = load_tokens(d.path, d.vocab, d.dtype, d.cache_dir, d.tokenizer)
        self.tokens = stream.tokens
        self.source = stream.source
        self.vocab_size = stream.vocab_size
        self.seq_len = cfg.model.seq_len
        self.starts = heldout_starts(len(stream.tokens), cfg.model.seq_len, d.val_fraction, cfg.train.eval_sequences)

    def windows(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the windows at `starts`: rows of seq_len tokens, targets shifted by one."""
        rows = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)]
        rows = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
