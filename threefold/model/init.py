"""Layout-invariant initialization that can produce one shard without the full tensor.

Every parameter has a logical name (its name in the unsharded model) and a full shape. The full
tensor is defined as a sequence of row blocks along dimension 0, block b drawn from its own
generator seeded by hash(seed, name, b); the block size depends only on the full shape. A rank
therefore generates just the row blocks its shard touches (for a column slice: one block at a
time, keeping its columns), and any layout, on any device, gets bit-identical values.

A parameter's shard comes from its sharding record (model/sharding.py); a parameter without
one is the whole tensor.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from threefold.config import ModelConfig
from threefold.model.layers import output_std
from threefold.model.sharding import ShardSpec, sharding_of  # noqa: F401 - ShardSpec is also imported from here

BLOCK_ELEMENTS = 1 << 20  # elements per generator block (bounded host memory per draw)


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def normal_shard(
    name: str,
    full_shape: tuple[int, ...],
    std: float,
    seed: int,
    dim: int = 0,
    start: int = 0,
    length: int | None = None,
) -> torch.Tensor:
    """Rows/columns [start, start+length) along `dim` of the logical normal(0, std) tensor (fp32, CPU)."""
    full_shape = tuple(full_shape)
    length = full_shape[dim] - start if length is None else length
    rows = full_shape[0]
    row_numel = max(1, int(torch.Size(full_shape[1:]).numel()))
    rows_per_block = max(1, BLOCK_ELEMENTS // row_numel)
    r0, r1 = (start, start + length) if dim == 0 else (0, rows)
    pieces = []
    for block in range(r0 // rows_per_block, (r1 - 1) // rows_per_block + 1):
        b0 = block * rows_per_block
        n = min(rows_per_block, rows - b0)
        gen = torch.Generator().manual_seed(_block_seed(seed, name, block))
        # In place: the same values as `randn(...) * std`, without a second block in memory.
        values = torch.randn((n, *full_shape[1:]), generator=gen).mul_(std)
        lo, hi = max(r0, b0) - b0, min(r1, b0 + n) - b0
        values = values[lo:hi]
        if dim != 0:
            values = values.narrow(dim, start, length)
        pieces.append(values)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


def _init_rule(name: str, cfg: ModelConfig) -> tuple[str, float]:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias" or name.endswith("_norm.bias") or name == "norm.bias":
        return "zeros", 0.0
    if "norm" in name:
        return "ones", 0.0
    if name.endswith(("wo.weight", "w2.weight")):
        return "normal", output_std(cfg)
    return "normal", cfg.init_std


def initial_values(name: str, param: torch.Tensor, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The initial value of `param` (logical name `name`, shard from its sharding record; it may
    still be on the meta device): a new fp32 CPU tensor of its shape, the same on every layout."""
    kind, std = _init_rule(name, cfg)
    if kind != "normal":
        return torch.full(tuple(param.shape), 0.0 if kind == "zeros" else 1.0)
    spec = sharding_of(param).spec
    if spec is None:
        values = normal_shard(name, tuple(param.shape), std, seed)
    else:
        values = normal_shard(name, spec.full_shape, std, seed, spec.dim, spec.start, spec.length)
    if values.shape != param.shape:
        raise RuntimeError(f"init of {name}: shard {tuple(values.shape)} != parameter {tuple(param.shape)}")
    return values


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int, tied_name_map: dict[str, str] | None = None) -> None:
    """Fill every parameter of `model` (already materialized, e.g. by to_empty) in place."""
    tied_name_map = tied_name_map or {}
    for name, param in model.named_parameters():
        param.copy_(initial_values(tied_name_map.get(name, name), param, cfg, seed))
