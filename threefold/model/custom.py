"""Your own model: plain torch modules, a tensor-parallel plan by module name, and the adapter
that makes them a threefold model (whole, or one pipeline chunk).

A user module `mypkg/mymodel.py` defines `build(cfg: ModelConfig) -> ModelSpec`; the run names
it with `--model.arch mypkg.mymodel:build` (or `path/to/file.py:build`). The spec gives three
factories, so a pipeline chunk constructs only its own pieces, on the meta device:

    embed()   tokens [seq, batch] -> hidden [seq, batch, hidden]      (the first stage)
    block(i)  hidden -> hidden, for i in range(cfg.layers)             (cut into stages)
    head()    hidden -> logits [seq, batch, vocab], final norm inside  (the last stage)

Inside the chunk they sit at `tok_embed`, `layers.<i>` and `head`, the names the plan, the
initializer and checkpoints use in every layout (as the built-in Transformer's do).
Activations are [seq, batch, hidden] because sequence parallelism and the pipeline's wire
split and send dimension 0 (model/layers.py). Attention must take its shapes from the projected
tensors (`s, b = q.shape[:2]; q.view(s, b, -1, head_dim)`): under TP a rank holds heads/tp of
the heads, and under SP a block's input holds seq/tp rows while the projections see them all.

FLOPs (model/flops.py for a user arch): threefold counts them, per token and block, as
2 x (weights of the block's nn.Linear modules) + the causal attention term 4·heads·head_dim·s_eff
from model.heads and model.hidden (as for the built-in blocks); the head adds 2·hidden·vocab;
training is 3 x forward. Parameters are counted from the modules themselves.

The compose-the-layers route: with `composed=True` the factories take a `Parallel` last
(embed(par), block(i, par), head(par)) and build threefold's ColumnParallelLinear /
RowParallelLinear / VocabParallelEmbedding themselves over `par.tp`; no plan is applied. The
head then returns vocabulary-split logits (a ColumnParallelLinear) and the loss is the
vocab-parallel one.

This file holds no process group of its own: distributed/parallelize.py applies the plan.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from threefold.config import ModelConfig
from threefold.errors import ConfigError
from threefold.model.init import normal_shard
from threefold.model.sharding import sharding_of
from threefold.model.transformer import cross_entropy_sum

BUILTIN_ARCHS = ("llama", "gpt2")
PLAN_STYLES = ("column", "row", "vocab", "replicated")


@dataclass
class ModelSpec:
    """What threefold needs of a user model; `build(cfg)` returns one."""

    embed: Callable[..., nn.Module]
    """embed() (composed: embed(par)) -> a new module: tokens [seq, batch] -> hidden [seq, batch, hidden]."""
    block: Callable[..., nn.Module]
    """block(i) (composed: block(i, par)) -> a new block: hidden [seq, batch, hidden] -> the same shape."""
    head: Callable[..., nn.Module]
    """head() (composed: head(par)) -> a new head: hidden -> logits [seq, batch, vocab], final norm inside."""
    plan: dict[str, str] = field(default_factory=dict)
    """Module-name pattern ('*' is one name) -> column | row | vocab | replicated; the first match wins."""
    init: Callable[[str, tuple[int, ...]], object] | None = None
    """(logical parameter name, full shape) -> std | "zeros" | "ones" | None (default rule)."""
    selective: tuple[str, ...] = ()
    """Module-name patterns that train.recompute selective reruns in backward (e.g. 'layers.*.attn.core')."""
    composed: bool = False
    """The factories take a Parallel last and build threefold's TP layers themselves (no plan)."""


@dataclass(frozen=True)
class Parallel:
    """What a composed model's factories build threefold's TP layers with."""

    tp: Any
    """The tensor-parallel group (grid.tp; size 1 without tensor parallelism)."""
    sp: bool = False
    """Sequence parallelism: the `sp` of every column/row-parallel layer."""
    overlap: bool = False
    """parallel.tp_comm_overlap: the `overlap` of the column-parallel layers."""


# Counting a composed model on the meta device needs no process group: the unsharded shapes.
UNSHARDED = Parallel(SimpleNamespace(size=1, rank=0, name="tp"))


def is_user_arch(arch: str) -> bool:
    """`module:function` (or `file.py:function`) rather than a built-in architecture."""
    return ":" in arch


