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

from threefold.model.sharding import sharding_of


@dataclass
class LocalTensor:
    name: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    write: bool
    source: int | None = None
    """The rank whose file holds this slice when the checkpoint was saved in this run's layout
    (this rank where it writes it, else the replica that does): a resume reads that file's line
    of the owned table instead of the tensor's line of every piece (manifest.read_for)."""
    dp_replica: bool = False
    """A slice every dp replica holds whole (ZeRO 0), not written here only because dp rank 0
    writes it: a memory replica of this rank stands for dp rank 0's (checkpoint/replicas.py)."""

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)


def _logical_names(chunks: list[nn.Module], aliases: dict[int, str]) -> dict[int, tuple]:
    """id(param) -> (logical name, its ShardSpec or None, is an alias, the shard group's name),
    first name wins (tied)."""
    out: dict[int, tuple] = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters(remove_duplicate=False):
            if id(p) not in out:
                s = sharding_of(p)
                alias = aliases.get(id(p))
                out[id(p)] = (alias or name, s.spec, bool(alias), s.group.name if s.group is not None else None)
    return out


KINDS = {"master": "model", "exp_avg": "optim/exp_avg", "exp_avg_sq": "optim/exp_avg_sq"}


def training_state(chunks: list[nn.Module], engine, grid, aliases: dict[int, str] | None = None) -> list[LocalTensor]:
    """This rank's fp32 master weights and AdamW moments as slices of logical tensors.

    The data-parallel engine owns them as flat buffers (sharded over dp under ZeRO); its
    `owned_pieces` cuts them into rectangles of each (TP-local) parameter, and a TP shard's
    offset places those in the full tensor. With ZeRO >= 1 the dp ranks' pieces partition every
    tensor, so all of them write; with ZeRO 0 dp rank 0 writes. `aliases` maps a parameter that
    is a copy of another logical tensor (the last stage's copy of a tied embedding:
    "tok_embed.weight") to that name: it is loaded from it and never written."""
    names = _logical_names(chunks, aliases or {})
    out = []
    for part in engine.parts:  # dense + expert engines of an MoE model
        out += _engine_state(part, names, grid)
    return out


def _engine_state(engine, names: dict, grid) -> list[LocalTensor]:
    from threefold.distributed.data_parallel.state import owned_pieces

    shapes = {id(p): tuple(engine.layout.slots[i].shape) for i, p in enumerate(engine.params)}
    # Replicas of a slice: the engine's group (dp, or expert_dp for experts, which spans tp),
    # plus the TP ranks of a tensor the TP ranks all hold whole (when the group leaves tp out).
    tp_replicated = grid.tp.size > 1 and not set(grid.tp.ranks) <= set(engine.group.ranks)
    # Who writes a slice this rank holds: ranks are sums of coordinate x stride, so each replica
    # rule moves this rank by the offset to its group's first member (ZeRO 0: dp rank 0; a tensor
    # every TP rank holds whole: TP rank 0; the last stage's tied copy: the first stage's rank).
    me = grid.global_rank
    replica = engine.group.ranks[0] - me if engine.zero == 0 else 0
    tp_first = grid.tp.ranks[0] - me if tp_replicated else 0
    first_stage = grid.embed.ranks[0] - me if grid.embed is not None else 0
    out = []
    for piece in owned_pieces(engine):
        name, spec, alias, group = names[id(piece.param)]
        offsets = list(piece.offsets)
        if spec is None:
            full = shapes[id(piece.param)]
        else:
            full = tuple(spec.full_shape)
            offsets[spec.dim] += spec.start
        tp_sharded = spec is not None and group == "tp"
        ours = (tp_sharded or not tp_replicated or grid.tp_rank == 0) and not alias
        write = (engine.zero >= 1 or engine.group.rank == 0) and ours
        source = me + replica + (0 if tp_sharded else tp_first) + (first_stage if alias else 0)
        for kind, tensor in piece.tensors.items():
            out.append(
                LocalTensor(
                    f"{KINDS[kind]}/{name}", tensor, full, tuple(offsets), write, source, dp_replica=ours and not write
                )
            )
    return out


def model_tensors(chunks: list[nn.Module], aliases: dict[int, str] | None = None) -> list[LocalTensor]:
    """This rank's parameters as slices of the logical `model/` tensors, for loading weights
    without an optimizer (evaluation, generation). Nothing is written from these."""
    names = _logical_names(chunks, aliases or {})
    out, seen = [], set()
    for chunk in chunks:
        for p in chunk.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            name, spec = names[id(p)][:2]
            full, offsets = tuple(p.shape), [0] * p.dim()
            if spec is not None:
                full = tuple(spec.full_shape)
                offsets[spec.dim] += spec.start
            out.append(LocalTensor(f"model/{name}", p.data, full, tuple(offsets), False))
    return out
