"""data.document_mask: block-diagonal causal attention and per-document positions inside packed
sequences, equal to the unmasked path on one-document sequences, correct on packed ones, and the
same under TP/SP/PP as in one process."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from threefold.config import build_config
from threefold.data.documents import document_layout, document_separator
from threefold.errors import ConfigError
from threefold.model import layers
from threefold.model.init import init_weights
from threefold.model.layers import AttentionCore
from threefold.model.transformer import Transformer
from threefold.validate import validate

from harness import CALM_LR, assert_parity, run_training, run_training_many, within

SEP = 0


def _model(arch: str = "llama", seed: int = 0) -> Transformer:
    pairs = [("model.arch", arch), ("model.layers", "2"), ("model.hidden", "32"), ("model.heads", "4")]
    pairs += [("model.kv_heads", "2" if arch == "llama" else "4"), ("model.ffn_hidden", "64"), ("model.seq_len", "16")]
    cfg = build_config(None, pairs).model
    model = Transformer(cfg)
    init_weights(model, cfg, seed)
    return model


def test_layout_splits_after_each_separator():
    tokens = torch.tensor([[5, 6, SEP, 7, 8, 9, SEP, SEP, 4]])
    docs = document_layout(tokens, SEP)
    # The separator closes its own document; the token after it starts the next at position 0.
    assert docs.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0]]
    segment = [0, 0, 0, 1, 1, 1, 1, 2, 3]
    want = [[segment[i] == segment[j] and j <= i for j in range(9)] for i in range(9)]
    assert docs.mask.shape == (1, 1, 9, 9) and docs.mask[0, 0].tolist() == want
    plain = document_layout(torch.tensor([[3, 4, 5, SEP]]), SEP)  # one document ending in its separator
    assert plain.positions.tolist() == [[0, 1, 2, 3]] and plain.mask[0, 0].equal(torch.ones(4, 4).tril().bool())


def test_one_attention_row_is_the_hand_computed_masked_softmax():
    torch.manual_seed(0)
    tokens = torch.tensor([[5, 6, SEP, 7, 8, 9, SEP, 4]])
    mask = document_layout(tokens, SEP).mask
    q, k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    out = AttentionCore()(q, k, v, mask=mask)
    # Row 5 (third token of the second document) sees keys 3, 4, 5 only, head by head.
    for h in range(2):
        scores = [float(q[0, h, 5] @ k[0, h, j]) / math.sqrt(4) for j in (3, 4, 5)]
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        want = sum(w * v[0, h, j] for w, j in zip(weights, (3, 4, 5))) / sum(weights)
        torch.testing.assert_close(out[0, h, 5], want, rtol=1e-5, atol=1e-6)
    unmasked = AttentionCore()(q, k, v)
    assert not torch.allclose(out[0, :, 5], unmasked[0, :, 5])  # the causal row sees keys 0-2 too


def _reference_attention(q, k, v, mask):
    """Masked GQA attention by hand in float64: every query head's kv head repeated, the scores
    materialized, the keys outside the mask at -inf."""
    k, v = (t.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1, output_size=q.shape[1]) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def _cuda_kernel_rules(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch._fused_sdp_choice as CUDA answers it for these calls: flash refuses an explicit
    mask, the memory-efficient kernel refuses enable_gqa, so a masked GQA call gets math."""
    if attn_mask is None:
        return SDPBackend.FLASH_ATTENTION.value
    return (SDPBackend.MATH if enable_gqa else SDPBackend.EFFICIENT_ATTENTION).value


