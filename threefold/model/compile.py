"""train.compile: torch.compile each transformer block, the parallel plumbing kept outside.

The unit is the block (as torchtitan's per-block compile), not the pipeline stage: what is
compiled is each block's forward, never its __call__, so the hooks on a block (ZeRO-3's gather
before it, its free after it and the gather before its backward) run eagerly around the compiled
code, and the pipeline's sends and receives happen between blocks of different chunks.

Inside a block, whatever parallelism swapped in stays eager, and dynamo breaks the graph around
it (torch.compiler.disable): a module of threefold.distributed (column/row-parallel linears and
the region's overlapped backward, head-slice projections), the hooks of a module (the TP
region's entry is a forward pre-hook), an MoE layer (host-synced split sizes, the expert
all-to-all, routing statistics) and a selectively recomputed attention core (checkpoint's
stashed RNG and rerun flag). A zero-bubble weight-gradient store is eager inside Linear itself
(model/layers.py), since the pipeline attaches it after the model is built. With tp = ep = 1,
no MoE and no selective recompute a block is therefore one graph. Under full recompute the
block's inner forward is what checkpoint calls, so its rerun in backward replays compiled code.

Dynamo inlines nn.Modules, so parameters are graph inputs: blocks of one shape share one
compiled graph (the first call compiles it; later blocks and steps only check its guards),
and ZeRO's parameter views and storage resizing stay visible to it.
"""

from __future__ import annotations

import torch
from torch import nn

from threefold.model.layers import mark_for_compile
from threefold.model.moe import MoE


def _is_plumbing(module: nn.Module) -> bool:
    """Modules that must run eagerly inside a compiled block (module docstring)."""
    return (
        type(module).__module__.startswith("threefold.distributed.")
        or isinstance(module, MoE)
        or getattr(module, "recomputed", False)
    )


def _keep_eager(module: nn.Module) -> None:
    """Make dynamo run `module`'s forward and hooks without tracing them (a graph break)."""
    module.forward = torch.compiler.disable(module.forward)
    # Hooks run inside the module's __call__, which dynamo inlines: disable each one too.
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key, hook in list(hooks.items()):
            hooks[key] = torch.compiler.disable(hook)


def compile_blocks(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """Compile every block of `model` (a Transformer or a pipeline chunk of one) in place; call
    after tensor/expert parallelism and recomputation are applied (their modules must exist).
    Parameter names do not change, so initialization and checkpoints are unaffected."""
    mark_for_compile()
    for block in model.layers.values():
        eager = set()
        for name, module in block.named_modules():
            if not name or any(name.startswith(prefix + ".") for prefix in eager):
                continue  # the block itself, or inside a module already kept eager
            if _is_plumbing(module) or module._forward_pre_hooks or module._forward_hooks:
                _keep_eager(module)
                eager.add(name)
        if getattr(block, "recomputed", False):  # full recompute: compile what checkpoint reruns
            block.recompute_inner = torch.compile(block.recompute_inner, backend=backend)
        else:
            block.forward = torch.compile(block.forward, backend=backend)
        block.compiled = True
    return model
