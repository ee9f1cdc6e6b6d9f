"""Weighted blends: Megatron and TOML syntax, shares, layout-invariant and resumable order,
independent epochs per dataset, per-dataset token counts, training on a blend."""

from __future__ import annotations

import json

import numpy as np
import pytest

from threefold.cli import main
from threefold.data import GlobalBatchSampler, load_tokens
from threefold.data.blend import Blend, Part, parse_blend, tokens_per_dataset
from threefold.data.split import training_part
from threefold.errors import ConfigError

SEQ = 8


def _blend(sizes=(4000, 3000, 500), weights=(0.7, 0.2, 0.1)):
    # Dataset d holds ids d*10000 + position, so every row says where it came from.
    parts = [
        Part(f"d{d}", w, (d * 10000 + np.arange(n)).astype(np.uint32)) for d, (n, w) in enumerate(zip(sizes, weights))
    ]
    return Blend(parts)


def _rows(blend, steps, gb=40, dp=1, mb=None, start=0, seed=5):
    s = GlobalBatchSampler(len(blend), SEQ, gb, seed)
    out = []
    for step in range(start, steps):
        for r in range(dp):
            for x, y in s.microbatches(blend, step, r, dp, mb or gb // dp):
                out.append(np.concatenate([x.numpy(), y.numpy()[:, -1:]], axis=1))
    return np.concatenate(out)


def test_parse_megatron_and_toml_syntax(tmp_path):
    assert parse_blend("0.7 web/ 0.2 code/ 0.1 books/") == [(0.7, "web/"), (0.2, "code/"), (0.1, "books/")]
    assert parse_blend("web/") is None and parse_blend("") is None
    (tmp_path / "b.toml").write_text('[[blend]]\npath = "a"\nweight = 3\n[[blend]]\npath = "b"\nweight = 1\n')
    assert parse_blend(str(tmp_path / "b.toml")) == [(3.0, str(tmp_path / "a")), (1.0, str(tmp_path / "b"))]
    for bad, msg in [("0.7 web/ 0.3", "odd number"), ("0.7 a x b", "weight 'x'"), ("0.5 a -1 b", "must all be > 0")]:
        with pytest.raises(ConfigError, match=msg):
            parse_blend(bad)


def test_three_way_shares_within_one_percent_over_1000_samples():
    rows = _rows(_blend(), 25)  # 25 steps x 40 = 1,000 samples
    assert len(rows) == 1000
    share = np.bincount(rows[:, 0] // 10000, minlength=3) / 1000
    assert np.abs(share - [0.7, 0.2, 0.1]).max() <= 0.01, share
    assert (rows // 10000 == rows[:, :1] // 10000).all()  # no row mixes datasets


def test_order_is_layout_invariant_and_resumes_exactly():
    straight = _rows(_blend(), 12)
    assert np.array_equal(straight, _rows(_blend(), 12, dp=4, mb=2))
    assert np.array_equal(straight, _rows(_blend(), 12, dp=2, mb=5))
    resumed = _rows(_blend(), 12, dp=4, mb=10, start=7)  # a fresh blend and sampler at step 7
    assert np.array_equal(straight[7 * 40 :], resumed)
    assert not np.array_equal(straight, _rows(_blend(), 12, seed=6))


def test_small_dataset_epochs_leave_the_others_alone():
    small, large = _rows(_blend(sizes=(4000, 3000, 100)), 30), _rows(_blend(sizes=(4000, 3000, 900)), 30)
    ds = small[:, 0] // 10000
    assert np.array_equal(ds, large[:, 0] // 10000)
    assert np.array_equal(small[ds < 2], large[ds < 2])
    # The 100-token dataset has 12 windows: every epoch of it covers each window exactly once.
    third = small[ds == 2][:, 0] - 20000
    for e in range(len(third) // 12):
        assert sorted(third[12 * e : 12 * e + 12]) == sorted(SEQ * np.arange(12))
    assert not np.array_equal(third[:12], third[12:24])  # each epoch reshuffled
    # ... while the 4000-token one (499 windows) is still in its first epoch: no window twice.
    first = small[ds == 0][:, 0]
    assert len(first) > 499 and len(set(first[:499].tolist())) == 499 and first[499] in first[:499]


def test_tokens_per_dataset_counts_the_schedule():
    blend = _blend()
    rows = _rows(blend, 10)
    counts = tokens_per_dataset(blend, 400, SEQ)
    assert counts == {f"d{d}": int((rows[:, 0] // 10000 == d).sum()) * SEQ for d in range(3)}
    assert tokens_per_dataset(np.zeros(10), 400, SEQ) == {}


def test_blend_through_load_tokens_and_training(tmp_path, capsys):
    for name, text in [("web", "abc " * 3000), ("code", "def f(): pass\n" * 400), ("books", "Once upon " * 200)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "t.txt").write_text(text)
    spec = f"0.6 {tmp_path / 'web'} 0.3 {tmp_path / 'code'} 0.1 {tmp_path / 'books'}"
    stream = load_tokens(spec, cache_dir=str(tmp_path / "cache"))
    assert isinstance(stream.tokens, Blend) and stream.vocab_size == 256 and "blend of 0.6" in stream.source
    assert stream.tokens[np.array([0, 12000, 12001])].tolist() == [ord("a"), ord("d"), ord("e")]
    with pytest.raises(ConfigError, match="data.val_fraction"):
        training_part(stream, 0.1)
    args = ["train", "--model.preset", "tiny", "--model.layers", "1", "--model.hidden", "32", "--model.heads", "2"]
    args += [
        "--model.ffn_hidden",
        "64",
        "--model.seq_len",
        "16",
        "--train.global_batch",
        "4",
        "--train.micro_batch",
        "2",
    ]
    args += ["--train.steps", "2", "--data.path", spec, "--data.cache_dir", str(tmp_path / "cache")]
    assert main([*args, "--log.dir", str(tmp_path / "run"), "--log.quiet", "true"]) == 0
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([s for s in steps if "loss" in s]) == 2


def test_blend_resumes_after_reshard_tp2pp2_to_dp4(tmp_path, cache_dir):
    """A three-way blend saved at step 3 by tp2 x pp2 and resumed by dp4 continues the same sample
    stream (per-dataset token counts equal, exactly) with the losses of the uninterrupted tp2 x pp2
    run within layout parity (1e-5: the fp32 reduction order differs between layouts). Resumed by
    tp2 x pp2 itself, the run is bitwise the uninterrupted one: the resume adds no error at all."""
    from harness import CALM_LR, assert_parity, run_training_many

    for name, text in [("web", "abc def " * 900), ("code", "def f(): pass\n" * 300), ("books", "Once upon " * 300)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "t.txt").write_text(text)
    base = {"data.path": f"0.6 {tmp_path / 'web'} 0.3 {tmp_path / 'code'} 0.1 {tmp_path / 'books'}"}
    base |= {"model.layers": 2, "model.hidden": 32, "model.heads": 4, "model.kv_heads": 2, "model.ffn_hidden": 64}
    base |= {"model.seq_len": 16, "train.global_batch": 8, "train.micro_batch": 2, "train.steps": 6}
    base |= {"train.lr": CALM_LR, "train.seed": 0}
    ckpt = tmp_path / "ckpt"
    runs = {
        "tp2pp2": {**base, "parallel.tp": 2, "parallel.pp": 2, "checkpoint.dir": ckpt, "checkpoint.interval": 3},
        "dp4": {**base, "parallel.dp": 4, "checkpoint.dir": "", "checkpoint.resume": ckpt / "step_00000003"},
        "tp2pp2-again": {**base, "parallel.tp": 2, "parallel.pp": 2, "checkpoint.dir": ""}
        | {"checkpoint.resume": ckpt / "step_00000003"},
    }
    got = run_training_many(runs, tmp_path / "runs", cache_dir, world=4)
    straight, resumed, again = got["tp2pp2"], got["dp4"], got["tp2pp2-again"]
    keys = ("step", "loss", "grad_norm", "tokens", "data_tokens")
    assert [[r[k] for k in keys] for r in again] == [[r[k] for k in keys] for r in straight[3:]]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["data_tokens"] for r in resumed] == [r["data_tokens"] for r in straight[3:]]
    assert set(resumed[-1]["data_tokens"]) == {str(tmp_path / n) for n in ("web", "code", "books")}
    assert_parity("blend tp2pp2 checkpoint resumed in dp4, loss", straight[3:], resumed)