def arch_of(build: Callable | str) -> str:
    """The model.arch string naming `build`: "module:function", or "file.py:function" for a
    function of a script run as __main__ (the workers import it by path)."""
    if isinstance(build, str):
        return build
    module, name = build.__module__, build.__qualname__
    if "<" in name:
        raise ValueError(f"{name} is not importable by name: define the model's build function at module level")
    if module == "__main__":
        module = str(Path(sys.modules["__main__"].__file__).resolve())
    return f"{module}:{name}"


@functools.lru_cache(maxsize=16)
def resolve(arch: str) -> Callable[[ModelConfig], ModelSpec]:
    """The build function `arch` names; one ConfigError line when it cannot be imported."""
    module_name, _, attr = arch.rpartition(":")
    valid = "valid: llama, gpt2, or module:function returning a threefold.ModelSpec"
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ConfigError("model.arch", f"{arch!r}: file {path} does not exist", valid)
            spec = importlib.util.spec_from_file_location(f"threefold_user_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ConfigError:
        raise
    except Exception as err:  # the user's module: any import-time failure is theirs to see in one line
        first = (str(err).splitlines() or [""])[0]
        raise ConfigError(
            "model.arch", f"{arch!r}: cannot import {module_name}: {type(err).__name__}: {first}", valid
        ) from None
    build = getattr(module, attr, None)
    if not callable(build):
        raise ConfigError("model.arch", f"{arch!r}: {module_name} has no function {attr!r}", valid)
    return build


def spec_of(cfg: ModelConfig) -> ModelSpec:
    """The user's ModelSpec for this model config (build(cfg) called once per config)."""
    try:
        spec = resolve(cfg.arch)(cfg)
    except ConfigError:
        raise
    except Exception as err:  # the user's build function: one line naming it, not a traceback
        first = (str(err).splitlines() or [""])[0]
        raise ConfigError("model.arch", f"{cfg.arch}(cfg) failed: {type(err).__name__}: {first}") from None
    if not isinstance(spec, ModelSpec):
        raise ConfigError("model.arch", f"{cfg.arch!r} returned {type(spec).__name__}, not a threefold.ModelSpec")
    for pattern, style in spec.plan.items():
        if style not in PLAN_STYLES:
            raise ConfigError("model.arch", f"plan entry {pattern!r}: {style!r}", "valid: " + ", ".join(PLAN_STYLES))
    return spec


def matches(pattern: str, name: str) -> bool:
    """A dotted name against a pattern whose parts are fnmatch patterns of one name each."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatchcase(n, p) for p, n in zip(parts, names))


def first_match(rows, name: str):
    """The value of the first (pattern, value) row whose pattern matches `name`, or None: how a
    plan picks a module's style (a user plan's strings here, TP_PLAN's functions in
    distributed/tensor_parallel/apply.py)."""
    return next((value for pattern, value in rows if matches(pattern, name)), None)


def style_of(spec: ModelSpec, name: str) -> str | None:
    return first_match(spec.plan.items(), name)


class UserModel(nn.Module):
    """A user model, or one pipeline chunk of it (blocks `layer_ids`, the embedding if `first`,
    the head and loss if `last`), with the attributes threefold's stage, engine and checkpoint
    code read: tok_embed, layers (a ModuleDict keyed by global index), head, loss_fn."""

    def __init__(
        self, spec: ModelSpec, cfg: ModelConfig, layer_ids=None, first: bool = True, last: bool = True, par=None
    ):
        super().__init__()
        layer_ids = list(range(cfg.layers) if layer_ids is None else layer_ids)
        self.first, self.last = first, last
        extra = (par or UNSHARDED,) if spec.composed else ()  # what a composed model's factories take
        self.tok_embed = spec.embed(*extra) if first else None
        self.layers = nn.ModuleDict({str(i): spec.block(i, *extra) for i in layer_ids})
        self.head = spec.head(*extra) if last else None
        # Tensor parallelism swaps these (vocab-parallel loss; the SP scatter after the embedding).
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum
        self.embed_out: Callable[[torch.Tensor], torch.Tensor] = _identity

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """As Transformer.forward: tokens [batch, seq] in on the first stage, hidden
        [seq, batch, hidden] elsewhere; the last stage returns the summed loss (or logits)."""
        if self.first:
            x = self.embed_out(self.tok_embed(x.t()))
        for block in self.layers.values():
            x = block(x)
        if not self.last:
            return x
        logits = self.head(x)
        return logits if targets is None else self.loss_fn(logits, targets.t())


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


# --- initialization ------------------------------------------------------------------------------


def init_rules(model: nn.Module, spec: ModelSpec, cfg: ModelConfig) -> dict[str, tuple[str, float]]:
    """(kind, std) of every parameter of the plain (not yet parallel) chunk by its logical name.
    Default: Linear/Embedding weights normal(init_std), those a "row" plan entry names
    init_std/sqrt(2·layers) (GPT-2's residual scaling), biases zeros, other weights (norms) ones."""
    rules = {}
    for mod_name, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            name = f"{mod_name}.{leaf}" if mod_name else leaf
            chosen = spec.init(name, tuple(param.shape)) if spec.init is not None else None
            rules[name] = _rule(name, chosen) if chosen is not None else _default_rule(name, leaf, module, spec, cfg)
    return rules


def _rule(name: str, chosen) -> tuple[str, float]:
    if chosen in ("zeros", "ones"):
        return chosen, 0.0
    if isinstance(chosen, (int, float)) and not isinstance(chosen, bool) and chosen >= 0:
        return "normal", float(chosen)
    raise ConfigError("model.arch", f"init of {name}: {chosen!r}", 'valid: a std >= 0, "zeros", "ones" or None')


def _default_rule(name: str, leaf: str, module: nn.Module, spec: ModelSpec, cfg: ModelConfig) -> tuple[str, float]:
    if leaf == "bias":
        return "zeros", 0.0
    specs = module.__dict__.get("shard_specs", {})  # a threefold TP layer (the compose route)
    if isinstance(module, (nn.Linear, nn.Embedding)) or leaf in specs:
        # Row-parallel: split along its input (a composed RowParallelLinear), or planned "row".
        scaled = style_of(spec, name.rpartition(".")[0]) == "row" or (leaf in specs and specs[leaf].dim == 1)
        return "normal", cfg.init_std / math.sqrt(2 * cfg.layers) if scaled else cfg.init_std
    return "ones", 0.0


@torch.no_grad()
def init_user_weights(model: nn.Module, rules: dict[str, tuple[str, float]], seed: int) -> None:
    """Fill every (materialized) parameter: normal draws come from model/init.py's row-block
    generators seeded by (seed, logical name), sliced to this rank's shard, so every layout
    holds the same values as the single-process model."""
    for name, param in model.named_parameters():
        kind, std = rules[name]
        if kind != "normal":
            param.fill_(0.0 if kind == "zeros" else 1.0)
            continue
        spec = sharding_of(param).spec
        if spec is None:
            values = normal_shard(name, tuple(param.shape), std, seed)
        else:
            values = normal_shard(name, spec.full_shape, std, seed, spec.dim, spec.start, spec.length)
        param.copy_(values)


# --- counting (model/flops.py for a user arch) -----------------------------------------------


@dataclass(frozen=True)
class UserCounts:
    """Numbers of a user model that the FLOPs and memory accounting need."""

    matmul_weights_per_layer: float
    """Mean over blocks of the weights of a block's linear layers (2 FLOPs each per token)."""
    total_params: int
    """Every parameter: embedding, blocks and head."""


def _key(cfg) -> tuple:
    values = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(vars(cfg))
    return tuple(sorted(values.items()))


def counts(cfg) -> UserCounts:
    """Count the user model `cfg` describes (built on the meta device: no memory)."""
    return _counts(_key(cfg))


@functools.lru_cache(maxsize=64)
def _counts(key: tuple) -> UserCounts:
    from threefold.model.meta import on_meta

    values = dict(key)
    cfg = ModelConfig(**{f.name: values[f.name] for f in dataclasses.fields(ModelConfig) if f.name in values})
    with on_meta():
        model = UserModel(spec_of(cfg), cfg)
    matmul = sum(m.in_features * m.out_features for b in model.layers.values() for m in b.modules() if _is_linear(m))
    total = sum(p.numel() for p in model.parameters())
    return UserCounts(matmul / max(1, cfg.layers), total)


def _is_linear(module: nn.Module) -> bool:
    """nn.Linear, or a threefold column/row-parallel linear (unsharded here: counted whole)."""
    return isinstance(module, nn.Linear) or ("shard_specs" in module.__dict__ and hasattr(module, "in_features"))
