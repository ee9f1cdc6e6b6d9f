"""How many collectives tensor (and sequence) parallelism makes per micro-batch, by piece of the
model and by pass: the one table that tensor_parallel/ documents, the planner's cost model
counts (planner/cost.py) and the communication-volume tests expect. Torch-free, below
tensor_parallel/ (whose package imports torch), so that `threefold plan` reads it without torch.

Activations are [seq, batch, hidden]; X = s*b*h*e is one whole activation, the size
comm.CommStats records for every all-reduce, all-gather and reduce-scatter below (the reduced
tensor, the all-gather's output, the reduce-scatter's input).

    piece           pass  without SP                         with SP
    attention, mlp  fwd   LEAVE all-reduce                   ENTER all-gather, LEAVE reduce-scatter
                    bwd   ENTER all-reduce                   LEAVE's all-gather, ENTER's reduce-scatter,
                                                             the re-gather of the saved input shard
    routed          fwd   all-gather of the output, counts   counts
                    bwd   all-gather of the input gradient   -
    embedding       fwd   all-reduce                         reduce-scatter
                    bwd   -                                  all-gather
    head            fwd   -                                  all-gather
                    bwd   all-reduce                         reduce-scatter, the re-gather
    loss            fwd   2 all-reduces of fp32 per token: the row max, then the target logit and exp-sum

ENTER and LEAVE are tensor_parallel/region.py's entry and the row-parallel output
(mappings.leave_region); a dense block is attention then mlp. "routed" is an MoE block's experts
under TP (tensor_parallel/apply.py, mlp): the TP ranks split the tokens (under SP they arrive
split) and all-gather the routing counts, a few values per rank: "counts", latency, not volume.
An MoE block is attention, routed, then its shared expert, an mlp. GPT-2's embedding under SP
adds the position table to the whole sequence first: an all-reduce forward, then a split.

Full recompute reruns each block's forward in backward, up to the last tensor backward needs
(torch's checkpoint stops early): every forward collective of the block but its output one,
the `output` of its last piece. Once per step, outside this table: finalize's all-reduce of
the partial gradient sums and the TP shards' squared norms.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Collectives:
    """Collectives by kind; each all-reduce, all-gather and reduce-scatter handles one X."""

    all_reduce: int = 0
    all_gather: int = 0
    reduce_scatter: int = 0
    counts: int = 0
    """All-gathers of a few values per rank (an MoE block's routing counts)."""

    def __add__(self, other: Collectives) -> Collectives:
        return Collectives(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: Collectives) -> Collectives:
        return Collectives(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    @property
    def calls(self) -> int:
        return self.all_reduce + self.all_gather + self.reduce_scatter + self.counts


NONE = Collectives()


@dataclass(frozen=True)
class Piece:
    """One piece's collectives per micro-batch, and the forward one that produces its output."""

    forward: Collectives
    backward: Collectives
    output: Collectives = NONE

    @property
    def both(self) -> Collectives:
        return self.forward + self.backward


_REGION = Piece(  # attention and mlp: ENTER, the column-parallel projections, the row-parallel LEAVE
    forward=Collectives(all_reduce=1), backward=Collectives(all_reduce=1), output=Collectives(all_reduce=1)
)
_SP_REGION = Piece(
    forward=Collectives(all_gather=1, reduce_scatter=1),
    backward=Collectives(all_gather=2, reduce_scatter=1),
    output=Collectives(reduce_scatter=1),
)

TP_COLLECTIVES: dict[bool, dict[str, Piece]] = {
    False: {
        "attention": _REGION,
        "mlp": _REGION,
        "routed": Piece(
            forward=Collectives(all_gather=1, counts=1),
            backward=Collectives(all_gather=1),
            output=Collectives(all_gather=1),
        ),
        "embedding": Piece(forward=Collectives(all_reduce=1), backward=NONE),
        "head": Piece(forward=NONE, backward=Collectives(all_reduce=1)),
        "loss": Piece(forward=Collectives(all_reduce=2), backward=NONE),
    },
    True: {
        "attention": _SP_REGION,
        "mlp": _SP_REGION,
        "routed": Piece(forward=Collectives(counts=1), backward=NONE),
        "embedding": Piece(forward=Collectives(reduce_scatter=1), backward=Collectives(all_gather=1)),
        "head": Piece(forward=Collectives(all_gather=1), backward=Collectives(all_gather=1, reduce_scatter=1)),
        "loss": Piece(forward=Collectives(all_reduce=2), backward=NONE),
    },
}
"""[sequence parallel][piece]: see the module docstring."""

LOSS_FP32_PER_TOKEN = 3
"""What the loss's two all-reduces carry per token: the row max, then the target logit and the exp-sum."""

DENSE_BLOCK = ("attention", "mlp")


def moe_block(shared_expert: bool) -> tuple[str, ...]:
    """The pieces of an MoE block in forward order."""
    return ("attention", "routed", "mlp") if shared_expert else ("attention", "routed")


def block_collectives(sp: bool, pieces: tuple[str, ...], full_recompute: bool = False) -> Collectives:
    """One block of `pieces` (in forward order) per micro-batch: forward and backward, and under
    full recompute the rerun forward without the block's output collective."""
    rows = [TP_COLLECTIVES[sp][name] for name in pieces]
    total = sum((row.both for row in rows), NONE)
    if full_recompute:
        total = total + sum((row.forward for row in rows), NONE) - rows[-1].output
    return total
