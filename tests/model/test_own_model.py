"""Your own model (model/custom.py, parallelize.build_user_model), defined outside the package:
by the TP-plan route (tests/own_model_gptj.py: plain modules, threefold's TP layers swapped in
by its plan) and by the compose-the-layers route (tests/own_model_composed.py: the same GPT-J
style model built from threefold's TP layers). Each gets layout-invariant initialization, stage
cutting and FLOPs counting, and trains at tp2·pp2·dp2 (ZeRO 0, and SP with ZeRO 3) within
PARITY of the plan route's single-process run (same names, values and math)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from threefold.config import build_config
from threefold.distributed.parallelize import apply_user_plan, build_user_model
from threefold.distributed.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from threefold.errors import ConfigError
from threefold.model import custom
from threefold.model.meta import on_meta
from threefold.validate import validate

from harness import CALM_LR, assert_parity, run_training, run_training_many

ARCH = "own_model_gptj:build"
COMPOSED = "own_model_composed:build"
STEPS = 10
BASE = {
    "model.arch": ARCH,
    "model.layers": 4,
    "model.hidden": 64,
    "model.heads": 4,
    "model.kv_heads": 4,
    "model.ffn_hidden": 128,
    "model.seq_len": 32,
    "train.steps": STEPS,
    "train.seed": 0,
    "train.lr": CALM_LR,
    "train.warmup_steps": 2,
    "train.global_batch": 8,
    "train.micro_batch": 2,
}
THREE_D = {"parallel.tp": 2, "parallel.pp": 2, "parallel.dp": 2}
RUNS = {
    "tp2-pp2-dp2": THREE_D,
    "tp2-sp-pp2-dp2-zero3": {**THREE_D, "parallel.sp": True, "parallel.zero": 3},
    "composed-tp2-pp2-dp2": {**THREE_D, "model.arch": COMPOSED},
    "composed-tp2-sp-pp2-dp2-zero3": {**THREE_D, "parallel.sp": True, "parallel.zero": 3, "model.arch": COMPOSED},
}


def model_cfg(**over):
    pairs = [(k, str(v)) for k, v in {**BASE, **over}.items()]
    return build_config(None, pairs)


def chunk(cfg, tp=None, layer_ids=None, first=True, last=True):
    """build_user_model's chunk for a fake TP rank `tp` (size, rank), without processes."""
    size, rank = tp or (1, 0)
    grid = SimpleNamespace(
        tp=SimpleNamespace(size=size, rank=rank, name="tp"),
        cp=SimpleNamespace(size=1, rank=0, name="cp"),
        dp_rank=0, pp_rank=0, tp_rank=rank, cp_rank=0,
    )  # fmt: skip
    return build_user_model(cfg, grid, torch.device("cpu"), layer_ids, first, last)


def test_plan_swaps_in_threefold_tp_layers():
    model = chunk(model_cfg(), tp=(2, 1))
    block = model.layers["0"]
    assert isinstance(model.tok_embed.wte, VocabParallelEmbedding)
    assert all(isinstance(getattr(block, n), ColumnParallelLinear) for n in ("q", "k", "v", "fc_in"))
    assert all(isinstance(getattr(block, n), RowParallelLinear) for n in ("out", "fc_out"))
    assert isinstance(model.head.proj, ColumnParallelLinear)
    assert isinstance(block.ln, nn.LayerNorm)  # replicated by default
    assert model.loss_fn.func.__name__ == "vocab_parallel_cross_entropy"
    assert block.q.weight.shape == (32, 64) and block.out.weight.shape == (64, 32)


def test_each_tp_shard_is_a_slice_of_the_one_process_values():
    cfg = model_cfg()
    whole = dict(chunk(cfg).named_parameters())
    for rank in (0, 1):
        for name, p in chunk(cfg, tp=(2, rank)).named_parameters():
            full = whole[name]
            if p.shape == full.shape:
                assert torch.equal(p, full), name
                continue
            dim = next(d for d in range(p.dim()) if p.shape[d] != full.shape[d])
            n = p.shape[dim]
            assert torch.equal(p, full.narrow(dim, rank * n, n)), name
    # the default rule: LayerNorm weights ones, biases zeros, row-parallel weights scaled
    assert torch.equal(whole["layers.0.ln.weight"], torch.ones(64))
    assert torch.equal(whole["layers.0.fc_in.bias"], torch.zeros(128))
    assert whole["layers.0.out.weight"].std() < 0.75 * whole["layers.0.q.weight"].std()


def test_a_pipeline_chunk_holds_its_blocks_under_their_global_names():
    model = chunk(model_cfg(), layer_ids=[2, 3], first=False)
    assert model.tok_embed is None and list(model.layers) == ["2", "3"]
    whole = dict(chunk(model_cfg()).named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, whole[name]), name


