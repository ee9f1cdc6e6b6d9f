"""Unit tests for threefold.observe: FLOPs, parameter counts, device peak, metrics files."""

from __future__ import annotations

import json
import warnings
from datetime import datetime
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from threefold.model.flops import (
    active_params,
    forward_flops_per_token,
    hardware_flops_per_token,
    megatron_flops_per_iteration,
    total_params,
    train_flops_per_token,
)
from threefold.observe import (
    MetricsWriter,
    device_peak_flops,
    hardware_info,
    mfu,
    peak,
    peak_memory_bytes,
    write_run_json,
)


def llama(**kw):
    base = dict(
        arch="llama",
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn_hidden=128,
        vocab=100,
        seq_len=16,
        tie_embeddings=False,
    )
    return SimpleNamespace(**{**base, **kw})


def gpt2(**kw):
    base = dict(
        arch="gpt2", hidden=8, layers=1, heads=2, kv_heads=2, ffn_hidden=32, vocab=10, seq_len=4, tie_embeddings=True
    )
    return SimpleNamespace(**{**base, **kw})


# ---------------------------------------------------------------- FLOPs


def test_llama_flops_by_hand():
    # hd = 64/4 = 16. Weights per layer: q 64*64 = 4096, k+v 2*64*(2*16) = 4096,
    # o 64*64 = 4096, SwiGLU 3*64*128 = 24576 -> 36864; times 2 FLOPs = 73728.
    # Causal attention: s_eff = (16+1)/2 = 8.5; 2*2*heads*hd*s_eff = 4*4*16*8.5 = 2176.
    # Per layer 75904, two layers 151808, vocab head 2*64*100 = 12800.
    cfg = llama()
    assert forward_flops_per_token(cfg) == 164608
    assert train_flops_per_token(cfg) == 3 * 164608
    assert hardware_flops_per_token(cfg, recompute="none") == 493824
    # full: one more forward of both layers (151808), not of the head.
    assert hardware_flops_per_token(cfg, recompute="full") == 493824 + 151808
    # selective: one more attention score/value pass per layer: 2 * 2176.
    assert hardware_flops_per_token(cfg, recompute="selective") == 493824 + 4352


def test_causal_versus_full_attention():
    # Full attention: 4*4*16*16 = 4096 per layer instead of 2176, over two layers.
    cfg = llama()
    assert forward_flops_per_token(cfg, causal=False) == 168448
    diff = forward_flops_per_token(cfg, causal=False) - forward_flops_per_token(cfg)
    assert diff == 2 * (4096 - 2176)
    # seq_len overrides the config; at s=1 causal and full attention coincide.
    assert forward_flops_per_token(cfg, seq_len=1) == forward_flops_per_token(cfg, 1, causal=False)


def test_gqa_does_not_change_attention_score_flops():
    # Only the k/v projections shrink: 2 FLOPs * 2*64*(4-2)*16 = 8192 per layer, two layers.
    assert forward_flops_per_token(llama(kv_heads=4)) - forward_flops_per_token(llama()) == 2 * 8192


def test_matches_megatron_formula_with_full_recompute():
    # Narayanan et al. 2021 eq. 3: GPT, 4h MLP, full attention, full recomputation.
    b, s, layers, h, v = 4, 128, 3, 256, 1000
    cfg = gpt2(hidden=h, layers=layers, heads=8, kv_heads=8, ffn_hidden=4 * h, vocab=v, seq_len=s)
    ours = hardware_flops_per_token(cfg, causal=False, recompute="full") * b * s
    ref = megatron_flops_per_iteration(b, s, layers, h, v)
    assert ours == pytest.approx(ref, rel=1e-9)
    # Spelled out: 4 passes of (24h^2 + 4sh) per layer-token, 3 passes of 2hV for logits.
    spelled = b * s * (4 * layers * (24 * h * h + 4 * s * h) + 3 * 2 * h * v)
    assert ref == pytest.approx(spelled, rel=1e-12)


def test_six_n_plus_attention():
    # Without attention, training FLOPs per token are 6 * (matmul weights incl. the head).
    cfg = llama()
    n_matmul = 2 * 36864 + 64 * 100
    attention = 3 * 2 * 2176
    assert train_flops_per_token(cfg) == 6 * n_matmul + attention


def test_bad_arch_and_recompute_rejected():
    with pytest.raises(ValueError, match="arch"):
        forward_flops_per_token(llama(arch="bert"))
    with pytest.raises(ValueError, match="recompute"):
        hardware_flops_per_token(llama(), recompute="some")


