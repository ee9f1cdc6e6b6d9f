"""Activation recomputation as a model transform (train.recompute, Korthikanti et al. 2022).

    none       keep every activation autograd saves
    selective  recompute the attention core (softmax(QK^T)V) in backward where it materializes
               the scores (SDPA's math kernel): the 5as^2b term of the paper. A fused core
               (flash, efficient, cuDNN) saves no s x s tensor, only q, k, v, its output and the
               log-sum-exp; rerunning it would drop the log-sum-exp (1/head_dim of q) for one
               more attention forward, so it runs once. Its neighbours are no better: the
               projections' outputs are the very q, k, v the fused core keeps for backward, so
               recomputing them frees nothing (docs/tensor_parallel.md, Recomputation)
    full       keep only each block's input and rerun the whole block in backward; with
               train.recompute_layers N > 0 only the first N blocks of the stage, the rest keep
               everything (Megatron's "block" method: trade memory for compute in steps)

Checkpointing is torch.utils.checkpoint without reentrancy; it stashes the CPU and device RNG
states and restores them for the rerun, so dropout draws the same masks and the losses equal
those of recompute none. The module's forward is wrapped in place, so parameter names (and
therefore init and checkpoints) do not change. Note that the rerun of a tensor-parallel block
repeats its forward collectives in backward (accounted for in docs/tensor_parallel.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextvars import ContextVar

from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "selective", "full")

# True while checkpointing reruns a forward in backward: layers that count what they see (MoE
# routing statistics) must not count it twice. A context variable, so it is scoped to the rerun.
_RECOMPUTING: ContextVar[bool] = ContextVar("threefold_recomputing", default=False)


def is_recomputing() -> bool:
    return _RECOMPUTING.get()


@contextlib.contextmanager
def _rerun():
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


def _contexts():
    return contextlib.nullcontext(), _rerun()


def recompute_module(module: nn.Module, when: Callable[..., bool] | None = None) -> nn.Module:
    """Make `module` save only its inputs and recompute its internals during backward.

    `when`, if given, is asked with each call's arguments whether that call is worth
    checkpointing; a call it declines runs plainly (autograd saves what it saves).
    `module.spans`, when set to a span recorder (threefold.observe), times the reruns as
    "recompute": a call of `inner` outside forward() is checkpoint's rerun in backward."""
    # Looked up at each call, so train.compile can swap in the compiled forward (model/compile.py).
    module.recompute_inner = module.forward
    in_forward = [False]

    def run(*args, **kwargs):
        if in_forward[0] or module.spans is None:
            return module.recompute_inner(*args, **kwargs)
        with module.spans.span("recompute"):
            return module.recompute_inner(*args, **kwargs)

    def forward(*args, **kwargs):
        if when is not None and not when(*args, **kwargs):
            return module.recompute_inner(*args, **kwargs)
        in_forward[0] = True
        try:
            return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_contexts, **kwargs)
        finally:
            in_forward[0] = False

    module.forward = forward
    module.recomputed = True
    module.spans = None
    return module


def apply_recompute(model: nn.Module, mode: str, layers: int = 0) -> nn.Module:
    """Wrap the blocks of `model` (a Transformer or a pipeline stage of one) for `mode`."""
    if mode not in MODES:
        raise ValueError(f"recompute mode {mode!r} (valid: {', '.join(MODES)})")
    blocks = list(model.layers.values())
    if mode == "selective":
        for block in blocks:
            # A core that can say whether a call materializes its scores (AttentionCore) is
            # rerun only then; any other (context parallel, a user model's) always.
            core = block.attn.core
            recompute_module(core, when=getattr(core, "materializes_scores", None))
    elif mode == "full":
        for block in blocks[: layers or len(blocks)]:
            recompute_module(block)
    return model
