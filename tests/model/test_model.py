import pytest
import torch
import torch.nn.functional as F

from threefold.config import build_config
from threefold.model import init as init_mod
from threefold.model.init import normal_shard
from threefold.model.layers import AttentionCore, apply_rope, rope_tables
from threefold.model.transformer import Transformer


def model_cfg(*pairs):
    return build_config(None, list(pairs)).model


@pytest.mark.parametrize("block_elements", [7, 64, 1 << 20])
def test_shards_are_slices_of_the_full_tensor(monkeypatch, block_elements):
    monkeypatch.setattr(init_mod, "BLOCK_ELEMENTS", block_elements)
    full = normal_shard("w", (12, 10), 0.02, seed=3)
    assert full.shape == (12, 10)
    assert torch.equal(normal_shard("w", (12, 10), 0.02, 3, dim=0, start=5, length=4), full[5:9])
    assert torch.equal(normal_shard("w", (12, 10), 0.02, 3, dim=1, start=2, length=3), full[:, 2:5])


def test_block_size_is_part_of_the_definition_not_the_layout(monkeypatch):
    # Same block size -> same tensor however it is sliced; the seed and name both matter.
    a = normal_shard("w", (8, 4), 1.0, seed=0)
    assert not torch.equal(a, normal_shard("w", (8, 4), 1.0, seed=1))
    assert not torch.equal(a, normal_shard("v", (8, 4), 1.0, seed=0))
    assert abs(normal_shard("big", (256, 256), 1.0, 0).std().item() - 1.0) < 0.02


def build(cfg, seed=0):
    from threefold.model.init import init_weights

    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    if cfg.tie_embeddings:
        model.head.weight = model.tok_embed.weight
    init_weights(model, cfg, seed)
    return model


def test_init_is_deterministic_and_stage_split_keeps_names():
    cfg = model_cfg()
    a, b = build(cfg), build(cfg)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    with torch.device("meta"):
        stage = Transformer(cfg, layer_ids=[2, 3], first=False, last=True)
    stage.to_empty(device="cpu")
    from threefold.model.init import init_weights

    init_weights(stage, cfg, 0)
    full = dict(a.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, full[name]), name


def test_norms_ones_biases_zero_and_scaled_output_init():
    cfg = model_cfg(("model.arch", "gpt2"), ("model.kv_heads", "4"), ("model.tie_embeddings", "true"))
    m = build(cfg)
    blk = m.layers["0"]
    assert torch.all(blk.attn_norm.weight == 1) and torch.all(blk.attn_norm.bias == 0)
    assert torch.all(blk.attn.wq.bias == 0)
    ratio = blk.attn.wo.weight.std() / blk.attn.wq.weight.std()
    assert 0.25 < ratio.item() < 0.45  # 1/sqrt(2*layers) = 0.354
    assert m.head.weight is m.tok_embed.weight


def test_forward_shapes_and_loss_is_a_token_sum():
    cfg = model_cfg()
    m = build(cfg)
    tokens = torch.randint(0, cfg.vocab, (3, 16))
    logits = m(tokens)
    assert logits.shape == (16, 3, cfg.vocab)
    targets = torch.randint(0, cfg.vocab, (3, 16))
    loss = m(tokens, targets)
    ref = F.cross_entropy(logits.transpose(0, 1).reshape(-1, cfg.vocab), targets.reshape(-1), reduction="sum")
    torch.testing.assert_close(loss, ref)


def test_causality_future_tokens_do_not_change_the_past():
    cfg = model_cfg()
    m = build(cfg)
    x = torch.randint(0, cfg.vocab, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % cfg.vocab
    torch.testing.assert_close(m(x)[:8], m(y)[:8])


def test_gqa_core_equals_repeated_kv():
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    out = AttentionCore()(q, k, v)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(out, ref)


def test_rope_preserves_norm_and_relative_positions():
    cos, sin = rope_tables(10, 8, 10000.0, torch.device("cpu"))
    x = torch.randn(10, 1, 1, 8)
    r = apply_rope(x, cos, sin)
    torch.testing.assert_close(r.norm(dim=-1), x.norm(dim=-1))
    # <R(p)q, R(p)k> depends only on the offset: same vectors at every position give equal dots.
    q = torch.randn(8).expand(10, 1, 1, 8)
    rq = apply_rope(q, cos, sin)
    dots = [(rq[i] * rq[i + 2]).sum() for i in range(8)]
    torch.testing.assert_close(torch.stack(dots), dots[0].expand(8))
