"""Hugging Face interop: import/export round trip, equal logits with transformers in parallel
layouts, exports that transformers loads, one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch
from hf_checks import layout_logits, tiny_hf_model

from threefold.cli import main

from harness import run_ranks, within

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

KINDS = ("llama", "gpt2", "qwen2")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per kind: (transformers model, its save_pretrained dir, the imported threefold checkpoint)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind in KINDS:
        hf_dir, ckpt = root / f"{kind}-hf", root / f"{kind}-tf"
        model = tiny_hf_model(kind, str(hf_dir))
        assert main(["checkpoint", "import-hf", str(hf_dir), str(ckpt)]) == 0
        out[kind] = (model, hf_dir, ckpt)
    return out


def _hf_tensors(directory) -> dict:
    index = directory / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    tensors = {}
    for name in files:
        tensors.update(safetensors.load_file(str(directory / name)))
    return tensors


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_bit_exact(kind, models, tmp_path):
    _, hf_dir, ckpt = models[kind]
    out = tmp_path / "out"
    # A small shard limit forces the sharded layout with an index.
    assert main(["checkpoint", "export-hf", str(ckpt), str(out), "--max-shard-mb", "0.02"]) == 0
    assert (out / "model.safetensors.index.json").exists()
    before, after = _hf_tensors(hf_dir), _hf_tensors(out)
    assert sorted(before) == sorted(after)
    for name, t in before.items():
        assert after[name].dtype == t.dtype and torch.equal(after[name], t), name
    original, exported = (json.loads((d / "config.json").read_text()) for d in (hf_dir, out))
    assert {k: v for k, v in original.items() if exported.get(k) != v} == {}


@pytest.mark.parametrize("kind", KINDS)
def test_export_loads_in_transformers_with_equal_logits(kind, models, tmp_path):
    model, _, ckpt = models[kind]
    out = tmp_path / "out"
    assert main(["checkpoint", "export-hf", str(ckpt), str(out)]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(reloaded) is type(model)
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)


def test_logits_equal_transformers_at_tp2_and_pp2(models):
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    jobs = [
        (str(models["llama"][2]), {"tp": 2, "sp": True}),
        (str(models["llama"][2]), {"pp": 2}),
        (str(models["gpt2"][2]), {"tp": 2}),
        (str(models["gpt2"][2]), {"pp": 2}),
        (str(models["qwen2"][2]), {"tp": 2}),
        (str(models["qwen2"][2]), {"pp": 2}),
    ]
    results = run_ranks(layout_logits, 2, jobs, tokens, timeout=240)
    for i, (path, parallel) in enumerate(jobs):
        kind = next(k for k in KINDS if str(models[k][2]) == path)
        with torch.no_grad():
            want = models[kind][0](tokens).logits
        # tp 2: both ranks hold the gathered logits; pp 2: the last stage (rank 1) holds them.
        got = [r[i] for r in results if r[i] is not None]
        assert len(got) == (2 if parallel.get("tp") else 1), (kind, parallel)
        for logits in got:
            diff = (torch.from_numpy(logits) - want).abs().max().item()
            within(f"{kind} {parallel} logits vs transformers", diff, 2.5e-6)


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("threefold: error:"), err
    return err


def test_unsupported_architecture_is_one_line(tmp_path, capsys):
    hf = tmp_path / "bert"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    err = _one_line_error(capsys, ["checkpoint", "import-hf", str(hf), str(tmp_path / "out")])
    assert "BertForMaskedLM" in err and "LlamaForCausalLM" in err
    assert not (tmp_path / "out").exists()


def test_inexact_conversion_is_refused(tmp_path, capsys):
    hf = tmp_path / "scaled"
    tiny_hf_model("llama", str(hf), rope_scaling={"rope_type": "linear", "factor": 2.0})
    capsys.readouterr()  # transformers' own progress output
    err = _one_line_error(capsys, ["checkpoint", "import-hf", str(hf), str(tmp_path / "out")])
    assert "rope_type" in err


def test_imported_checkpoint_trains_its_shape(models):
    """The import is an ordinary checkpoint: its config carries the Hugging Face shape."""
    from threefold.checkpoint import open_checkpoint

    _, manifest = open_checkpoint(models["qwen2"][2])
    m = manifest.config["model"]
    assert (m["arch"], m["hidden"], m["kv_heads"], m["qkv_bias"], m["tie_embeddings"]) == ("llama", 64, 1, True, True)
    assert manifest.tensors["model/layers.0.attn.wk.bias"].shape == [16]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_threefold_trained_model_exports_to_transformers(arch, tmp_path, cache_dir):
    from threefold.inference.generate import load_consolidated

    from harness import run_training

    overrides = {
        "model.preset": "tiny",
        "model.arch": arch,
        "model.hidden": 64,
        "model.layers": 2,
        "model.seq_len": 32,
        "model.kv_heads": 4 if arch == "gpt2" else 2,
        "model.tie_embeddings": arch == "gpt2",
        "train.steps": 2,
        "train.global_batch": 2,
        "train.micro_batch": 2,
        "checkpoint.dir": str(tmp_path / "ckpt"),
    }
    run_training(overrides, tmp_path / "log", cache_dir)
    assert main(["checkpoint", "export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ours, _ = load_consolidated(str(tmp_path / "ckpt"), torch.device("cpu"))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (hf(tokens).logits - ours(tokens).transpose(0, 1)).abs().max().item()
    within("trained model's logits vs transformers", diff, 2.5e-6)
