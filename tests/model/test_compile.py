"""train.compile (model/compile.py): each block compiled with the parallel plumbing left eager,
and training losses equal to eager ones: inductor in one process, and the capture (aot_eager)
under tensor/sequence parallelism and ZeRO-3 in two."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from threefold.distributed.parallelize import build_model

from harness import CALM_LR, assert_parity, run_training, run_training_many
from tp_checks import model_config, reference_grid

SHAPE = {
    "model.hidden": 64,
    "model.layers": 2,
    "model.ffn_hidden": 176,
    "model.seq_len": 64,
    "train.global_batch": 8,
    "train.micro_batch": 4,
    "train.steps": 4,
    "train.seed": 0,
    "train.lr": CALM_LR,
    "train.warmup_steps": 1,
    "data.prefetch": 0,
}


def _compiled(fn) -> bool:
    return hasattr(fn, "_torchdynamo_orig_callable") and not getattr(fn, "_torchdynamo_disable", False)


def _eager(fn) -> bool:
    return getattr(fn, "_torchdynamo_disable", False)


def _build(**over):
    cfg = model_config({"model.layers": 2, "model.seq_len": 32, "train.compile": "true", **over})
    return build_model(cfg, reference_grid(), torch.device("cpu"))


def test_blocks_are_compiled_and_the_plumbing_stays_eager():
    for block in _build().layers.values():  # a plain block: one compiled forward, nothing eager
        assert _compiled(block.forward)
        assert not any(_eager(m.forward) for m in block.modules() if m is not block)
    for block in _build(**{"train.recompute": "selective"}).layers.values():
        assert _compiled(block.forward) and _eager(block.attn.core.forward)  # checkpoint's rerun
    for block in _build(**{"train.recompute": "full"}).layers.values():
        # checkpoint stays outside; what it runs (and reruns in backward) is compiled
        assert not _compiled(block.forward) and _compiled(block.recompute_inner)
    moe = _build(**{"model.num_experts": 4, "model.moe_every": 2})
    dense, routed = moe.layers["0"], moe.layers["1"]
    assert _compiled(routed.forward) and _eager(routed.mlp.forward) and not _eager(dense.mlp.forward)
    names = {n for n, _ in _build().named_parameters()}
    plain = build_model(model_config({"model.layers": 2, "model.seq_len": 32}), reference_grid(), torch.device("cpu"))
    assert names == {n for n, _ in plain.named_parameters()}  # init and checkpoints see the same names


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory, cache_dir):
    return run_training(SHAPE, tmp_path_factory.mktemp("eager"), cache_dir)


def test_inductor_training_matches_eager(eager_run, tmp_path, cache_dir, monkeypatch):
    import torch._inductor.config

    # In-process kernel builds: a pool of compile workers costs more than it saves on 2 cores.
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)
    torch._dynamo.reset()
    counters.clear()
    compiled = run_training({**SHAPE, "train.compile": "true"}, tmp_path, cache_dir)
    assert_parity("compiled (inductor) vs eager, fp32", compiled, eager_run)
    # Both blocks share one graph (parameters are graph inputs), without a break inside it.
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_compiled_capture_matches_eager_under_tp_sp_and_zero3(eager_run, tmp_path, cache_dir):
    """TP regions (pre-hooks, column/row-parallel layers) graph-break around the compiled code;
    ZeRO-3's gather/free hooks wrap each compiled block."""
    capture = {**SHAPE, "train.compile": "true", "train.compile_backend": "aot_eager"}
    runs = {
        "tp2-sp": {**capture, "parallel.tp": 2, "parallel.sp": "true"},
        "dp2-zero3": {**capture, "parallel.dp": 2, "parallel.zero": 3},
    }
    out = run_training_many(runs, tmp_path, cache_dir, world=2)
    for name, metrics in out.items():
        assert_parity(f"compiled {name} vs eager tp1 dp1, fp32", metrics, eager_run)
