"""Which token windows make up each global batch, independent of how ranks split it.

The stream is cut into N non-overlapping windows of seq_len+1 tokens (window i starts at
i*seq_len, so consecutive windows share one token: the last target of one is the first input
of the next). Global sample j = step*global_batch + i is window perm_e[j % N] of epoch
e = j // N, with perm_e seeded by (seed, e). The batch at a step therefore depends only on
(seed, step, global_batch, seq_len, num_tokens): changing dp size or micro-batch size, or
resuming from a checkpoint at step k, reproduces exactly the same sequences.

A Blend of weighted datasets (threefold/data/blend.py) replaces the one stream: the sampler
still decides which global sample indices each rank reads, and the blend maps each index to
its dataset and window by a schedule of the index alone, so the same holds for blends.
"""

from __future__ import annotations

import numpy as np
import torch

from threefold.data.blend import Blend
from threefold.errors import ConfigError, DataError


class GlobalBatchSampler:
    def __init__(self, num_tokens: int, seq_len: int, global_batch: int, seed: int):
        if seq_len < 1:
            raise ConfigError("model.seq_len", f"must be >= 1, got {seq_len}")
        if global_batch < 1:
            raise ConfigError("train.global_batch", f"must be >= 1, got {global_batch}")
        if seed < 0:
            raise ConfigError("train.seed", f"must be >= 0, got {seed}")
        self.num_tokens, self.seq_len = int(num_tokens), int(seq_len)
        self.global_batch, self.seed = int(global_batch), int(seed)
        self.num_windows = max(0, (self.num_tokens - 1) // self.seq_len)
        if self.num_windows < self.global_batch:
            need = self.global_batch * self.seq_len + 1
            raise DataError(
                f"corpus has {self.num_tokens:,} tokens, too few for one global "
                f"batch of {self.global_batch} x {self.seq_len}-token sequences "
                f"(needs at least {need:,}; use more data or a smaller "
                "train.global_batch / model.seq_len)"
            )
        self._perms: dict[int, np.ndarray] = {}  # the one or two epochs the current step spans

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perms[epoch] = rng.permutation(self.num_windows)
        return self._perms[epoch]

    def global_windows(self, step: int) -> np.ndarray:
        """Window indices (int64, length global_batch) of every sample in this step's batch."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        j = step * self.global_batch + np.arange(self.global_batch, dtype=np.int64)
        epochs, pos = np.divmod(j, self.num_windows)
        out = np.empty(self.global_batch, dtype=np.int64)
        for e in np.unique(epochs):  # a batch straddles at most a few epochs
            mask = epochs == e
            out[mask] = self._perm(int(e))[pos[mask]]
        return out

    def microbatches(
        self, tokens: np.ndarray, step: int, dp_rank: int, dp_size: int, micro_batch: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This data-parallel rank's share of the step, as (inputs, targets) int64 CPU tensors
        of shape (micro_batch, seq_len), in the order of the global batch."""
        if dp_size < 1 or self.global_batch % dp_size:
            raise ConfigError(
                "train.global_batch",
                f"{self.global_batch} is not divisible by the data-parallel size {dp_size}",
                "a multiple of dp size x micro_batch",
            )
        local = self.global_batch // dp_size
        if micro_batch < 1 or local % micro_batch:
            raise ConfigError(
                "train.micro_batch",
                f"{micro_batch} does not divide the "
                f"per-rank batch {local} (global_batch {self.global_batch} / "
                f"dp {dp_size})",
                f"a divisor of {local}",
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        if len(tokens) != self.num_tokens:
            raise ValueError(f"token stream has {len(tokens)} tokens, sampler was built for {self.num_tokens}")
        first = step * self.global_batch + dp_rank * local
        if isinstance(tokens, Blend):  # it maps global sample indices to its datasets itself
            mine = tokens.rows(first + np.arange(local, dtype=np.int64), self.seq_len, self.seed)
        else:
            windows = self.global_windows(step)[dp_rank * local : (dp_rank + 1) * local]
            offsets = np.arange(self.seq_len + 1, dtype=np.int64)
            # Fancy indexing reads only these rows from the memmap, not the whole corpus.
            mine = np.asarray(tokens[(windows * self.seq_len)[:, None] + offsets], dtype=np.int64)
        out = []
        for m in range(0, local, micro_batch):
            rows = torch.from_numpy(mine[m : m + micro_batch])
            out.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
        return out

    def state_dict(self) -> dict:
        """Everything that fixes the sample order; the step itself is the position."""
        return {
            "seed": self.seed,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "num_tokens": self.num_tokens,
        }

    def check_state(self, state: dict) -> None:
        """On resume: refuse to continue with a different order than the checkpoint's."""
        for key, value in self.state_dict().items():
            if key in state and state[key] != value:
                raise DataError(
                    f"checkpoint data order has {key}={state[key]} but this run "
                    f"has {key}={value} (resume with the same data and "
                    "seed/global_batch/seq_len, or start a new run)"
                )
