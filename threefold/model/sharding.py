"""What each parameter is of the logical (unsharded) tensor, declared once per parameter.

Parallelism modules describe their own shards where they create them: a tensor-parallel or
expert-parallel module lists `shard_specs` {parameter name: ShardSpec} and the group it is
split over in `shard_group`; a module whose replicated parameters get only partial gradients
on each tensor-parallel rank (a norm under sequence parallelism, a shared kv projection, an
MoE router) lists their names in `tp_sum_grads`. `declare(model, tp)` turns those module
annotations into one typed record on every parameter, once the model is materialized, and
everything downstream — the initializer, the gradient finalization and norm, checkpoint
naming — reads that record through `sharding_of(param)`, never the modules again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class ShardSpec:
    """This rank holds full[start:start+length] along `dim` of a tensor of `full_shape`;
    `replicas` ranks of the shard group hold this same slice (GQA kv heads when kv_heads < tp)."""

    dim: int
    start: int
    length: int
    full_shape: tuple[int, ...]
    replicas: int = 1


@dataclass(frozen=True)
class Sharding:
    """A parameter's place in the logical model."""

    spec: ShardSpec | None = None
    """This rank's slice of the logical tensor (None: the whole tensor)."""
    group: Any = None
    """The group the tensor is split over (threefold.distributed.comm.Group: tp, or ep for experts)."""
    partial: Any = None
    """The group whose ranks each hold a partial sum of this parameter's gradient (tp), or None."""

    @property
    def split(self) -> bool:
        """Whether other ranks hold other slices (the squared norm sums over `group`)."""
        return self.spec is not None and self.group is not None and self.group.size > 1


REPLICATED = Sharding()
_ATTR = "_threefold_sharding"


def declare(model: nn.Module, tp=None) -> None:
    """Attach the record of every parameter of `model` from its modules' annotations; `tp` is
    the tensor-parallel group partial gradients are summed over. Call after materializing
    (materialization creates new parameter objects)."""
    for module in model.modules():
        specs, group = module.__dict__.get("shard_specs", {}), module.__dict__.get("shard_group")
        partial = set(module.__dict__.get("tp_sum_grads", ()))
        for name, param in module.named_parameters(recurse=False):
            record = Sharding(
                specs.get(name),
                group if name in specs else None,
                tp if name in partial and tp is not None and tp.size > 1 else None,
            )
            if record != REPLICATED or not hasattr(param, _ATTR):  # a tied weight keeps its first record
                setattr(param, _ATTR, record)


def sharding_of(param: nn.Parameter) -> Sharding:
    """The record `declare` attached (replicated for a parameter of a plain model)."""
    return getattr(param, _ATTR, REPLICATED)


def partial_params(modules) -> list[nn.Parameter]:
    """Parameters (each once) whose gradient is a partial sum over a group, in module order."""
    out, seen = [], set()
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen and p.requires_grad and sharding_of(p).partial is not None:
                seen.add(id(p))
                out.append(p)
    return out