# ---------------------------------------------------------------- parameter counts


def test_llama_params_by_hand():
    # embed 100*64 = 6400, head 6400 (untied), per layer 36864 + 2 RMSNorm * 64 = 36992,
    # two layers 73984, final RMSNorm 64.
    assert total_params(llama()) == 6400 + 6400 + 73984 + 64 == 86848
    assert total_params(llama(tie_embeddings=True)) == 86848 - 6400
    assert active_params(llama()) == total_params(llama())


def test_gpt2_params_by_hand():
    # embed 10*8 = 80, positions 4*8 = 32; layer: qkv 8*24 + 24 bias = 216, o 64 + 8 = 72,
    # MLP 8*32 + 32 + 32*8 + 8 = 552, two LayerNorms 2*(8+8) = 32 -> 872; final LN 16;
    # tied head adds nothing.
    assert total_params(gpt2()) == 80 + 32 + 872 + 16 == 1000
    assert total_params(gpt2(tie_embeddings=False)) == 1000 + 80


def _count(modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def test_params_match_hand_built_modules():
    c = llama()
    hd = c.hidden // c.heads
    layer = [
        nn.RMSNorm(c.hidden),
        nn.Linear(c.hidden, c.heads * hd, bias=False),
        nn.Linear(c.hidden, 2 * c.kv_heads * hd, bias=False),
        nn.Linear(c.heads * hd, c.hidden, bias=False),
        nn.RMSNorm(c.hidden),
        nn.Linear(c.hidden, 2 * c.ffn_hidden, bias=False),
        nn.Linear(c.ffn_hidden, c.hidden, bias=False),
    ]
    rest = [nn.Embedding(c.vocab, c.hidden), nn.RMSNorm(c.hidden), nn.Linear(c.hidden, c.vocab, bias=False)]
    assert total_params(c) == c.layers * _count(layer) + _count(rest)

    g = gpt2()
    h = g.hidden
    layer = [
        nn.LayerNorm(h),
        nn.Linear(h, 3 * h),
        nn.Linear(h, h),
        nn.LayerNorm(h),
        nn.Linear(h, g.ffn_hidden),
        nn.Linear(g.ffn_hidden, h),
    ]
    rest = [nn.Embedding(g.vocab, h), nn.Embedding(g.seq_len, h), nn.LayerNorm(h)]
    assert total_params(g) == g.layers * _count(layer) + _count(rest)


# ---------------------------------------------------------------- device peak


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(peak, "_warned", set())


def _as_cuda(monkeypatch, name):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: name)


@pytest.mark.parametrize(
    "name, dtype, expected",
    [
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),
        ("NVIDIA A100 80GB PCIe", torch.float16, 312e12),
        ("NVIDIA A100-SXM4-40GB", torch.float32, 19.5e12),
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
        ("NVIDIA H200", torch.bfloat16, 989e12),
        ("NVIDIA H800", torch.bfloat16, 989e12),
        ("NVIDIA A10", torch.bfloat16, 125e12),
        ("NVIDIA L4", torch.bfloat16, 121e12),
        ("NVIDIA L40S", torch.bfloat16, 362e12),
        ("Tesla V100-SXM2-16GB", torch.float16, 125e12),
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, 165.2e12),
    ],
)
def test_cuda_peak_table(monkeypatch, fresh_warnings, name, dtype, expected):
    _as_cuda(monkeypatch, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert device_peak_flops(torch.device("cuda"), dtype) == pytest.approx(expected)


def test_fp32_uses_tf32_peak_when_allowed(monkeypatch, fresh_warnings):
    _as_cuda(monkeypatch, "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert device_peak_flops(torch.device("cuda"), torch.float32) == pytest.approx(156e12)


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("NVIDIA Imaginary 9000", torch.bfloat16),
        ("NVIDIA A10G", torch.bfloat16),  # not the A10 and not A100
        ("NVIDIA H200 NVL", torch.bfloat16),  # known variant without a trusted number
        ("Tesla V100-SXM2-16GB", torch.bfloat16),  # no bf16 tensor cores
    ],
)
def test_unknown_peak_is_none_with_one_warning(monkeypatch, fresh_warnings, name, dtype):
    _as_cuda(monkeypatch, name)
    with pytest.warns(UserWarning, match="MFU will be null"):
        assert device_peak_flops(torch.device("cuda"), dtype) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second lookup stays silent
        assert device_peak_flops(torch.device("cuda"), dtype) is None


