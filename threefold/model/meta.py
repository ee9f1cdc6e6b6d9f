"""Build a module on the meta device, give it real storage, fill it with the initializer.

Why not just `with torch.device("meta")` and `Module.to_empty`: on meta tensors the default
initializers (`nn.Linear`'s kaiming_uniform_, `nn.Embedding`'s normal_) and `empty_like` run
through torch's Python decompositions, whose first use imports the compiler stack (dynamo,
sympy): about 2.5 s of CPU per process, at every launch, for values nobody reads. The
layout-invariant initializer (`model.init.init_weights`) sets every value after
materialization anyway.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from threefold.config import ModelConfig
from threefold.model.init import init_weights
from threefold.model.transformer import Transformer

# Random or computed fills a module's constructor applies to its fresh parameters.
_INITIALIZERS = frozenset(
    {
        nn.init.normal_,
        nn.init.uniform_,
        nn.init.kaiming_uniform_,
        nn.init.kaiming_normal_,
        nn.init.trunc_normal_,
        nn.init.xavier_uniform_,
        nn.init.xavier_normal_,
        torch.Tensor.normal_,
        torch.Tensor.uniform_,
    }
)


class _SkipMetaInit(TorchFunctionMode):
    """Turns an initializer applied to a meta tensor into a no-op (meta tensors hold no values)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITIALIZERS:
            # nn.init passes the tensor by keyword, Tensor methods as self
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta():
    """Modules constructed inside get meta parameters and skip their default initializers."""
    with torch.device("meta"), _SkipMetaInit():
        yield


def materialize(module: nn.Module, device: torch.device | str) -> nn.Module:
    """`module.to_empty(device=device)`, allocating with `torch.empty` (see the module docstring).
    Parameters are re-created: re-tie tied weights afterwards."""
    return module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def tie_and_init(model: nn.Module, cfg: ModelConfig, seed: int, first: bool = True, last: bool = True) -> None:
    """Fill a materialized model (or pipeline chunk) with the layout-invariant initializer,
    re-tying a tied head first (materialize re-created the parameters). A last stage without
    the embedding holds its own copy of the tied weight: the same values."""
    tied = cfg.tie_embeddings
    if tied and first and last:
        model.head.weight = model.tok_embed.weight
    names = {"head.weight": "tok_embed.weight"} if tied and last and not first else None
    init_weights(model, cfg, seed, names)


def plain_model(
    cfg: ModelConfig,
    seed: int,
    device: torch.device | str,
    layer_ids: list[int] | None = None,
    first: bool = True,
    last: bool = True,
) -> Transformer:
    """The model (or one pipeline chunk) without any parallelism, initialized as every layout
    is: what the PyTorch-native peers of the benchmarks start from."""
    with on_meta():
        model = Transformer(cfg, layer_ids, first, last)
    materialize(model, device)
    tie_and_init(model, cfg, seed, first, last)
    return model
