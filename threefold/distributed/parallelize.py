"""Build this rank's part of the model: plain model -> parallelism applied -> materialized -> initialized.

The order is fixed (as in torchtitan):
  1. construct the plain model on the meta device (no memory);
  2. tensor/sequence parallelism swaps linears, embedding and loss for sharded ones; expert
     parallelism keeps this rank's experts and routes tokens to the others by all-to-all;
  2b. context parallelism swaps each attention core for the cp one and gives RoPE / learned
     positions this rank's global token positions (distributed/context_parallel/apply.py);
  3. activation recomputation wraps blocks (after TP, so a rerun repeats the TP collectives);
     train.compile then compiles each block, TP/EP/recompute modules kept eager (model/compile.py);
  4. materialize only this rank's shards, declare each parameter's sharding record once
     (model/sharding.py), re-tie tied weights, fill them with the layout-invariant initializer
     (with `defer_init`, ZeRO 3's: the trained parameters stay on the meta device with what
     their values will be, and the engine materializes them one unit at a time, so no rank
     ever holds its whole TP/PP-local model);
  5. seed the dropout generator for this rank's place in the grid.

A user model (model.arch "module:function", model/custom.py) takes the same steps, with its own
plan of module names turned into rows of tensor_parallel/apply.py's styles by `apply_user_plan`;
steps 3-5 are one function for both (`_finish`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from threefold.config import Config
from threefold.distributed.context_parallel.apply import apply_context_parallel
from threefold.distributed.expert_parallel import apply_expert_parallel
from threefold.distributed.grid import Grid
from threefold.distributed.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy
from threefold.distributed.tensor_parallel.apply import USER_STYLES, PlanContext, apply_plan
from threefold.distributed.tensor_parallel.mappings import scatter_to_sequence_region
from threefold.errors import ConfigError
from threefold.model import custom
from threefold.model.compile import compile_blocks
from threefold.model.meta import materialize, on_meta, tie_and_defer, tie_and_init
from threefold.model.recompute import apply_recompute, recompute_module
from threefold.model.sharding import declare
from threefold.model.transformer import Transformer


def build_model(
    cfg: Config,
    grid: Grid,
    device: torch.device,
    layer_ids: list[int] | None = None,
    first: bool = True,
    last: bool = True,
    defer_init: bool = False,
) -> nn.Module:
    """The whole model, or one pipeline chunk (its `layer_ids`, with the embedding if `first`
    and the head and loss if `last`). `defer_init`: leave the trained parameters on the meta
    device for the ZeRO-3 engine to materialize (model/meta.py: tie_and_defer)."""
    if custom.is_user_arch(cfg.model.arch):
        return build_user_model(cfg, grid, device, layer_ids, first, last)
    with on_meta():
        model = Transformer(cfg.model, layer_ids, first, last)
        apply_tensor_parallel(model, grid, cfg.parallel.sp, cfg.parallel.tp_comm_overlap)
        apply_expert_parallel(model, grid, cfg.model)
    # Off the meta device: the positions are real tensors; the core holds no parameters.
    apply_context_parallel(model, grid, cfg.parallel.cp_impl, cfg.model.seq_len, device)
    init_args = {"cfg": cfg.model, "seed": cfg.train.seed, "first": first, "last": last}
    if defer_init:
        initialize = partial(tie_and_defer, device=device, **init_args)
    else:
        initialize = partial(tie_and_init, **init_args)
    return _finish(model, cfg, grid, device, initialize, defer=defer_init)


def _finish(
    model: nn.Module,
    cfg: Config,
    grid: Grid,
    device: torch.device,
    initialize: Callable[[nn.Module], None],
    defer: bool = False,
    selective: tuple[str, ...] | None = None,
) -> nn.Module:
    """Steps 3-5 of every model, parallelism applied: recompute, compile, materialize, declare
    the shards, `initialize` them, seed dropout. `selective`: the module-name patterns a user
    model's train.recompute selective reruns (the built-in blocks' attention core otherwise)."""
    mode = cfg.train.recompute
    if mode == "selective" and selective is not None:  # validate_arch made sure the spec names them
        for name, module in list(model.named_modules()):
            if any(custom.matches(pattern, name) for pattern in selective):
                recompute_module(module)
    else:
        apply_recompute(model, mode, cfg.train.recompute_layers)
    if cfg.train.compile:  # after TP/EP/recompute: their modules stay outside the compiled code
        compile_blocks(model, cfg.train.compile_backend)
    materialize(model, device, defer=defer)
    declare(model, grid.tp)
    initialize(model)
    torch.manual_seed(dropout_seed(cfg.train.seed, grid, cfg.parallel.sp))
    return model


def dropout_seed(seed: int, grid: Grid, sp: bool) -> int:
    """Seed of the default generator, which only dropout draws from. TP ranks share it while
    they hold the same replicated activations (their masks must agree); under SP each rank holds
    different sequence rows, context-parallel and data-parallel ranks different tokens: those
    seeds differ."""
    key = f"{seed}/dropout/dp{grid.dp_rank}/pp{grid.pp_rank}/tp{grid.tp_rank if sp else 0}"
    if grid.cp.size > 1:  # cp ranks hold different tokens (the key without cp stays as it was)
        key += f"/cp{grid.cp_rank}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


def build_user_model(
    cfg: Config,
    grid: Grid,
    device: torch.device,
    layer_ids: list[int] | None = None,
    first: bool = True,
    last: bool = True,
    defer_init: bool = False,
) -> nn.Module:
    """build_model for a user model (model/custom.py). Under ZeRO 3 (`defer_init`) the chunk is
    materialized and filled here and the engine moves the values into its shards: the same
    values, with this rank's TP/PP-local model in memory once at start-up (the built-in
    model's initializer is the one the engine's deferred path knows)."""
    del defer_init
    spec, p = custom.spec_of(cfg.model), cfg.parallel
    with on_meta():
        par = custom.Parallel(grid.tp, p.sp, p.tp_comm_overlap)  # a composed model's factories take it
        model = custom.UserModel(spec, cfg.model, layer_ids, first, last, par)
        rules = custom.init_rules(model, spec, cfg.model)  # by logical name, before any swap
        if spec.composed:
            finish_composed(model, grid.tp, p.sp)
        else:
            apply_user_plan(model, spec, grid, p.sp, p.tp_comm_overlap)
    initialize = partial(custom.init_user_weights, rules=rules, seed=cfg.train.seed)
    return _finish(model, cfg, grid, device, initialize, selective=spec.selective)


def apply_user_plan(model: nn.Module, spec, grid: Grid, sp: bool, overlap: bool) -> nn.Module:
    """Swap the user's plain nn.Linear / nn.Embedding modules for threefold's TP layers by the
    spec's plan (on the meta device). column: out_features split, the input entering the region
    itself (one backward all-reduce per column layer); row: in_features split, output all-reduced
    (reduce-scattered under SP); vocab: a VocabParallelEmbedding, or for the head's linear
    vocabulary-split logits and the vocab-parallel loss; replicated: kept whole. Under SP the
    sequence is split after the embedding, and replicated parameters of blocks and head (norms,
    which then see seq/tp rows) get their gradients summed over tp. A no-op when tp is 1.
    The plan's strings become rows of tensor_parallel/apply.py's USER_STYLES, run by apply_plan
    (the built-in Transformer's interpreter)."""
    tp = grid.tp
    if tp.size == 1:
        return model
    for name, module in model.named_modules():
        _check_plan_entry(name, module, custom.style_of(spec, name))
    rows = tuple((pattern, USER_STYLES[style]) for pattern, style in spec.plan.items())
    apply_plan(model, rows, PlanContext(tp, sp, overlap, model))
    if sp:
        _sequence_parallel(model, tp)
    return model


def _check_plan_entry(name: str, module: nn.Module, style: str | None) -> None:
    """Every nn.Linear / nn.Embedding is planned, and each style gets a module it can replace."""
    linear, embedding = isinstance(module, nn.Linear), isinstance(module, nn.Embedding)
    if style is None and (linear or embedding):
        raise ConfigError(
            "model.arch",
            f"{name} ({type(module).__name__}) has no tensor-parallel plan entry",
            "valid: " + ", ".join(custom.PLAN_STYLES),
        )
    if style in ("column", "row"):
        fits, needs = linear, "an nn.Linear"
    elif style == "vocab":
        fits, needs = embedding or (linear and name.startswith("head.")), "an nn.Embedding or the head's nn.Linear"
    else:
        return
    if not fits:
        what = f"plan entry {style!r} for {name} ({type(module).__name__})"
        raise ConfigError("model.arch", what, f"it needs {needs}")


def finish_composed(model: nn.Module, tp, sp: bool) -> nn.Module:
    """A composed model built threefold's TP layers itself: its head's logits are split over the
    vocabulary (the vocab-parallel loss), and SP needs what apply_user_plan adds for it."""
    if tp.size == 1:
        return model
    model.loss_fn = partial(vocab_parallel_cross_entropy, group=tp)
    if sp:
        _sequence_parallel(model, tp)
    return model


def _sequence_parallel(model: nn.Module, tp) -> None:
    """The sequence split after the embedding, and the partial gradients of replicated
    parameters in blocks and head (norms on seq/tp rows) summed over tp."""
    if model.tok_embed is not None:
        model.embed_out = partial(scatter_to_sequence_region, group=tp)
    for part in [*model.layers.values(), model.head]:
        for module in part.modules() if part is not None else ():
            own = [n for n, _ in module.named_parameters(recurse=False)]
            if own and not hasattr(module, "shard_specs") and not hasattr(module, "tp_sum_grads"):
                module.tp_sum_grads = tuple(own)