def test_cpu_peak_measured_then_cached(monkeypatch, tmp_path):
    threads_before = torch.get_num_threads()
    first = device_peak_flops("cpu", torch.float32, threads=1, cache_dir=str(tmp_path))
    assert first > 0
    assert torch.get_num_threads() == threads_before
    cache = json.loads((tmp_path / "cpu_peak_flops.json").read_text())
    assert list(cache.values()) == [first]
    assert [p.name for p in tmp_path.iterdir()] == ["cpu_peak_flops.json"]  # no temp left

    def boom(*a, **k):
        raise AssertionError("benchmark ran although the peak was cached")

    monkeypatch.setattr(peak, "_measure_cpu_peak", boom)
    assert device_peak_flops("cpu", torch.float32, threads=1, cache_dir=str(tmp_path)) == first
    with pytest.raises(AssertionError):  # another thread count is another key
        device_peak_flops("cpu", torch.float32, threads=2, cache_dir=str(tmp_path))


def test_cpu_peak_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("THREEFOLD_CACHE", str(tmp_path))
    monkeypatch.setattr(peak, "_measure_cpu_peak", lambda dtype: 123.0)
    assert device_peak_flops("cpu", torch.float32, threads=1) == 123.0
    assert list(json.loads((tmp_path / "cpu_peak_flops.json").read_text()).values()) == [123.0]


def test_cpu_low_precision_peak_never_below_fp32(monkeypatch, tmp_path):
    # A slow bf16 probe must not shrink the denominator: MFU would read above 100%.
    rates = {torch.float32: 100.0, torch.bfloat16: 2.0}
    monkeypatch.setattr(peak, "_measure_cpu_peak", lambda dtype: rates[dtype])
    assert device_peak_flops("cpu", torch.bfloat16, threads=1, cache_dir=str(tmp_path)) == 100.0
    rates[torch.bfloat16] = 300.0
    assert device_peak_flops("cpu", torch.bfloat16, threads=2, cache_dir=str(tmp_path)) == 300.0


def test_mfu():
    assert mfu(50e12, 100e12) == pytest.approx(0.5)
    assert mfu(50e12, None) is None


# ---------------------------------------------------------------- metrics files


def test_metrics_writer_json_lines(tmp_path):
    w = MetricsWriter(tmp_path / "logs", enabled=True)
    w.write({"step": 1, "loss": 2.5, "mfu": None, "grad_norm": torch.tensor(0.25)})
    w.write({"step": 2, "loss": float("nan"), "lr": 1e-4})
    w.close()
    with MetricsWriter(tmp_path / "logs", enabled=True) as w:  # appends, never truncates
        w.write({"step": 3, "loss": 2.0})
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert rows == [
        {"step": 1, "loss": 2.5, "mfu": None, "grad_norm": 0.25},
        {"step": 2, "loss": None, "lr": 1e-4},
        {"step": 3, "loss": 2.0},
    ]


def test_metrics_writer_disabled_writes_nothing(tmp_path):
    w = MetricsWriter(tmp_path / "logs", enabled=False)
    w.write({"step": 1})
    w.close()
    assert not (tmp_path / "logs").exists()


def test_run_json(tmp_path):
    config = {"model": {"arch": "llama", "hidden": 64}, "dtype": torch.bfloat16}
    layout = {"dp": 2, "tp": 1, "pp": 1}
    path = write_run_json(tmp_path, config, layout, {"seed": 7}, device="cpu")
    doc = json.loads(path.read_text())
    assert path == tmp_path / "run.json"
    assert doc["config"] == {"model": {"arch": "llama", "hidden": 64}, "dtype": "torch.bfloat16"}
    assert doc["layout"] == layout and doc["extra"] == {"seed": 7}
    assert doc["versions"]["torch"] == torch.__version__
    assert set(doc["versions"]) == {"python", "torch", "numpy", "threefold"}
    assert doc["hardware"]["device_type"] == "cpu" and doc["hardware"]["logical_cores"] >= 1
    assert datetime.fromisoformat(doc["start_time"]).tzinfo is not None
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_hardware_info_cuda(monkeypatch):
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    info = hardware_info(torch.device("cuda", 0))
    assert (info["device_name"], info["device_count"], info["device_memory_bytes"]) == (
        "NVIDIA H100 80GB HBM3",
        8,
        80 * 2**30,
    )


def test_peak_memory_cpu_is_process_rss():
    # Any Python process with torch imported has a peak RSS well above 10 MB.
    assert peak_memory_bytes("cpu") > 10 * 2**20