@pytest.fixture
def sdpa_calls(monkeypatch):
    """The (k heads, enable_gqa) of every SDPA call made while the test runs."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        calls.append((k.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    layers._served_by.cache_clear()  # the kernel choice is cached per kind of call
    yield calls
    layers._served_by.cache_clear()


def _packed_qkv(requires_grad: bool = True):
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 256, (2, 48), generator=gen)
    tokens[0, [5, 20, 21, 40]] = SEP
    tokens[1, [30]] = SEP
    q, k, v = (torch.randn(2, h, 48, 16, generator=gen, requires_grad=requires_grad) for h in (8, 2, 2))
    return q, k, v, document_layout(tokens, SEP).mask


@pytest.mark.parametrize("kernels", ["this device", "cuda rules"])
def test_masked_gqa_attention_equals_the_math_reference(kernels, sdpa_calls, monkeypatch):
    """Forward and gradients of masked GQA attention (8 query heads, 2 kv heads) equal the
    float64 math reference, as this device serves it and where SDPA would fall to its math
    kernel (CUDA's rules): there the core expands K/V to the query heads for a fused kernel."""
    if kernels == "cuda rules":
        monkeypatch.setattr(torch, "_fused_sdp_choice", _cuda_kernel_rules)
    q, k, v, mask = _packed_qkv()
    core = AttentionCore()
    out = core(q, k, v, mask=mask)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    got = torch.autograd.grad(out, (q, k, v), grad)
    want_out = _reference_attention(q, k, v, mask)
    want = torch.autograd.grad(want_out, (q, k, v), grad.double())  # back in fp32, as q, k, v
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"d{name}: {m}")
    if kernels == "cuda rules":  # one fused call with K/V at the query heads; the causal one stays GQA
        assert sdpa_calls == [(8, False)] and core.served_by(q, k, v, mask) == "efficient", sdpa_calls
        core(q, k, v)
        assert sdpa_calls[-1] == (2, True) and core.served_by(q, k, v) == "flash"
    else:  # CPU's flash kernel takes the mask and GQA: K/V stay at kv heads (memory, no copy)
        assert sdpa_calls == [(2, True)] and core.served_by(q, k, v, mask) == "flash", sdpa_calls


@pytest.mark.parametrize("restrict", [None, SDPBackend.MATH], ids=["every kernel", "math alone"])
def test_served_by_names_the_kernel_that_ran(restrict):
    """What AttentionCore.served_by reports (what a GPU run records) is the aten kernel the
    profiler sees run, forward and backward, with every kernel allowed and with math alone."""
    from torch.profiler import profile

    ops = {
        "flash": "aten::_scaled_dot_product_flash_attention_for_cpu",
        "math": "aten::_scaled_dot_product_attention_math",
    }
    q, k, v, mask = _packed_qkv()
    core = AttentionCore()
    with sdpa_kernel([restrict]) if restrict else contextlib.nullcontext():
        served = core.served_by(q, k, v, mask)
        with profile() as prof:
            core(q, k, v, mask=mask).sum().backward()
    ran = {e.name for e in prof.events()}
    assert served == ("math" if restrict else "flash"), served
    assert ops[served] in ran and not any(op in ran for name, op in ops.items() if name != served), ran


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_one_document_sequences_match_the_unmasked_path(arch):
    model = _model(arch)
    tokens = torch.randint(1, 256, (3, 16))  # no separator: every sequence is one document
    targets = torch.randint(0, 256, (3, 16))
    tokens[1, -1] = SEP  # a window ending on its document's separator is still one document
    plain = model(tokens, targets)
    masked = model(tokens, targets, documents=document_layout(tokens, SEP))
    within(
        f"{arch} one-document masked vs unmasked loss",
        abs(float(masked.detach() - plain.detach())) / tokens.numel(),
        1e-5,
    )


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_packed_documents_see_only_themselves(arch):
    """Each document's logits in a packed window equal those of the document alone: attention stops
    at the boundary and positions (RoPE, or GPT-2's learned table) restart there."""
    model = _model(arch)
    torch.manual_seed(1)
    first, second = torch.randint(1, 256, (6,)), torch.randint(1, 256, (9,))
    packed = torch.cat([first, torch.tensor([SEP]), second])[None]  # 16 tokens, two documents
    docs = document_layout(packed, SEP)
    logits = model(packed, documents=docs)[:, 0]  # [seq, vocab]
    alone = model(second[None])[:, 0]
    torch.testing.assert_close(logits[7:], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[:7], model(packed[:, :7])[:, 0], rtol=1e-5, atol=1e-5)
    # The unmasked path lets the second document read the first (and count from its start).
    gap = (model(packed)[7:, 0] - alone).abs().max()
    assert gap > 100 * 1e-5, gap


