"""Apply tensor (and sequence) parallelism to a plain Transformer: a plan of module names.

Per block (Megatron's layout; activations [seq, batch, hidden]):

    x -> norm -> ENTER -> wq/wk/wv (column) -> attention on heads/tp -> wo (row) -> LEAVE -> + x
    x -> norm -> ENTER -> w1/w3 (column)   -> SwiGLU on ffn/tp       -> w2 (row) -> LEAVE -> + x

ENTER is one collective shared by the sibling projections (installed as a forward pre-hook on
the attention / MLP module, the way DTensor's PrepareModuleInput works): identity forward and
all-reduce backward without SP; all-gather over the sequence forward and reduce-scatter
backward with SP (tensor_parallel/region.py; with overlap the projections' dW matmuls run
while that collective is in flight). LEAVE lives in the row-parallel linear: all-reduce, or
reduce-scatter under SP. How many collectives each block, the vocab-parallel ends and the loss
make per micro-batch, by pass, and what full recompute repeats, is one table:
distributed/tp_collectives.py (the planner and the volume tests read it too). Under SP
everything between LEAVE and the next ENTER (norms, dropout, residual adds) runs on seq/tp
rows, so those activations shrink by tp too (Korthikanti et al. 2022).

`TP_PLAN` says what each module of the plain model becomes, by name pattern ('*' is one name:
a layer index); `apply_plan` interprets any such table, so a model of another shape brings its
own (a user model's plan of strings, model/custom.py, becomes rows of `USER_STYLES`, run by
distributed/parallelize.py). Parameter names stay those of the plain model, so initialization
and checkpoints do not depend on the layout. GQA: with kv_heads >= tp the kv heads are split
like the query heads; with kv_heads < tp every rank keeps wk/wv whole and uses the kv head
serving its query heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from torch import nn

from threefold.distributed.grid import Grid, Group
from threefold.distributed.tensor_parallel.layers import (
    ColumnParallelLinear,
    HeadSliceLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from threefold.distributed.tensor_parallel.mappings import (
    all_gather_dim0,
    gather_to_replicated,
    scatter_to_sequence_region,
)
from threefold.distributed.tensor_parallel.region import enter
from threefold.model.custom import first_match
from threefold.model.moe import MoE


@dataclass(frozen=True)
class PlanContext:
    """What a plan's styles need besides the module: the group, the switches, the whole model."""

    tp: Group
    sp: bool
    overlap: bool
    model: nn.Module
    tied: bool = False
    """The plain model's head shares the embedding's weight."""


Style = Callable[[nn.Module, PlanContext], "nn.Module | None"]
"""A module -> its replacement (None: changed in place)."""


class EnterRegion:
    """Forward pre-hook: the module's input enters the tensor-parallel region once, for every
    column-parallel child (their weights are the ones whose dW may overlap the collective)."""

    def __init__(self, group: Group, sp: bool, overlap: bool):
        self.group, self.sp, self.overlap = group, sp, overlap

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        weights = tuple(c.weight for c in module.children() if isinstance(c, ColumnParallelLinear))
        return (enter(args[0], self.group, self.sp, self.overlap, weights), *args[1:])

    def __repr__(self) -> str:
        return f"EnterRegion({'all-gather seq' if self.sp else 'copy'}, {self.group.name}, overlap={self.overlap})"


# --- styles ------------------------------------------------------------------------------------


def entry(module: nn.Module, ctx: PlanContext) -> None:
    module.register_forward_pre_hook(EnterRegion(ctx.tp, ctx.sp, ctx.overlap))


def column(linear: nn.Linear, ctx: PlanContext, enter: bool = False) -> ColumnParallelLinear:
    """`enter`: the layer's input enters the region itself (one collective per layer), where no
    parent's `entry` does it once for the sibling projections."""
    bias = linear.bias is not None
    return ColumnParallelLinear(
        linear.in_features, linear.out_features, ctx.tp, bias=bias, sp=ctx.sp, enter=enter, overlap=ctx.overlap
    )


def row(linear: nn.Linear, ctx: PlanContext) -> RowParallelLinear:
    return RowParallelLinear(linear.in_features, linear.out_features, ctx.tp, bias=linear.bias is not None, sp=ctx.sp)


