"""Activation recomputation (model/recompute.py) in one process: what it wraps, that it
reproduces dropout exactly, and the activation memory it leaves, against the formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from threefold.distributed.parallelize import build_model
from threefold.model.activations import SavedTensorMeter, layer_activation_elements
from threefold.model.layers import rope_tables
from threefold.model.recompute import apply_recompute
from threefold.model.transformer import Transformer

from tp_checks import model_config, reference_grid


def _model(**over):
    cfg = model_config({"model.layers": 3, "model.seq_len": 32, **over})
    return cfg, build_model(cfg, reference_grid(), torch.device("cpu"))


def test_modes_wrap_the_right_modules_and_keep_names():
    cfg = model_config({})
    plain = {n for n, _ in Transformer(cfg.model).named_parameters()}
    for mode, layers, wrapped in (("selective", 0, "core"), ("full", 0, "block"), ("full", 2, "block")):
        model = apply_recompute(Transformer(cfg.model), mode, layers)
        assert {n for n, _ in model.named_parameters()} == plain
        blocks = list(model.layers.values())
        marks = [getattr(b.attn.core if wrapped == "core" else b, "recomputed", False) for b in blocks]
        assert marks == [True] * (layers or len(blocks)) + [False] * (len(blocks) - (layers or len(blocks)))
    with pytest.raises(ValueError, match="valid: none, selective, full"):
        apply_recompute(Transformer(cfg.model), "some", 0)


@pytest.mark.parametrize("attention, reruns", [("flash", 0), ("math", 1)])
def test_selective_reruns_only_a_core_that_materializes_its_scores(attention, reruns, monkeypatch):
    """Selective recompute drops the s x s scores of an unfused core (Korthikanti et al.) by
    rerunning it in backward; a fused core keeps no such tensor, so it runs once."""
    cfg, model = _model(**{"train.recompute": "selective"})
    assert all(b.attn.core.recomputed for b in model.layers.values())
    calls, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    tokens = torch.randint(0, cfg.model.vocab, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(0))
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[attention]
    with sdpa_kernel([backend]):
        loss = model(tokens, tokens)
        forward = len(calls)
        loss.backward()
    assert forward == cfg.model.layers and len(calls) - forward == reruns * cfg.model.layers, (forward, len(calls))


def test_dropout_masks_are_reproduced_exactly():
    grads = {}
    for mode in ("none", "selective", "full"):
        cfg, model = _model(**{"model.dropout": 0.3, "train.recompute": mode})
        tokens = torch.randint(0, cfg.model.vocab, (2, 32), generator=torch.Generator().manual_seed(0))
        model(tokens, tokens).backward()
        grads[mode] = [p.grad for p in model.parameters()]
    for mode in ("selective", "full"):
        assert all(torch.equal(a, b) for a, b in zip(grads[mode], grads["none"])), mode


@pytest.mark.parametrize("attention", ["flash", "math"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_saved_activations_match_the_formula(attention, mode):
    cfg, model = _model(**{"train.recompute": mode})
    m = cfg.model
    tables = rope_tables(m.seq_len, m.head_dim, m.rope_theta, torch.device("cpu"))
    tokens = torch.randint(0, m.vocab, (2, m.seq_len))
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[attention]
    with sdpa_kernel([backend]):
        with SavedTensorMeter(model, exclude=list(tables)) as meter:
            loss = model(tokens, tokens)
        loss.backward()
    want = 4 * layer_activation_elements(
        m.seq_len, 2, m.hidden, m.heads, m.kv_heads, m.ffn_hidden, recompute=mode, attention=attention
    )
    assert meter.per_layer() == pytest.approx(want, rel=1e-9)
