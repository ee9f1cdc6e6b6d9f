"""Weighted blends of token datasets: `data.path "0.7 web/ 0.2 code/ 0.1 books/"` (Megatron-LM's
blend syntax: weight, path, weight, path ...) or a TOML file of [[blend]] tables {path, weight}.

Which dataset global sample j comes from is a fixed schedule of j alone: samples are dealt in
blocks of BLOCK, each block holding every dataset's share (largest-remainder rounding of
weight x BLOCK), interleaved greedily so that every prefix of the block is within about one
sample of the weights. Sample j is therefore the k-th sample of dataset d with (d, k) computed in
O(1), and the k-th sample of d is window perm_{d,e}[k mod N_d] of that dataset's own epoch
e = k // N_d (seeded by seed, d, e). So the order depends only on (seed, weights, dataset sizes,
seq_len), not on the layout or on resuming; a small dataset starting a new epoch reshuffles
itself and leaves the others where they were.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from threefold.errors import ConfigError, DataError

BLOCK = 4096  # samples per schedule block: shares are exact per block, within ~1 sample inside


def parse_blend(spec: str) -> list[tuple[float, str]] | None:
    """[(weight, path)] when `spec` is a blend, None when it names one dataset."""
    if not spec or Path(spec).exists() and not spec.endswith(".toml"):
        return None
    if spec.endswith(".toml"):
        return _toml_blend(spec)
    words = spec.split()
    try:
        float(words[0])
    except ValueError:
        return None
    if len(words) % 2:
        raise ConfigError("data.path", f"blend {spec!r} has an odd number of words", "'W1 PATH1 W2 PATH2 ...'")
    pairs = []
    for w, p in zip(words[::2], words[1::2]):
        try:
            pairs.append((float(w), p))
        except ValueError:
            raise ConfigError("data.path", f"blend weight {w!r} is not a number", "'W1 PATH1 W2 PATH2 ...'") from None
    return _checked(pairs)


def _toml_blend(path: str) -> list[tuple[float, str]]:
    from threefold.config import read_toml_file

    table = read_toml_file(path, "data.path").get("blend")
    if not isinstance(table, list) or not all(isinstance(t, dict) and {"path", "weight"} <= set(t) for t in table):
        raise ConfigError("data.path", f"{path} needs [[blend]] tables", "each with path = '...' and weight = 0.5")
    base = Path(path).parent
    pairs = []
    for t in table:
        if not isinstance(t["weight"], (int, float)) or isinstance(t["weight"], bool):
            raise ConfigError("data.path", f"{path}: weight {t['weight']!r} is not a number")
        pairs.append((float(t["weight"]), str(base / t["path"])))
    return _checked(pairs)


def _checked(pairs: list[tuple[float, str]]) -> list[tuple[float, str]]:
    if not pairs or any(not w > 0 for w, _ in pairs):
        raise ConfigError("data.path", f"blend weights {[w for w, _ in pairs]} must all be > 0")
    total = sum(w for w, _ in pairs)
    if any(w / total * BLOCK < 1 for w, _ in pairs):
        raise ConfigError("data.path", "a blend weight is below 1/4096 of the total", "raise it or drop the dataset")
    return pairs


def _schedule(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(per-block counts, dataset of each block position, its rank among that dataset's positions)."""
    quota = weights / weights.sum() * BLOCK
    counts = np.floor(quota).astype(np.int64)
    # Largest remainders take the samples rounding left over (ties to the lower index).
    for d in np.argsort(-(quota - counts), kind="stable")[: BLOCK - int(counts.sum())]:
        counts[d] += 1
    pattern = np.empty(BLOCK, dtype=np.int64)
    rank = np.empty(BLOCK, dtype=np.int64)
    taken = np.zeros(len(weights), dtype=np.int64)
    for i in range(BLOCK):
        # Greedy: the dataset furthest behind its target after i+1 samples.
        d = int(np.argmax(counts * (i + 1) / BLOCK - taken))
        pattern[i], rank[i] = d, taken[d]
        taken[d] += 1
    return counts, pattern, rank


