"""A user model's plan of strings runs through the one TP plan interpreter (tensor_parallel/apply.py:
apply_plan over rows of USER_STYLES): what each string becomes, the first matching row winning,
and the entries that cannot apply refused by name. No processes: a fake TP rank on the meta device."""

from types import SimpleNamespace

import pytest
from torch import nn

from threefold.config import build_config
from threefold.distributed.parallelize import apply_user_plan
from threefold.distributed.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from threefold.errors import ConfigError
from threefold.model import custom
from threefold.model.meta import on_meta

HIDDEN, VOCAB = 16, 32
GRID = SimpleNamespace(tp=SimpleNamespace(size=2, rank=1, name="tp"))


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.proj = nn.Linear(HIDDEN, VOCAB, bias=True)  # a biased head keeps its (split) bias


PLAN = {
    "tok_embed.wte": "vocab",
    "layers.0.up": "replicated",  # the first match wins: block 0's up stays whole
    "layers.*.up": "column",
    "layers.*.down": "row",
    "head.proj": "vocab",
}


def planned(plan: dict, sp: bool = False, overlap: bool = True) -> nn.Module:
    cfg = build_config(None, [("model.layers", "2"), ("model.hidden", str(HIDDEN)), ("model.vocab", str(VOCAB))])
    spec = custom.ModelSpec(embed=Embed, block=lambda i: Block(), head=Head, plan=plan)
    with on_meta():
        model = custom.UserModel(spec, cfg.model)
        return apply_user_plan(model, spec, GRID, sp, overlap)


def test_each_style_name_becomes_its_tp_layer():
    model = planned(PLAN, sp=True)
    first, second = model.layers["0"], model.layers["1"]
    assert isinstance(model.tok_embed.wte, VocabParallelEmbedding) and not model.tok_embed.wte.scatter
    assert type(first.up) is nn.Linear and isinstance(second.up, ColumnParallelLinear)
    # A user's column layer has no parent entering the region for it: it enters itself.
    assert second.up.enter and second.up.overlap and second.up.sp
    assert second.up.weight.shape == (HIDDEN, HIDDEN) and second.up.bias.shape == (HIDDEN,)
    assert isinstance(second.down, RowParallelLinear) and second.down.weight.shape == (HIDDEN, HIDDEN)
    head = model.head.proj
    assert isinstance(head, ColumnParallelLinear) and head.enter and head.bias.shape == (VOCAB // 2,)
    assert model.loss_fn.func.__name__ == "vocab_parallel_cross_entropy"
    # Under SP: the sequence split after the whole embed stage, replicated parameters summed over tp.
    assert model.embed_out.func.__name__ == "scatter_to_sequence_region"
    assert first.up.tp_sum_grads == ("weight", "bias") and model.head.ln_f.tp_sum_grads == ("weight", "bias")


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"layers.*.ln": "column"}, r"plan entry 'column' for layers\.0\.ln \(LayerNorm\).*it needs an nn\.Linear"),
        ({"layers.1.down": "vocab"}, r"plan entry 'vocab' for layers\.1\.down .*the head's nn\.Linear"),
    ],
)
def test_an_entry_that_cannot_apply_is_refused_by_name(entry, message):
    assert not entry.keys() & PLAN.keys()  # placed first, so it is the first match
    with pytest.raises(ConfigError, match=message):
        planned({**entry, **PLAN})
