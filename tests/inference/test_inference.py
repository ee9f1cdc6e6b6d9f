"""Evaluation (held-out split, layout-invariant loss, eval during training), generation (KV
cache, sampling filters, trained vs untrained text) and tokenizers (tokenizer.json, BPE prepare)."""

from __future__ import annotations

import json
import string

import numpy as np
import pytest
import torch

from threefold.cli import main
from threefold.config import build_config
from threefold.data.split import heldout_starts, split_point, training_part
from threefold.inference.generate import KVCache, cached_forward, generate, sample
from threefold.model.init import init_weights
from threefold.model.transformer import Transformer

from harness import PARITY, run_training, within

TINY = {
    "model.preset": "tiny",
    "model.hidden": 64,
    "model.layers": 2,
    "model.ffn_hidden": 176,
    "model.seq_len": 32,
    "train.global_batch": 4,
    "train.micro_batch": 2,
    "train.warmup_steps": 1,
}


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("threefold: error:"), err
    return err


# --- held-out split --------------------------------------------------------------------------


def test_heldout_split_is_the_tail_and_disjoint_from_training():
    tokens = np.arange(1000, dtype=np.uint16)
    from threefold.data import TokenFile

    train = training_part(TokenFile(tokens, 256, "t"), 0.1)
    assert len(train) == split_point(1000, 0.1) == 900
    starts = heldout_starts(1000, 32, 0.1)
    assert starts[0] == 900 and np.all(starts + 33 <= 1000) and len(starts) == (100 - 1) // 32
    assert training_part(TokenFile(tokens, 256, "t"), 0.0).tokens is tokens  # default: nothing held out
    assert heldout_starts(1000, 32, 0.0, limit=5).tolist() == [0, 32, 64, 96, 128]


def test_eval_every_without_heldout_tokens_is_one_line(capsys, tmp_path):
    err = _one_line_error(capsys, ["train", "--train.eval_every", "2", "--log.dir", str(tmp_path)])
    assert "data.val_fraction" in err


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir):
    """A tiny run with held-out tokens, evaluated every 2 steps, checkpointed at the end."""
    root = tmp_path_factory.mktemp("eval")
    overrides = dict(
        TINY,
        **{
            "train.steps": 4,
            "data.val_fraction": 0.01,
            "train.eval_every": 2,
            "train.eval_sequences": 5,
            "checkpoint.dir": str(root / "ckpt"),
        },
    )
    metrics = run_training(overrides, root / "log", cache_dir)
    return metrics, root / "ckpt"


def test_training_logs_val_loss(trained):
    metrics, _ = trained
    assert [("val_loss" in m) for m in metrics] == [False, True, False, True]
    assert 0 < metrics[-1]["val_loss"] < 6.0


@pytest.mark.parametrize("layout", [{"parallel.dp": 2, "parallel.zero": 3}, {"parallel.pp": 2}])
def test_in_training_eval_is_layout_invariant(layout, trained, tmp_path, cache_dir):
    """ZeRO-3 gathers parameters collectively in every forward (5 windows over dp 2: one rank
    runs a discarded extra micro-batch to keep in step), pipelines pass activations: the
    held-out loss logged during training is the single-process one."""
    metrics, _ = trained
    overrides = dict(
        TINY,
        **{"train.steps": 4, "data.val_fraction": 0.01, "train.eval_every": 2, "train.eval_sequences": 5},
        **layout,
    )
    other = run_training(overrides, tmp_path / "log", cache_dir)
    within(
        f"{layout} training loss vs one process",
        max(abs(a["loss"] - b["loss"]) for a, b in zip(metrics, other)),
        PARITY,
    )
    within(
        f"{layout} held-out loss vs one process",
        max(abs(a.get("val_loss", 0.0) - b.get("val_loss", 0.0)) for a, b in zip(metrics, other)),
        PARITY,
    )


