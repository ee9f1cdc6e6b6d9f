"""threefold.data: tokenizer, corpus cache, layout-invariant sampler, prefetcher."""

from __future__ import annotations

import sysconfig
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from threefold.data import ByteTokenizer, GlobalBatchSampler, Prefetcher, load_tokens, stdlib_source_files
from threefold.errors import ConfigError, DataError

# --- tokenizer -------------------------------------------------------------------------


def test_byte_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ∑ 🐍'\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < tok.vocab_size == 256
    assert tok.decode(ids) == text
    assert tok.decode(ids[:-3] + [0xF0]).endswith("\ufffd")  # cut character: replaced


# --- corpus ----------------------------------------------------------------------------


def _write_docs(root: Path) -> list[bytes]:
    docs = {"b.txt": "second doc\n", "a.py": "print('first')\n", "sub/c.md": "# third ü\n"}
    for rel, text in docs.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    (root / "blob.dat").write_bytes(b"\xff\xfe\x00binary")  # skipped: not UTF-8
    (root / ".hidden").write_text("not trained on")
    return [docs[k].encode() for k in sorted(docs)]  # a.py, b.txt, sub/c.md


def test_text_dir_tokens_are_bytes_joined_by_nul(tmp_path):
    data = tmp_path / "corpus"
    data.mkdir()
    docs = _write_docs(data)
    tf = load_tokens(str(data), 0, "uint16", str(tmp_path / "cache"))
    assert tf.vocab_size == 256
    assert bytes(tf.tokens.astype(np.uint8)) == b"\0".join(docs)
    assert "3 files" in tf.source and "1 binary" in tf.source


def test_single_text_file(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("hello world")
    tf = load_tokens(str(f), 0, "uint16", str(tmp_path / "cache"))
    assert bytes(tf.tokens.astype(np.uint8)) == b"hello world"


def test_cache_reused_and_invalidated(tmp_path):
    data, cache = tmp_path / "corpus", tmp_path / "cache"
    data.mkdir()
    _write_docs(data)
    load_tokens(str(data), 0, "uint16", str(cache))
    (bin_file,) = cache.glob("tokens-*.bin")
    assert bin_file.with_suffix(".json").is_file()
    before = bin_file.stat()
    tf = load_tokens(str(data), 0, "uint16", str(cache))
    after = bin_file.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not list(cache.glob(".*.tmp"))  # no temp files left behind
    # Editing a file changes the key: a second cache, with the new content.
    (data / "a.py").write_text("print('first!!!')\n")
    tf2 = load_tokens(str(data), 0, "uint16", str(cache))
    assert len(list(cache.glob("tokens-*.bin"))) == 2 and len(tf2) == len(tf) + 3


def test_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("THREEFOLD_CACHE", str(tmp_path / "envcache"))
    f = tmp_path / "t.txt"
    f.write_text("abc")
    load_tokens(str(f), 0, "uint16", "")
    assert list((tmp_path / "envcache").glob("tokens-*.bin"))


def test_bin_file_loads_and_checks_vocab(tmp_path):
    f = tmp_path / "toks.bin"
    np.array([1, 2, 3, 70000, 5], dtype=np.uint32).tofile(f)
    tf = load_tokens(str(f), 70001, "uint32", str(tmp_path))
    assert tf.vocab_size == 70001 and tf.tokens.tolist() == [1, 2, 3, 70000, 5]
    with pytest.raises(DataError) as err:
        load_tokens(str(f), 50000, "uint32", str(tmp_path))
    msg = str(err.value)
    assert str(f) in msg and "70000" in msg and "50000" in msg and "\n" not in msg


def test_bin_file_config_errors(tmp_path):
    f = tmp_path / "toks.bin"
    np.arange(5, dtype=np.uint16).tofile(f)
    with pytest.raises(ConfigError, match="data.vocab"):
        load_tokens(str(f), 0, "uint16", str(tmp_path))
    with pytest.raises(ConfigError, match="data.dtype"):
        load_tokens(str(f), 10, "int8", str(tmp_path))
    with pytest.raises(DataError, match="not a multiple of 4"):  # 10 bytes as uint32
        load_tokens(str(f), 10, "uint32", str(tmp_path))


@pytest.mark.parametrize("kind", ["missing", "empty_dir", "empty_file", "binary_only", "bin"])
def test_bad_paths_are_one_line_data_errors(tmp_path, kind):
    target = tmp_path / kind
    if kind == "empty_dir":
        target.mkdir()
    elif kind == "empty_file":
        target.write_bytes(b"")
    elif kind == "binary_only":
        target.mkdir()
        (target / "x.dat").write_bytes(b"\x00\x01\xff")
    elif kind == "bin":
        target = tmp_path / "missing.bin"
    with pytest.raises(DataError) as err:
        load_tokens(str(target), 256, "uint16", str(tmp_path / "cache"))
    assert str(target) in str(err.value) and "\n" not in str(err.value)


def test_stdlib_source_files():
    files = stdlib_source_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = [f.relative_to(root).as_posix() for f in files]
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in r or "dist-packages" in r for r in rels)
    assert rels == sorted(rels)


