"""A checkpoint's tensors assembled whole from their shards: what export, generation and the HF
converters read, whatever layout wrote them."""

from __future__ import annotations

from pathlib import Path

import torch

from threefold.checkpoint.manifest import Manifest


def consolidated(directory: Path, manifest: Manifest, prefix: str = "model/") -> dict[str, torch.Tensor]:
    """Every logical tensor under `prefix`, assembled whole from its shards."""
    files: dict[str, dict] = {}
    out = {}
    for name, entry in sorted(manifest.tensors.items()):
        if not name.startswith(prefix):
            continue
        full = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
        for shard in entry.shards:
            if shard.file not in files:
                files[shard.file] = torch.load(directory / shard.file, map_location="cpu", mmap=True, weights_only=True)
            region = tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.lengths))
            full[region] = files[shard.file][shard.key]
        out[name[len(prefix) :]] = full
    return out