def test_eval_equals_in_training_eval_in_every_layout(trained, capsys, cache_dir):
    metrics, ckpt = trained
    results = []
    for layout in ([], ["--parallel.tp", "2", "--parallel.sp", "true"], ["--parallel.pp", "2"]):
        assert (
            main(
                [
                    "eval",
                    "--checkpoint",
                    str(ckpt),
                    "--json",
                    "--train.eval_sequences",
                    "5",
                    "--data.cache_dir",
                    cache_dir,
                    *layout,
                ]
            )
            == 0
        )
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    for r in results:
        assert r["tokens"] == 5 * 32
        within("threefold eval vs in-training held-out loss", abs(r["loss"] - metrics[-1]["val_loss"]), PARITY)
        assert abs(r["perplexity"] - np.exp(r["loss"])) < 1e-6 * r["perplexity"]


def test_eval_refuses_a_new_shape(trained, capsys):
    _, ckpt = trained
    err = _one_line_error(capsys, ["eval", "--checkpoint", str(ckpt), "--model.hidden", "128"])
    assert "model.hidden" in err


# --- generation -------------------------------------------------------------------------------


def _random_model(arch: str) -> Transformer:
    cfg = build_config(
        None,
        [
            ("model.arch", arch),
            ("model.hidden", "64"),
            ("model.layers", "2"),
            ("model.seq_len", "32"),
            ("model.kv_heads", "4" if arch == "gpt2" else "2"),
        ],
    )
    model = Transformer(cfg.model)
    init_weights(model, cfg.model, seed=3)
    return model.eval()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_kv_cache_matches_full_forward(arch):
    model = _random_model(arch)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens).transpose(0, 1)
    cache = KVCache(len(model.layers))
    pieces = [cached_forward(model, tokens[:, a:b], cache) for a, b in ((0, 9), (9, 10), (10, 11), (11, 24))]
    assert cache.length == 24
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() < 1e-5


def test_sampling_filters():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]])
    assert sample(logits, 0.0, 0, 1.0, gen).item() == 1
    # top-k 2 keeps ids 1 and 2 only; top-p 0.5 keeps id 1 alone (its probability is ~0.45 < 0.5,
    # so id 2 joins it): every draw stays inside the kept set.
    draws = {sample(logits, 1.0, 2, 1.0, gen).item() for _ in range(200)}
    assert draws == {1, 2}
    assert {sample(logits, 1.0, 0, 0.3, gen).item() for _ in range(50)} == {1}
    assert {sample(logits, 1.0, 0, 0.5, gen).item() for _ in range(200)} == {1, 2}
    wide = {sample(logits, 5.0, 0, 1.0, gen).item() for _ in range(400)}
    assert wide == {0, 1, 2, 3, 4}


def test_generation_is_seeded_and_stops_at_the_position_limit():
    model = _random_model("gpt2")
    a = generate(model, [5, 6, 7], 100, temperature=1.0, seed=1)
    assert a == generate(model, [5, 6, 7], 100, temperature=1.0, seed=1)
    assert len(a) == 32 - 3  # a GPT-2 position table ends at seq_len


def python_like(text: str) -> bool:
    """Printable ASCII made mostly of what Python source is made of: lowercase identifiers,
    spaces and the punctuation of attribute access, calls and assignment."""
    if not text:
        return False
    printable = sum(c in string.printable for c in text) / len(text)
    source = sum(c in string.ascii_lowercase + " \n_.()=:,'" for c in text) / len(text)
    return printable > 0.97 and source > 0.85 and " " in text


