"""The Python API (threefold/__init__.py, threefold/api.py): every exported name is the object it
says, `import threefold` stays cheap, `configure` builds what the command line builds, `train`
runs the CLI's engine and returns the last metrics record, and the CLI's train is its user."""

import importlib
import json
import subprocess
import sys

import pytest

import threefold
from threefold import api
from threefold.errors import ConfigError

# The public surface, written out independently of threefold.EXPORTS: name -> where it lives.
SURFACE = {
    "Config": "threefold.config:Config",
    "configure": "threefold.api:configure",
    "Callbacks": "threefold.training.callbacks:Callbacks",
    "Trainer": "threefold.training.trainer:Trainer",
    "ModelSpec": "threefold.model.custom:ModelSpec",
    "Parallel": "threefold.model.custom:Parallel",
    "UserModel": "threefold.model.custom:UserModel",
    "build_model": "threefold.distributed.parallelize:build_model",
    "apply_user_plan": "threefold.distributed.parallelize:apply_user_plan",
    "Grid": "threefold.distributed.grid:Grid",
    "RankLayout": "threefold.distributed.grid:RankLayout",
    "ColumnParallelLinear": "threefold.distributed.tensor_parallel:ColumnParallelLinear",
    "RowParallelLinear": "threefold.distributed.tensor_parallel:RowParallelLinear",
    "VocabParallelEmbedding": "threefold.distributed.tensor_parallel:VocabParallelEmbedding",
    "vocab_parallel_cross_entropy": "threefold.distributed.tensor_parallel:vocab_parallel_cross_entropy",
    "copy_to_region": "threefold.distributed.tensor_parallel.mappings:copy_to_region",
    "reduce_from_region": "threefold.distributed.tensor_parallel.mappings:reduce_from_region",
    "gather_from_sequence_region": "threefold.distributed.tensor_parallel.mappings:gather_from_sequence_region",
    "reduce_scatter_to_sequence_region": (
        "threefold.distributed.tensor_parallel.mappings:reduce_scatter_to_sequence_region"
    ),
    "scatter_to_sequence_region": "threefold.distributed.tensor_parallel.mappings:scatter_to_sequence_region",
    "gather_to_replicated": "threefold.distributed.tensor_parallel.mappings:gather_to_replicated",
    "gather_from_tensor_region": "threefold.distributed.tensor_parallel.mappings:gather_from_tensor_region",
    "build_schedule": "threefold.distributed.pipeline:build_schedule",
    "gpipe": "threefold.distributed.pipeline:gpipe",
    "one_f_one_b": "threefold.distributed.pipeline:one_f_one_b",
    "interleaved_1f1b": "threefold.distributed.pipeline:interleaved_1f1b",
    "zero_bubble_h1": "threefold.distributed.pipeline:zero_bubble_h1",
    "PipelineExecutor": "threefold.distributed.pipeline.executor:PipelineExecutor",
    "build_stage": "threefold.distributed.pipeline.stage:build_stage",
    "build_data_parallel": "threefold.distributed.data_parallel:build_data_parallel",
    "DataParallel": "threefold.distributed.data_parallel:DataParallel",
    "Checkpointer": "threefold.checkpoint.writer:Checkpointer",
    "save_checkpoint": "threefold.checkpoint:save",
    "open_checkpoint": "threefold.checkpoint:open_checkpoint",
    "load_checkpoint": "threefold.checkpoint:load_into",
    "training_state": "threefold.checkpoint:training_state",
    "SpanRecorder": "threefold.observe.spans:SpanRecorder",
}


def test_the_exports_are_the_documented_surface():
    assert set(threefold.EXPORTS) == set(SURFACE) | {"train"}


@pytest.mark.parametrize("name", sorted(SURFACE))
def test_each_exported_name_is_the_object_it_names(name):
    module, attr = SURFACE[name].split(":")
    assert getattr(threefold, name) is getattr(importlib.import_module(module), attr)
    assert name in threefold.__all__ and name in dir(threefold)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        threefold.Nope  # noqa: B018


def test_threefold_train_is_a_plain_function_beside_the_training_package():
    import types

    import threefold.training.trainer as trainer_module

    assert threefold.train is api.train and isinstance(threefold.train, types.FunctionType)
    assert threefold.training.trainer is trainer_module  # the package's modules stay reachable
    assert type(threefold) is types.ModuleType  # no module class swapped in


def test_import_threefold_does_not_import_torch():
    code = "import sys, threefold; threefold.Config; threefold.configure; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_configure_from_a_dict_toml_and_overrides(tmp_path):
    cfg = threefold.configure({"model": {"preset": "small", "layers": 3}, "parallel": {"dp": 2}})
    assert (cfg.model.hidden, cfg.model.layers, cfg.parallel.dp) == (512, 3, 2)  # the preset fills the rest
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\npreset = "small"\n[train]\nsteps = 7\n')
    cfg = threefold.configure(str(toml), ["--train.steps", "9", "--parallel.tp=2"])
    assert (cfg.model.hidden, cfg.train.steps, cfg.parallel.tp) == (512, 9, 2)
    again = threefold.configure(cfg, {"train.steps": 11})
    assert again.train.steps == 11 and cfg.train.steps == 9  # a Config source is copied, not changed
    assert threefold.configure().model.hidden == 128  # no source: the defaults and the tiny preset


def test_configure_refuses_a_bad_key_in_one_line():
    with pytest.raises(ConfigError, match=r"train\.stepz: unknown key.*train\.steps") as err:
        threefold.configure({"train": {"stepz": 3}})
    assert "\n" not in str(err.value)


def test_arch_of_names_a_build_function():
    from own_model_gptj import build

    from threefold.model.custom import arch_of

    assert arch_of(build) == "own_model_gptj:build"
    assert arch_of("pkg.mod:fn") == "pkg.mod:fn"
    with pytest.raises(ValueError, match="module level"):
        arch_of(lambda cfg: None)


def test_train_runs_a_user_model_and_returns_the_last_record(tmp_path, cache_dir):
    from own_model_gptj import build

    seen = []
    cfg = threefold.configure(
        {
            "model": {"hidden": 32, "layers": 2, "heads": 2, "kv_heads": 2, "ffn_hidden": 64, "seq_len": 16},
            "train": {"steps": 3, "global_batch": 2, "micro_batch": 2},
            "log": {"dir": str(tmp_path), "quiet": True},
            "data": {"cache_dir": cache_dir},
        }
    )
    last = threefold.train(cfg, model=build, callbacks=threefold.Callbacks(on_metrics=seen.append))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert last["step"] == 3 and last["loss"] == records[-1]["loss"]
    assert [r["step"] for r in seen] == [1, 2, 3]
    assert json.loads((tmp_path / "run.json").read_text())["config"]["model"]["arch"] == "own_model_gptj:build"
    assert cfg.model.arch == "llama"  # the caller's Config is not changed


def test_the_cli_train_command_is_a_user_of_the_api(monkeypatch):
    from threefold import cli

    calls = []
    monkeypatch.setattr(api, "train", lambda cfg, model=None, callbacks=None: calls.append(cfg) or {})
    assert cli.main(["train", "--train.steps", "4", "--parallel.dp", "2"]) == 0
    assert len(calls) == 1 and (calls[0].train.steps, calls[0].parallel.dp) == (4, 2)
