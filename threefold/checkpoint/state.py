"""What a rank contributes to a checkpoint, in global coordinates.

Every parameter (and its AdamW moments) is a slice of a logical tensor named as in the
unsharded model. Tensor-parallel shards carry their slice from `shard_specs`; everything else
is the whole tensor. Of the ranks holding the same slice (data-parallel replicas, and the TP
ranks of a replicated tensor) exactly one writes it, so the shards of a checkpoint never overlap.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LocalTensor:
    name: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    write: bool

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)


def _param_slices(chunks: list[nn.Module], aliases: dict[int, str]):
    """(logical name, parameter, global shape, offsets, sharded, alias) for this rank's parameters."""
    seen: set[int] = set()
    for chunk in chunks:
        for mod_name, module in chunk.named_modules():
            specs = getattr(module, "shard_specs", {})
            for pname, p in module.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                alias = aliases.get(id(p))
                name = alias or (f"{mod_name}.{pname}" if mod_name else pname)
                spec = specs.get(pname)
                if spec is None:
                    yield name, p, tuple(p.shape), (0,) * p.ndim, False, alias is not None
                else:
                    offsets = [0] * p.ndim
                    offsets[spec.dim] = spec.start
                    yield name, p, tuple(spec.full_shape), tuple(offsets), True, alias is not None


def training_state(chunks: list[nn.Module], optimizer: torch.optim.Optimizer, grid,
                   aliases: dict[int, str] | None = None) -> list[LocalTensor]:
    """Parameters and AdamW moments of this rank, materializing missing optimizer state as
    zeros (exactly what AdamW would create) so a load has somewhere to write. `aliases` maps a
    parameter that is a copy of another logical tensor (the last stage's copy of a tied
    embedding: "tok_embed.weight") to that name: it is loaded from it and never written."""
    out = []
    for name, p, shape, offsets, sharded, alias in _param_slices(chunks, aliases or {}):
        write = grid.dp_rank == 0 and (sharded or grid.tp_rank == 0) and not alias
        out.append(LocalTensor(f"model/{name}", p.data, shape, offsets, write))
        state = optimizer.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        for key in ("exp_avg", "exp_avg_sq"):
            out.append(LocalTensor(f"optim/{name}/{key}", state[key], shape, offsets, write))
    return out


def set_optimizer_step(optimizer: torch.optim.Optimizer, step: int) -> None:
    """AdamW's bias correction counts steps per parameter; all of ours took every step."""
    for state in optimizer.state.values():
        state["step"].fill_(float(step))