@dataclasses.dataclass
class Part:
    """One dataset of a blend: its name (the path as given), weight and flat token stream."""

    name: str
    weight: float
    tokens: np.ndarray


class Blend:
    """A token source for GlobalBatchSampler made of weighted datasets; `rows` maps global sample
    indices to token rows. As an array (len, fancy indexing) it reads as the datasets' concatenation."""

    def __init__(self, parts: list[Part]):
        self.parts = parts
        self.counts, self.pattern, self.rank = _schedule(np.array([p.weight for p in parts], dtype=np.float64))
        self.prefix = np.zeros((BLOCK + 1, len(parts)), dtype=np.int64)  # samples of d among a block's first r
        np.cumsum(self.pattern[:, None] == np.arange(len(parts)), axis=0, out=self.prefix[1:])
        self.offsets = np.cumsum([0] + [len(p.tokens) for p in parts])
        self._perms: dict[tuple[int, int, int], np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index):
        """Tokens at positions of the datasets' concatenation (integer arrays only)."""
        index = np.asarray(index, dtype=np.int64)
        out = np.empty(index.shape, dtype=np.int64)
        which = np.searchsorted(self.offsets, index, side="right") - 1
        for d in np.unique(which):
            mask = which == d
            out[mask] = self.parts[d].tokens[index[mask] - self.offsets[d]]
        return out

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, sample number within that dataset) of each global sample index."""
        block, pos = np.divmod(np.asarray(samples, dtype=np.int64), BLOCK)
        d = self.pattern[pos]
        return d, block * self.counts[d] + self.rank[pos]

    def samples_seen(self, n: int) -> np.ndarray:
        """How many of the first n global samples each dataset supplied."""
        block, pos = divmod(int(n), BLOCK)
        return block * self.counts + self.prefix[pos]

    def _perm(self, d: int, epoch: int, windows: int, seed: int) -> np.ndarray:
        key = (d, epoch, windows)
        if key not in self._perms:
            if len(self._perms) >= 2 * len(self.parts) + 2:  # a step touches one or two epochs of each
                self._perms.pop(next(iter(self._perms)))
            rng = np.random.Generator(np.random.PCG64([seed, d + 1, epoch]))
            self._perms[key] = rng.permutation(windows)
        return self._perms[key]

    def rows(self, samples: np.ndarray, seq_len: int, seed: int) -> np.ndarray:
        """(len(samples), seq_len + 1) int64 token rows of these global samples."""
        d_of, k = self.locate(samples)
        out = np.empty((len(d_of), seq_len + 1), dtype=np.int64)
        offsets = np.arange(seq_len + 1, dtype=np.int64)
        for d in np.unique(d_of):
            part, mask = self.parts[d], d_of == d
            n = (len(part.tokens) - 1) // seq_len
            if n < 1:
                raise DataError(
                    f"blend dataset {part.name} has {len(part.tokens):,} tokens, fewer than one "
                    f"{seq_len + 1}-token window (use a shorter model.seq_len or drop it from the blend)"
                )
            epochs, pos = np.divmod(k[mask], n)
            windows = np.empty(len(pos), dtype=np.int64)
            for e in np.unique(epochs):
                sel = epochs == e
                windows[sel] = self._perm(int(d), int(e), n, seed)[pos[sel]]
            out[mask] = np.asarray(part.tokens[windows[:, None] * seq_len + offsets], dtype=np.int64)
        return out

    def describe(self) -> str:
        total = sum(p.weight for p in self.parts)
        return "blend of " + ", ".join(f"{p.weight / total:.3g} {p.name} ({len(p.tokens):,})" for p in self.parts)


def tokens_per_dataset(source, samples: int, seq_len: int) -> dict[str, int]:
    """Training tokens each blended dataset supplied in the first `samples` global samples
    ({} for a single dataset): for metrics, e.g. samples = (step + 1) * global_batch."""
    if not isinstance(source, Blend):
        return {}
    return {p.name: int(c) * seq_len for p, c in zip(source.parts, source.samples_seen(samples))}
