"""Build a module on the meta device, give it real storage, fill it with the initializer.

Why not just `with torch.device("meta")` and `Module.to_empty`: on meta tensors the default
initializers (`nn.Linear`'s kaiming_uniform_, `nn.Embedding`'s normal_) and `empty_like` run
through torch's Python decompositions, whose first use imports the compiler stack (dynamo,
sympy): about 2.5 s of CPU per process, at every launch, for values nobody reads. The
layout-invariant initializer (`model.init.init_weights`) sets every value after
materialization anyway.

Deferred initialization (ZeRO 3): `materialize(defer=True)` + `tie_and_defer` leave every
trained parameter on the meta device, with a record of how to compute its initial value. Whoever gives it storage (the
ZeRO-3 engine, one unit at a time, straight into that unit's bucket) calls `initial_value`
and `adopt`; the values are those `tie_and_init` would have written, so no layout changes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from threefold.config import ModelConfig
from threefold.model.init import init_weights, initial_values
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


def materialize(module: nn.Module, device: torch.device | str, defer: bool = False) -> nn.Module:
    """`module.to_empty(device=device)`, allocating with `torch.empty` (see the module docstring).
    Parameters are re-created: re-tie tied weights afterwards. `defer`: trained parameters stay
    on the meta device, the very objects (see tie_and_defer)."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        if defer and _trained(t):
            return t
        return torch.empty(t.shape, dtype=t.dtype, device=device)

    return module._apply(empty)


def _tie(model: nn.Module, cfg: ModelConfig, first: bool, last: bool) -> dict[str, str] | None:
    """Tie the head to the embedding when both are here; the logical names of a last stage's
    own copy of the tied weight (the same values as the embedding)."""
    tied = cfg.tie_embeddings
    if tied and first and last:
        model.head.weight = model.tok_embed.weight
    return {"head.weight": "tok_embed.weight"} if tied and last and not first else None


def tie_and_init(model: nn.Module, cfg: ModelConfig, seed: int, first: bool = True, last: bool = True) -> None:
    """Fill a materialized model (or pipeline chunk) with the layout-invariant initializer,
    re-tying a tied head first (materialize re-created the parameters). A last stage without
    the embedding holds its own copy of the tied weight: the same values."""
    init_weights(model, cfg, seed, _tie(model, cfg, first, last))


@dataclass(frozen=True)
class DeferredInit:
    """How a meta parameter gets its initial value (model.init.initial_values) and where."""

    name: str  # its logical name
    cfg: ModelConfig
    seed: int
    device: torch.device


_DEFERRED = "_threefold_deferred_init"


def tie_and_defer(
    model: nn.Module, cfg: ModelConfig, seed: int, device: torch.device | str, first: bool = True, last: bool = True
) -> None:
    """tie_and_init for a model materialized with `defer`: the parameters that have storage are
    filled, each trained one left on meta gets its DeferredInit (its values for `device`)."""
    names = _tie(model, cfg, first, last) or {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            logical = names.get(name, name)
            if _trained(param):
                setattr(param, _DEFERRED, DeferredInit(logical, cfg, seed, torch.device(device)))
            else:
                param.copy_(initial_values(logical, param, cfg, seed))


def _trained(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) and t.requires_grad and t.is_meta


def deferred(param: torch.Tensor) -> DeferredInit | None:
    """The DeferredInit of a parameter `defer_init` left on meta (None: it has storage)."""
    return getattr(param, _DEFERRED, None) if param.is_meta else None


def initial_value(param: torch.Tensor) -> torch.Tensor:
    """A deferred parameter's initial value: a new fp32 CPU tensor of its shape."""
    return initial_values(deferred(param).name, param, deferred(param).cfg, deferred(param).seed)


def adopt(param: nn.Parameter, data: torch.Tensor) -> None:
    """Make the meta `param` a parameter over `data` (same shape), as `param.data = data`
    would, in place: the object, its attributes (sharding record) and every reference to it
    stay valid. `.data =` cannot change a tensor's device type, so swap_tensors moves the
    object onto `data`'s device first; `.data =` then keeps the parameter's own version
    counter (a view's would be bumped by every in-place write to the bucket, e.g. a ZeRO-3
    all-gather, and autograd would refuse the tensors it saved)."""
    if tuple(data.shape) != tuple(param.shape):
        raise RuntimeError(f"adopt: data {tuple(data.shape)} != parameter {tuple(param.shape)}")
    new = nn.Parameter(torch.empty(0, dtype=data.dtype, device=data.device), requires_grad=param.requires_grad)
    new.__dict__.update({k: v for k, v in param.__dict__.items() if k != _DEFERRED})
    torch.utils.swap_tensors(param, new)
    param.data = data


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