def test_stdlib_default_corpus(tmp_path):
    # The one full build (~31 MB of source, a few seconds); then a cheap cached reload.
    tf = load_tokens("", 0, "uint16", str(tmp_path))
    assert tf.vocab_size == 256 and len(tf) > 1_000_000 and "stdlib" in tf.source
    assert int(tf.tokens[:1000].max()) < 256
    assert len(load_tokens("", 0, "uint16", str(tmp_path))) == len(tf)


# --- sampler ---------------------------------------------------------------------------


def _stream(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.uint32)  # token value == position: windows are readable


def test_sampler_windows_and_targets():
    s = GlobalBatchSampler(num_tokens=101, seq_len=10, global_batch=4, seed=0)
    assert s.num_windows == 10
    ((x, y),) = s.microbatches(_stream(101), step=0, dp_rank=0, dp_size=1, micro_batch=4)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 10)
    starts = s.global_windows(0) * 10
    assert torch.equal(x[:, 0], torch.from_numpy(starts)) and torch.equal(y, x + 1)


def test_sampler_layout_invariance():
    tokens = _stream(64 * 8 + 1)
    s = GlobalBatchSampler(len(tokens), seq_len=8, global_batch=8, seed=3)
    for step in range(3):
        whole = torch.from_numpy(tokens[s.global_windows(step)[:, None] * 8 + np.arange(8)])
        for dp in (1, 2, 4):
            for mb in (1, 2):
                parts = [x for r in range(dp) for x, _ in s.microbatches(tokens, step, r, dp, mb)]
                assert all(p.shape == (mb, 8) for p in parts)
                assert torch.equal(torch.cat(parts).to(whole.dtype), whole), (step, dp, mb)


def test_sampler_resume_matches_straight_run():
    tokens = _stream(500)
    a = GlobalBatchSampler(len(tokens), 7, 6, seed=11)
    straight = [a.microbatches(tokens, k, 1, 2, 3) for k in range(12)]
    b = GlobalBatchSampler(**a.state_dict())  # a fresh process resuming at step 7
    for k in range(7, 12):
        for (x0, y0), (x1, y1) in zip(straight[k], b.microbatches(tokens, k, 1, 2, 3)):
            assert torch.equal(x0, x1) and torch.equal(y0, y1)
    b.check_state(a.state_dict())
    with pytest.raises(DataError, match="seed=11"):
        GlobalBatchSampler(len(tokens), 7, 6, seed=12).check_state(a.state_dict())


