"""The causal load-balanced sequence layout of context parallelism.

Under a causal mask the last tokens of a sequence attend to everything and the first to almost
nothing, so cutting the sequence into cp contiguous pieces gives the last rank ~2cp-1 times the
first one's attention work. Instead the global sequence of length S is cut into 2cp chunks of
S/(2cp) and cp rank i holds chunks i and 2cp-1-i, concatenated in that order: every rank then
holds one "early" and one "late" chunk and does the same work (Megatron-Core's and the zigzag
ring attention's layout).

Within a rank's local sequence global positions increase (i < 2cp-1-i), so the local causal
mask of the rank's own block is the plain lower triangle.
"""

from __future__ import annotations

import torch

from threefold.errors import ConfigError


def check_divisible(seq: int, cp: int) -> int:
    """The chunk length seq/(2cp); refuses a sequence the layout cannot cut."""
    if cp < 1:
        raise ConfigError("parallel.cp", f"cp {cp} must be at least 1", "valid: a positive integer")
    if seq % (2 * cp):
        raise ConfigError(
            "parallel.cp",
            f"sequence length {seq} is not divisible by 2*cp = {2 * cp} (each cp rank holds two chunks)",
            f"valid: model.seq_len a multiple of {2 * cp}, or a cp whose double divides {seq}",
        )
    return seq // (2 * cp)


def local_indices(seq: int, cp: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of cp rank `rank`'s tokens, in local order: chunk rank, then chunk 2cp-1-rank.
    Slices input ids and labels, and gives RoPE each token's global position."""
    c = check_divisible(seq, cp)
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} outside 0..{cp - 1}")
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def gathered_order(seq: int, cp: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of every rank's local sequence concatenated in rank order (what an
    all-gather or all-to-all over the cp group yields): chunks 0, 2cp-1, 1, 2cp-2, ..."""
    c = check_divisible(seq, cp)
    ranks = torch.arange(cp, device=device)
    chunks = torch.stack([ranks, 2 * cp - 1 - ranks], dim=1).flatten()
    return (chunks[:, None] * c + torch.arange(c, device=device)).flatten()


def shard_sequence(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """cp rank `rank`'s part of the full sequence `x` along `dim` (chunks rank and 2cp-1-rank)."""
    c = check_divisible(x.shape[dim], cp)
    return torch.cat([x.narrow(dim, rank * c, c), x.narrow(dim, (2 * cp - 1 - rank) * c, c)], dim=dim)


def unshard_sequence(parts: list[torch.Tensor], dim: int, cp: int) -> torch.Tensor:
    """The full sequence from every cp rank's part (in rank order): shard_sequence's inverse."""
    if len(parts) != cp:
        raise ValueError(f"unshard_sequence: {len(parts)} parts for cp {cp}")
    c = parts[0].shape[dim] // 2
    early = [p.narrow(dim, 0, c) for p in parts]
    late = [p.narrow(dim, c, c) for p in reversed(parts)]
    return torch.cat(early + late, dim=dim)
