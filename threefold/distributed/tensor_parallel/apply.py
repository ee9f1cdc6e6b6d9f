"""Apply tensor (and sequence) parallelism to a plain Transformer by swapping its modules.

Per block (Megatron's layout; activations [seq, batch, hidden]):

    x -> norm -> ENTER -> wq/wk/wv (column) -> attention on heads/tp -> wo (row) -> LEAVE -> + x
    x -> norm -> ENTER -> w1/w3 (column)   -> SwiGLU on ffn/tp       -> w2 (row) -> LEAVE -> + x

ENTER is one collective shared by the sibling projections (installed as a forward pre-hook on
the attention / MLP module, the way DTensor's PrepareModuleInput works): identity forward and
all-reduce backward without SP; all-gather over the sequence forward and reduce-scatter
backward with SP. LEAVE lives in the row-parallel linear: all-reduce, or reduce-scatter under
SP. Under SP everything between LEAVE and the next ENTER (norms, dropout, residual adds) runs on
seq/tp rows, so those activations shrink by tp too (Korthikanti et al. 2022).

Parameter names stay those of the plain model, so initialization and checkpoints do not depend
on the layout. GQA: with kv_heads >= tp the kv heads are split like the query heads; with
kv_heads < tp every rank keeps wk/wv whole and uses the kv head serving its query heads.
"""
from __future__ import annotations

from functools import partial

from torch import nn

from threefold.distributed.grid import Grid, Group
from threefold.distributed.tensor_parallel.layers import (ColumnParallelLinear, HeadSliceLinear, RowParallelLinear,
                                                           VocabParallelEmbedding, enter_tensor_region,
                                                           vocab_parallel_cross_entropy)
from threefold.distributed.tensor_parallel.mappings import (all_gather_dim0, gather_to_replicated,
                                                             scatter_to_sequence_region)
from threefold.model.moe import MoE


class EnterRegion:
    """Forward pre-hook: the module's input enters the tensor-parallel region once."""

    def __init__(self, group: Group, sp: bool):
        self.group, self.sp = group, sp

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        return (enter_tensor_region(args[0], self.group, self.sp), *args[1:])

    def __repr__(self) -> str:
        return f"EnterRegion({'all-gather seq' if self.sp else 'copy'}, {self.group.name})"


def _bias(linear: nn.Linear) -> bool:
    return linear.bias is not None


def _column(linear: nn.Linear, tp: Group, sp: bool) -> ColumnParallelLinear:
    return ColumnParallelLinear(linear.in_features, linear.out_features, tp, bias=_bias(linear), sp=sp, enter=False)


def _row(linear: nn.Linear, tp: Group, sp: bool) -> RowParallelLinear:
    return RowParallelLinear(linear.in_features, linear.out_features, tp, bias=_bias(linear), sp=sp)


def _parallel_attention(attn: nn.Module, tp: Group, sp: bool) -> None:
    hd, t = attn.head_dim, tp.size
    kv_heads = attn.wk.out_features // hd
    attn.wq = _column(attn.wq, tp, sp)
    if kv_heads % t == 0:
        attn.wk, attn.wv = _column(attn.wk, tp, sp), _column(attn.wv, tp, sp)
    else:
        # tp/kv_heads consecutive ranks share a kv head (their query heads form its group).
        start = (tp.rank // (t // kv_heads)) * hd
        attn.wk, attn.wv = (HeadSliceLinear(w.in_features, w.out_features, start, hd, bias=_bias(w))
                            for w in (attn.wk, attn.wv))
    attn.wo = _row(attn.wo, tp, sp)
    attn.register_forward_pre_hook(EnterRegion(tp, sp))


def _parallel_mlp(mlp: nn.Module, tp: Group, sp: bool) -> None:
    mlp.w1 = _column(mlp.w1, tp, sp)
    if mlp.w3 is not None:
        mlp.w3 = _column(mlp.w3, tp, sp)
    mlp.w2 = _row(mlp.w2, tp, sp)
    mlp.register_forward_pre_hook(EnterRegion(tp, sp))


def _parallel_moe(moe: MoE, tp: Group, sp: bool) -> None:
    """Experts stay whole; the TP ranks split the micro-batch's tokens instead (under SP they
    arrive split; otherwise each rank takes its slice of the sequence and the outputs are
    gathered back). The router's and the experts' gradients are then partial sums over tp:
    the router's is summed like a norm's, the experts' by their own data-parallel group,
    which spans tp (grid.expert_dp). The shared expert is a tensor-parallel MLP."""
    moe.token_ranks, moe.token_rank = tp.size, tp.rank
    moe.gather_counts = partial(_stacked, group=tp)
    if not sp:
        moe.split_tokens = partial(scatter_to_sequence_region, group=tp)
        moe.gather_tokens = partial(gather_to_replicated, group=tp)
    moe.router.tp_sum_grads = ("weight",)
    if moe.shared is not None:
        _parallel_mlp(moe.shared, tp, sp)


def _stacked(x, group: Group):
    """[ranks, *x.shape]: every TP rank's `x` (routing counts; no gradient)."""
    return all_gather_dim0(x.unsqueeze(0), group)


def _sequence_sharded(norm: nn.Module) -> None:
    # Each rank normalizes its own rows: the weight (and bias) gradient is a partial sum.
    norm.tp_sum_grads = tuple(name for name, _ in norm.named_parameters(recurse=False))


def apply_tensor_parallel(model: nn.Module, grid: Grid, sp: bool) -> nn.Module:
    """Swap `model`'s layers for tensor-parallel ones over grid.tp (call on the meta device,
    before materializing). A no-op when tp is 1."""
    tp = grid.tp
    if tp.size == 1:
        return model
    tied = model.head is not None and model.tok_embed is not None and model.head.weight is model.tok_embed.weight
    for block in model.layers.values():
        _parallel_attention(block.attn, tp, sp)
        if isinstance(block.mlp, MoE):
            _parallel_moe(block.mlp, tp, sp)
        else:
            _parallel_mlp(block.mlp, tp, sp)
        if sp:
            _sequence_sharded(block.attn_norm)
            _sequence_sharded(block.mlp_norm)
    if model.tok_embed is not None:
        # A GPT-2 position table is added to the full sequence first, then split (no traffic);
        # otherwise the embedding's partial sums are reduce-scattered straight into the shards.
        scatter_in_embedding = sp and model.pos_embed is None
        old = model.tok_embed
        model.tok_embed = VocabParallelEmbedding(old.num_embeddings, old.embedding_dim, tp,
                                                 scatter=scatter_in_embedding)
        if sp and not scatter_in_embedding:
            model.embed_out = partial(scatter_to_sequence_region, group=tp)
    if model.head is not None:
        if sp:
            _sequence_sharded(model.norm)
        model.head = ColumnParallelLinear(model.head.in_features, model.head.out_features, tp, sp=sp, enter=True)
        if tied:
            model.head.weight = model.tok_embed.weight
        # The logits stay split over the vocabulary: the loss never gathers them.
        model.loss_fn = partial(vocab_parallel_cross_entropy, group=tp)
    return model


def partial_grad_params(model: nn.Module) -> list[nn.Parameter]:
    """Replicated parameters whose gradient each TP rank holds only a part of."""
    out = []
    for module in model.modules():
        for name in getattr(module, "tp_sum_grads", ()):
            p = getattr(module, name)
            if p is not None and p.requires_grad:
                out.append(p)
    return out