def test_sampler_epochs_cover_every_window_once():
    s = GlobalBatchSampler(num_tokens=10 * 4 + 1, seq_len=4, global_batch=4, seed=5)
    n = s.num_windows  # 10: batches of 4 straddle epoch boundaries
    order = np.concatenate([s.global_windows(k) for k in range(10)])  # 4 epochs
    for e in range(4):
        assert sorted(order[e * n : (e + 1) * n]) == list(range(n))
    assert not np.array_equal(order[:n], order[n : 2 * n])  # each epoch reshuffled
    fresh = GlobalBatchSampler(**s.state_dict())
    assert np.array_equal(
        np.concatenate([fresh.global_windows(k) for k in (9, 3, 6)]),
        np.concatenate([order[36:40], order[12:16], order[24:28]]),
    )


def test_sampler_errors():
    with pytest.raises(DataError, match="needs at least 81"):
        GlobalBatchSampler(num_tokens=50, seq_len=10, global_batch=8, seed=0)
    s = GlobalBatchSampler(num_tokens=1000, seq_len=10, global_batch=8, seed=0)
    with pytest.raises(ConfigError, match="train.global_batch"):
        s.microbatches(_stream(1000), 0, 0, 3, 1)
    with pytest.raises(ConfigError, match="train.micro_batch"):
        s.microbatches(_stream(1000), 0, 0, 2, 3)


# --- prefetcher ------------------------------------------------------------------------


def test_prefetcher_in_order_and_done():
    with Prefetcher(lambda k: k * k, 3, 8, depth=2) as pf:
        assert [pf.get(k)[0] for k in range(3, 8)] == [9, 16, 25, 36, 49]
        with pytest.raises(RuntimeError, match="past the end"):
            pf.get(8)
    pf = Prefetcher(lambda k: k, 0, 5)
    with pytest.raises(RuntimeError, match="expected 0"):
        pf.get(1)
    pf.close()


def test_prefetcher_reports_wait_for_slow_producer():
    def slow(k):
        time.sleep(0.05)
        return k

    with Prefetcher(slow, 0, 3, depth=2) as pf:
        item, wait = pf.get(0)
        assert item == 0 and wait >= 0.03
    item, wait = Prefetcher(slow, 0, 3, depth=0).get(0)  # inline: all produce time is wait
    assert item == 0 and wait >= 0.03


def test_prefetcher_hides_producer_time():
    with Prefetcher(lambda k: time.sleep(0.02) or k, 0, 4, depth=2) as pf:
        time.sleep(0.3)  # "compute" while the queue fills
        assert pf.get(0)[1] < 0.01 and pf.get(1)[1] < 0.01


def test_prefetcher_reraises_producer_error():
    def boom(k):
        if k == 2:
            raise DataError("corpus vanished")
        return k

    for depth in (0, 2):
        pf = Prefetcher(boom, 0, 5, depth=depth)
        assert pf.get(0)[0] == 0 and pf.get(1)[0] == 1
        with pytest.raises(DataError, match="corpus vanished"):
            pf.get(2)
        pf.close()


def test_prefetcher_close_is_prompt():
    before = threading.active_count()
    pf = Prefetcher(lambda k: time.sleep(0.01) or k, 0, 10_000, depth=2)
    pf.get(0)
    time.sleep(0.05)  # producer now blocked on a full queue
    t0 = time.perf_counter()
    pf.close()
    assert time.perf_counter() - t0 < 0.5
    assert threading.active_count() == before


def test_concurrent_cache_builds_agree(tmp_path):
    # Ranks of one job start together and may all find the cache missing.
    data = tmp_path / "corpus"
    data.mkdir()
    expected = b"\0".join(_write_docs(data))
    results = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                bytes(load_tokens(str(data), 0, "uint16", str(tmp_path / "c")).tokens.astype(np.uint8))
            )
        )
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [expected] * 4
    assert len(list((tmp_path / "c").iterdir())) == 2  # one .bin + one .json, no temp files


def test_unwritable_cache_is_data_error(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("abc")
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    with pytest.raises(DataError, match="cannot write the token cache"):
        load_tokens(str(f), 0, "uint16", str(blocker / "cache"))