def test_rope_restarts_at_each_document():
    """Within one document's block, RoPE scores depend on offsets only, so the logits above cannot
    tell a reset from a shift; the rotation itself must: a document's first token is at angle 0."""
    model = _model("llama")
    attn = model.layers["0"].attn
    seen = {}
    attn.register_forward_pre_hook(lambda mod, args: seen.update(x=args[0]))
    attn.core.register_forward_pre_hook(lambda mod, args: seen.update(q=args[0]))
    packed = torch.tensor([[5, 6, 7, SEP, 8, 9, 10, 11]])
    model(packed, documents=document_layout(packed, SEP))
    plain = attn.wq(seen["x"]).view(8, 1, -1, attn.head_dim).permute(1, 2, 0, 3)  # unrotated
    torch.testing.assert_close(seen["q"][:, :, [0, 4]], plain[:, :, [0, 4]])  # both documents start at 0
    assert not torch.allclose(seen["q"][:, :, 5], plain[:, :, 5])  # position 1 is rotated


@pytest.mark.parametrize("mode, kernels", [("selective", "math"), ("full", "math"), ("full", "all")])
def test_recompute_reruns_with_the_mask(mode, kernels):
    """Selective recompute reruns only a core that materializes its scores: the math kernel."""
    from threefold.model.recompute import apply_recompute

    packed = torch.tensor([[5, 6, SEP, 7, 8, 9, SEP, 4, 3, 2, 1, SEP, 9, 9, 8, 7]])
    targets = packed.roll(-1, 1)
    docs = document_layout(packed, SEP)
    grads = []
    with sdpa_kernel([SDPBackend.MATH]) if kernels == "math" else contextlib.nullcontext():
        for model in (_model("llama"), apply_recompute(_model("llama"), mode)):
            model(packed, targets, documents=docs).backward()
            grads.append(model.layers["0"].attn.wq.weight.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_config_refuses_what_it_cannot_mask(tmp_path):
    tok = tmp_path / "tokenizer.json"
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tok))
    cfg = build_config(None, [("data.document_mask", "true"), ("data.tokenizer", str(tok)), ("model.vocab", "256")])
    with pytest.raises(ConfigError, match="data.document_mask: data.tokenizer .* has no end-of-document"):
        validate(cfg, 1)
    assert document_separator("") == 0
    cfg = build_config(None, [("data.document_mask", "true"), ("model.arch", "own_model_gptj:build")])
    with pytest.raises(ConfigError, match="data.document_mask: not supported for a user model"):
        validate(cfg, 1)


@pytest.fixture(scope="module")
def packed_corpus(tmp_path_factory):
    """Many short text files: a byte stream with a separator every ~20-60 tokens, so most
    32-token windows hold pieces of two or three documents."""
    root = tmp_path_factory.mktemp("packed")
    for i in range(400):
        (root / f"doc{i:03d}.txt").write_text(f"doc {i}: " + "lorem ipsum dolor "[: 5 + i % 13] * (1 + i % 4))
    return str(root)


TINY = {"model.layers": 4, "model.hidden": 32, "model.heads": 4, "model.kv_heads": 2, "model.ffn_hidden": 64}
RUN = {**TINY, "model.seq_len": 32, "train.global_batch": 8, "train.micro_batch": 2, "train.steps": 4}
RUN |= {"train.lr": CALM_LR, "train.seed": 0, "data.document_mask": "true", "checkpoint.dir": ""}


def test_document_mask_is_layout_invariant_under_tp_sp_pp(packed_corpus, tmp_path, cache_dir):
    base = {**RUN, "data.path": packed_corpus}
    one = run_training(base, tmp_path / "one", cache_dir)
    unmasked = run_training({**base, "data.document_mask": "false"}, tmp_path / "unmasked", cache_dir)
    gpt2 = {**base, "model.arch": "gpt2", "model.kv_heads": 4}
    gpt2_one = run_training(gpt2, tmp_path / "gpt2-one", cache_dir)
    runs = {
        "tp2-sp-pp2": {**base, "parallel.tp": 2, "parallel.sp": "true", "parallel.pp": 2},
        "gpt2-tp2-sp-dp2": {**gpt2, "parallel.tp": 2, "parallel.sp": "true", "parallel.dp": 2},
    }
    got = run_training_many(runs, tmp_path, cache_dir, world=4)
    assert_parity("document mask tp2 sp pp2 vs one process, loss", one, got["tp2-sp-pp2"])
    assert_parity("document mask gpt2 tp2 sp dp2 vs one process, loss", gpt2_one, got["gpt2-tp2-sp-dp2"])
    gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(one, unmasked))
    assert gap > 10 * 1e-5, [(a["loss"], b["loss"]) for a, b in zip(one, unmasked)]  # packed: the mask matters