def test_an_unplanned_linear_is_refused_by_name():
    cfg = model_cfg()
    spec = custom.spec_of(cfg.model)
    spec.plan = {k: v for k, v in spec.plan.items() if k != "layers.*.fc_in"}
    with on_meta(), pytest.raises(ConfigError, match=r"layers\.0\.fc_in .*no tensor-parallel plan entry"):
        model = custom.UserModel(spec, cfg.model)
        apply_user_plan(model, spec, SimpleNamespace(tp=SimpleNamespace(size=2, rank=0, name="tp")), False, True)


@pytest.mark.parametrize(
    "arch, message",
    [
        ("no_such_module_xyz:build", r"model\.arch: .*cannot import no_such_module_xyz"),
        ("own_model_gptj:nothere", r"model\.arch: .*has no function 'nothere'"),
        ("/nonexistent/model.py:build", r"model\.arch: .*does not exist"),
        ("mamba", r"model\.arch: 'mamba' is not allowed"),
    ],
)
def test_a_bad_arch_is_one_line_naming_model_arch(arch, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate(model_cfg(**{"model.arch": arch}))
    assert "\n" not in str(err.value)


def test_selective_recompute_needs_the_specs_patterns():
    with pytest.raises(ConfigError, match=r"train\.recompute: selective needs own_model_gptj:build's"):
        validate(model_cfg(**{"train.recompute": "selective"}))


def test_flops_and_params_are_counted_from_the_modules():
    from threefold.model.flops import total_params, train_flops_per_token
    from threefold.planner.model import model_shape

    cfg = model_cfg().model
    model = chunk(model_cfg())
    assert total_params(cfg) == sum(p.numel() for p in model.parameters())
    h, f, s, v = 64, 128, 32, 256
    block_weights = 4 * h * h + 2 * h * f
    attention = 4 * h * (s + 1) / 2
    assert train_flops_per_token(cfg, s) == 3 * (4 * (2 * block_weights + attention) + 2 * h * v)
    shape = model_shape(cfg)
    assert shape.total_params == total_params(cfg)
    assert shape.layer_params == pytest.approx(block_weights + 2 * h + f + h)  # + LayerNorm, fc biases


def test_the_composed_route_holds_the_same_layers_and_values_as_the_plan_route():
    for tp in ((1, 0), (2, 0), (2, 1)):
        planned = chunk(model_cfg(), tp=tp)
        composed = chunk(model_cfg(**{"model.arch": COMPOSED}), tp=tp)
        if tp[0] > 1:  # the same threefold TP layers (and torch modules) under the same names
            assert _layers(planned) == _layers(composed)
        mine = dict(composed.named_parameters())
        for name, p in planned.named_parameters():
            assert torch.equal(p, mine[name]), (tp, name)
        assert (composed.loss_fn is custom.cross_entropy_sum) == (tp[0] == 1)
    cfg = model_cfg(**{"model.arch": COMPOSED}).model
    assert custom.counts(cfg) == custom.counts(model_cfg().model)


def _layers(model) -> list:
    return [(n, type(m)) for n, m in model.named_modules() if not type(m).__module__.startswith("own_model")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir) -> list[dict]:
    return run_training(BASE, tmp_path_factory.mktemp("one") / "gptj", cache_dir)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, cache_dir) -> dict:
    runs = {k: {**BASE, **v} for k, v in RUNS.items()}
    return run_training_many(runs, tmp_path_factory.mktemp("eight"), cache_dir, world=8, timeout=900)


def test_the_user_model_trains_in_one_process(reference):
    assert [r["step"] for r in reference] == list(range(1, STEPS + 1))
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.3


def test_full_recompute_wraps_every_block_and_gives_the_same_losses(reference, tmp_path, cache_dir):
    model = chunk(model_cfg(**{"train.recompute": "full"}))
    assert all(getattr(block, "recomputed", False) for block in model.layers.values())
    run = run_training({**BASE, "train.steps": 3, "train.recompute": "full"}, tmp_path, cache_dir)
    assert [r["loss"] for r in run] == [r["loss"] for r in reference[:3]]


@pytest.mark.parametrize("name", list(RUNS))
def test_every_layout_matches_one_process(name, layouts, reference):
    run = layouts[name]
    assert [r["step"] for r in run] == list(range(1, STEPS + 1))
    assert_parity(f"gptj {name} vs one process loss", reference, run)


def test_a_checkpoint_of_one_layout_resumes_in_another(reference, tmp_path, cache_dir):
    """Saved at tp 2 at step 5 (of the same 10-step schedule), resumed at pp 2: steps 6-10 are
    the one-process run's."""
    ckpt = tmp_path / "ckpt"
    saved = {"checkpoint.dir": str(ckpt), "checkpoint.interval": 5, "parallel.tp": 2}
    run_training({**BASE, **saved}, tmp_path / "tp2", cache_dir)
    resume = {"checkpoint.resume": str(ckpt / "step_00000005"), "checkpoint.dir": "", "parallel.pp": 2}
    resumed = run_training({**BASE, **resume}, tmp_path / "pp2", cache_dir)
    assert [r["step"] for r in resumed] == list(range(6, STEPS + 1))
    assert_parity("gptj tp2 -> pp2 resumed vs one process loss", reference[5:], resumed)
