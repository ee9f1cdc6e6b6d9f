"""Meta-device construction: initializers skipped, storage made with torch.empty, and no import
of torch's compiler stack on the way (it cost every process ~2.5 s at launch)."""

import subprocess
import sys

import torch
from torch import nn

from threefold.model.meta import materialize, on_meta


def test_on_meta_skips_initializers_and_materialize_keeps_parameters():
    calls = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.emb = nn.Embedding(5, 4)
            self.norm = nn.LayerNorm(4)
            self.register_buffer("scale", torch.ones(2))
            self.lin.weight.requires_grad_(False)
            calls.append(self.emb.weight.normal_().is_meta)  # a fill on meta is still a no-op

    with on_meta():
        m = Probe()
    assert calls == [True] and all(p.is_meta for p in m.parameters())
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in m.state_dict().items()}
    materialize(m, "cpu")
    assert {k: (tuple(v.shape), v.dtype) for k, v in m.state_dict().items()} == shapes
    assert all(t.device.type == "cpu" for t in m.state_dict().values())
    assert isinstance(m.lin.bias, nn.Parameter) and m.lin.bias.requires_grad and not m.lin.weight.requires_grad
    # Outside the context initializers run again.
    w = torch.zeros(3, 3)
    nn.init.normal_(w)
    assert w.abs().sum() > 0


def test_building_a_model_does_not_import_the_compiler():
    code = (
        "import sys, torch\n"
        "from threefold.config import build_config\n"
        "from threefold.distributed.grid import Grid, Group, RankLayout\n"
        "from threefold.distributed.parallelize import build_model\n"
        "cfg = build_config(None, [('model.preset', 'tiny')])\n"
        "grid = Grid.alone()\n"
        "model = build_model(cfg, grid, torch.device('cpu'))\n"
        "assert all(not p.is_meta for p in model.parameters())\n"
        "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]


def test_deferred_parameters_get_the_values_tie_and_init_gives():
    """build_model(defer_init=True) leaves each trained parameter on meta; adopt(initial_value)
    makes the very same object hold what the eager build holds, bit for bit: for a whole tied
    model and for a last pipeline stage whose head is a copy of the tied embedding. The
    parameter keeps its sharding record and its own version counter (a ZeRO-3 all-gather
    writes the bucket it views in place, and autograd checks saved tensors' versions)."""
    from threefold.config import build_config
    from threefold.distributed.grid import Grid
    from threefold.distributed.parallelize import build_model
    from threefold.model.meta import adopt, deferred, initial_value
    from threefold.model.sharding import sharding_of

    cfg = build_config(None, [("model.preset", "tiny"), ("model.tie_embeddings", "true")])
    cpu = torch.device("cpu")
    for ids, first, last in ((None, True, True), ([2, 3], False, True)):
        eager = dict(build_model(cfg, Grid.alone(), cpu, ids, first, last).named_parameters())
        model = build_model(cfg, Grid.alone(), cpu, ids, first, last, defer_init=True)
        params = dict(model.named_parameters())
        assert params.keys() == eager.keys() and all(p.is_meta and deferred(p) for p in params.values())
        records = {n: sharding_of(p) for n, p in params.items()}
        for name, p in params.items():
            bucket = torch.zeros(p.numel() + 3)
            view = bucket[1 : 1 + p.numel()]
            view.copy_(initial_value(p).reshape(-1))
            adopt(p, view.view(p.shape))
            assert getattr(model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]) is p
            assert torch.equal(p, eager[name]), name
            assert p.requires_grad and deferred(p) is None and sharding_of(p) is records[name]
            version = p._version
            bucket.add_(0)
            assert p._version == version and p.untyped_storage().data_ptr() == bucket.untyped_storage().data_ptr()
        if first and last:
            assert model.head.weight is model.tok_embed.weight
            assert torch.isfinite(model(torch.randint(0, 256, (1, 8)), torch.randint(0, 256, (1, 8)))).all()