def test_generate_prints_python_after_brief_training_and_noise_before(tmp_path, cache_dir, capsys):
    overrides = dict(
        TINY,
        **{
            "model.seq_len": 64,
            "train.global_batch": 8,
            "train.micro_batch": 8,
            "train.steps": 200,
            "train.lr": 0.01,
            "train.warmup_steps": 10,
            "checkpoint.dir": str(tmp_path / "ckpt"),
            "checkpoint.interval": 200,
        },
    )
    untrained = tmp_path / "untrained"
    run_training(
        dict(
            overrides,
            **{"train.steps": 1, "train.lr": 1e-9, "checkpoint.dir": str(untrained), "checkpoint.interval": 1},
        ),
        tmp_path / "log0",
        cache_dir,
    )
    run_training(overrides, tmp_path / "log", cache_dir)
    capsys.readouterr()  # the runs' own lines ("saved ...; sample from it: ...")
    texts = {}
    for name, ckpt in (("untrained", untrained), ("trained", tmp_path / "ckpt")):
        assert (
            main(
                [
                    "generate",
                    "--checkpoint",
                    str(ckpt),
                    "--prompt",
                    "def ",
                    "--temperature",
                    "0.5",
                    "--top-k",
                    "20",
                    "--max-new-tokens",
                    "60",
                    "--seed",
                    "0",
                ]
            )
            == 0
        )
        out = capsys.readouterr().out
        assert out.startswith("def ")
        texts[name] = out[len("def ") :].rstrip("\n")
    assert python_like(texts["trained"]), texts["trained"]
    assert not python_like(texts["untrained"]), texts["untrained"]


# --- tokenizers -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("bpe")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(6):
        lines = (f"def f{j}(self, x):\n    return self.x + {i * j}\n" for j in range(40))
        (corpus / f"m{i}.py").write_text("".join(lines))
    assert main(["data", "prepare", "--data.path", str(corpus), "--vocab", "300", "--out", str(root / "out")]) == 0
    return corpus, root / "out"


def test_prepare_writes_a_bpe_tokenizer_and_its_token_stream(prepared):
    from threefold.data.tokenizer import FileTokenizer

    corpus, out = prepared
    tok = FileTokenizer(str(out / "tokenizer.json"))
    meta = json.loads((out / "tokens.json").read_text())
    assert tok.vocab_size == meta["vocab"] <= 300 and tok.separator == 0
    ids = np.fromfile(out / "tokens.bin", dtype=meta["dtype"])
    assert len(ids) == meta["num_tokens"] < sum(f.stat().st_size for f in corpus.iterdir()) / 2  # BPE compresses
    docs = np.split(ids[:-1], np.flatnonzero(ids[:-1] == tok.separator))  # every document ends with the id
    texts = [tok.decode(d[d != tok.separator].tolist()) for d in docs]
    assert texts == [f.read_text() for f in sorted(corpus.iterdir())]


def test_text_corpus_through_a_tokenizer_file(prepared, tmp_path):
    from threefold.data import load_tokens
    from threefold.data.tokenizer import FileTokenizer

    corpus, out = prepared
    stream = load_tokens(str(corpus / "m1.py"), 0, "uint16", str(tmp_path), str(out / "tokenizer.json"))
    tok = FileTokenizer(str(out / "tokenizer.json"))
    assert stream.vocab_size == tok.vocab_size
    assert stream.tokens.tolist() == tok.encode((corpus / "m1.py").read_text())


def test_tokenizer_larger_than_the_model_is_one_line(prepared, capsys, tmp_path):
    _, out = prepared
    err = _one_line_error(
        capsys,
        [
            "train",
            "--model.preset",
            "tiny",
            "--data.path",
            str(out / "tokens.bin"),
            "--data.tokenizer",
            str(out / "tokenizer.json"),
            "--log.dir",
            str(tmp_path),
        ],
    )
    assert "model.vocab" in err and "300" in err


def test_generate_refuses_a_tokenizer_larger_than_the_model(prepared, trained, capsys):
    _, out = prepared
    _, ckpt = trained
    err = _one_line_error(
        capsys, ["generate", "--checkpoint", str(ckpt), "--prompt", "x", "--tokenizer", str(out / "tokenizer.json")]
    )
    assert "tokenizer has 300 ids but model.vocab is 256" in err