def kv_column(linear: nn.Linear, ctx: PlanContext, head_dim: int) -> nn.Module:
    """wk/wv: split with the heads, or when kv_heads < tp kept whole, this rank using the kv head
    that serves its query heads (tp/kv_heads consecutive ranks share one)."""
    kv_heads, t = linear.out_features // head_dim, ctx.tp.size
    if kv_heads % t == 0:
        return column(linear, ctx)
    start = (ctx.tp.rank // (t // kv_heads)) * head_dim
    return HeadSliceLinear(linear.in_features, linear.out_features, start, head_dim, bias=linear.bias is not None)


def attention(attn: nn.Module, ctx: PlanContext) -> None:
    """The entry, and wk/wv by their head count (a style that needs the module's head size)."""
    entry(attn, ctx)
    attn.wk, attn.wv = (kv_column(w, ctx, attn.head_dim) for w in (attn.wk, attn.wv))


def mlp(module: nn.Module, ctx: PlanContext) -> None:
    """A dense MLP enters the region; an MoE layer keeps its experts whole and lets the TP ranks
    split the micro-batch's tokens instead (under SP they arrive split; otherwise each rank takes
    its slice of the sequence and the outputs are gathered back). The router's gradient is then a
    partial sum over tp, summed like a norm's; the experts' are summed by their own
    data-parallel group, which spans tp (grid.expert_dp)."""
    if not isinstance(module, MoE):
        return entry(module, ctx)
    module.token_ranks, module.token_rank = ctx.tp.size, ctx.tp.rank
    module.gather_counts = partial(_stacked, group=ctx.tp)
    if not ctx.sp:
        module.split_tokens = partial(scatter_to_sequence_region, group=ctx.tp)
        module.gather_tokens = partial(gather_to_replicated, group=ctx.tp)
    module.router.tp_sum_grads = ("weight",)
    return None


def _stacked(x, group: Group):
    """[ranks, *x.shape]: every TP rank's `x` (routing counts; no gradient)."""
    return all_gather_dim0(x.unsqueeze(0), group)


def sequence_norm(norm: nn.Module, ctx: PlanContext) -> None:
    """Under SP each rank normalizes its own rows: the weight (and bias) gradient is a partial sum."""
    if ctx.sp:
        norm.tp_sum_grads = tuple(name for name, _ in norm.named_parameters(recurse=False))


def vocab_embedding(old: nn.Embedding, ctx: PlanContext) -> VocabParallelEmbedding:
    """A GPT-2 position table is added to the full sequence first, then split (no traffic);
    otherwise the embedding's partial sums are reduce-scattered straight into the shards."""
    scatter = ctx.sp and ctx.model.pos_embed is None
    if ctx.sp and not scatter:
        ctx.model.embed_out = partial(scatter_to_sequence_region, group=ctx.tp)
    return VocabParallelEmbedding(old.num_embeddings, old.embedding_dim, ctx.tp, scatter=scatter)


def vocab_head(old: nn.Linear, ctx: PlanContext) -> ColumnParallelLinear:
    """The logits stay split over the vocabulary: the loss never gathers them. A tied head shares
    the (already parallel) embedding's weight."""
    model, bias = ctx.model, old.bias is not None
    head = ColumnParallelLinear(
        old.in_features, old.out_features, ctx.tp, bias=bias, sp=ctx.sp, enter=True, overlap=ctx.overlap
    )
    if ctx.tied and model.tok_embed is not None:
        head.weight = model.tok_embed.weight
    model.loss_fn = partial(vocab_parallel_cross_entropy, group=ctx.tp)
    return head


# Names of the plain model (model/transformer.py, model/moe.py), in module order: a parent's
# style runs before its children are replaced.
TP_PLAN: tuple[tuple[str, Style], ...] = (
    ("tok_embed", vocab_embedding),
    ("layers.*.attn_norm", sequence_norm),
    ("layers.*.attn", attention),
    ("layers.*.attn.wq", column),
    ("layers.*.attn.wo", row),
    ("layers.*.mlp_norm", sequence_norm),
    ("layers.*.mlp", mlp),
    ("layers.*.mlp.w1", column),
    ("layers.*.mlp.w3", column),
    ("layers.*.mlp.w2", row),
    ("layers.*.mlp.shared", entry),  # an MoE layer's shared expert is a tensor-parallel MLP
    ("layers.*.mlp.shared.w1", column),
    ("layers.*.mlp.shared.w3", column),
    ("layers.*.mlp.shared.w2", row),
    ("norm", sequence_norm),
    ("head", vocab_head),
)


def vocab(module: nn.Module, ctx: PlanContext) -> nn.Module:
    """A user plan's "vocab": an embedding split over the vocabulary, its partial rows
    all-reduced (the user model splits the sequence after its whole embed stage, which may add
    more to them: distributed/parallelize.py), or the head's linear (vocab_head)."""
    if isinstance(module, nn.Embedding):
        return VocabParallelEmbedding(module.num_embeddings, module.embedding_dim, ctx.tp)
    return vocab_head(module, ctx)


def replicated(module: nn.Module, ctx: PlanContext) -> None:
    """Kept whole on every rank (a row that stops later patterns from matching the module)."""


# A user plan's style names (model/custom.py PLAN_STYLES) -> the styles its rows run. A user's
# column layer has no parent that enters the region for it, so it enters itself.
USER_STYLES: dict[str, Style] = {
    "column": partial(column, enter=True),
    "row": row,
    "vocab": vocab,
    "replicated": replicated,
}


def apply_plan(model: nn.Module, plan, ctx: PlanContext) -> nn.Module:
    """Run each module's style from `plan` ((name pattern, style) rows; the first match wins),
    putting a returned replacement in the module's place."""
    for name, module in list(model.named_modules()):
        style = first_match(plan, name)
        if style is None:
            continue
        new = style(module, ctx)
        if new is not None:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, new)
    return model


def apply_tensor_parallel(model: nn.Module, grid: Grid, sp: bool, overlap: bool = True, plan=TP_PLAN) -> nn.Module:
    """Swap `model`'s layers for tensor-parallel ones over grid.tp by `plan` (call on the meta
    device, before materializing). `overlap`: the projections' dW matmuls run while their input
    gradient is all-reduced (reduce-scattered under SP). A no-op when tp is 1."""
    if grid.tp.size == 1:
        return model
    head, embed = getattr(model, "head", None), getattr(model, "tok_embed", None)
    tied = head is not None and embed is not None and head.weight is embed.weight
    return apply_plan(model, plan, PlanContext(grid.tp, sp, overlap, model, tied))
