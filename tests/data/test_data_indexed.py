"""Megatron indexed datasets: a minimal writer and reader written here from the published format
(not threefold's code) agree with threefold's reader and writer, byte for byte."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from threefold.data import GlobalBatchSampler, load_tokens
from threefold.data.indexed import IndexedWriter, read_indexed
from threefold.errors import DataError

CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}


def write_megatron(prefix, documents: list[list[list[int]]], dtype) -> None:
    """The format description, independently: .bin = sequences back to back; .idx = magic,
    <Q version 1, <B dtype code, <Q sequences, <Q documents + 1, int32 lengths, int64 byte
    pointers, int64 document indices starting at 0. A document may hold several sequences."""
    dtype = np.dtype(dtype)
    seqs = [s for doc in documents for s in doc]
    with open(f"{prefix}.bin", "wb") as fh:
        for s in seqs:
            fh.write(np.array(s, dtype=dtype).tobytes())
    lengths = [len(s) for s in seqs]
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * dtype.itemsize
    doc_idx = [0]
    for doc in documents:
        doc_idx.append(doc_idx[-1] + len(doc))
    with open(f"{prefix}.idx", "wb") as fh:
        fh.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", CODES[dtype]))
        fh.write(struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(doc_idx)))
        fh.write(struct.pack(f"<{len(lengths)}i", *lengths))
        fh.write(struct.pack(f"<{len(pointers)}q", *pointers))
        fh.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def read_megatron(prefix):
    """(dtype code, lengths, pointers, document indices, tokens) parsed with struct alone."""
    raw = open(f"{prefix}.idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00" and struct.unpack("<Q", raw[9:17])[0] == 1
    code = raw[17]
    nseq, ndoc = struct.unpack("<QQ", raw[18:34])
    off = 34
    lengths = struct.unpack(f"<{nseq}i", raw[off : off + 4 * nseq])
    pointers = struct.unpack(f"<{nseq}q", raw[off + 4 * nseq : off + 12 * nseq])
    docs = struct.unpack(f"<{ndoc}q", raw[off + 12 * nseq : off + 12 * nseq + 8 * ndoc])
    assert len(raw) == off + 12 * nseq + 8 * ndoc
    dtype = {8: np.uint16, 4: np.int32}[code]
    tokens = np.fromfile(f"{prefix}.bin", dtype=dtype)
    return code, lengths, pointers, docs, tokens


def _documents(rng, count, vocab):
    # Some documents split into two sequences, as preprocess_data.py does with --split-sentences.
    return [
        [rng.integers(1, vocab, rng.integers(1, 40)).tolist() for _ in range(1 + (k % 3 == 0))] for k in range(count)
    ]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_reads_an_independently_written_dataset(tmp_path, dtype):
    rng = np.random.default_rng(0)
    vocab = 300 if dtype == np.uint16 else 70_000
    docs = _documents(rng, 50, vocab)
    write_megatron(tmp_path / "ds", docs, dtype)
    ds = read_indexed(tmp_path / "ds")
    assert ds.tokens.dtype == np.dtype(dtype) and ds.num_documents == 50
    for k, doc in enumerate(docs):
        assert ds.document(k).tolist() == [t for s in doc for t in s]
    starts = np.cumsum([0] + [sum(map(len, d)) for d in docs])
    assert ds.document_offsets().tolist() == starts.tolist()
    flat = [t for d in docs for s in d for t in s]
    for path in (tmp_path / "ds", f"{tmp_path / 'ds'}.bin", f"{tmp_path / 'ds'}.idx"):
        stream = load_tokens(str(path), vocab)
        assert stream.tokens.tolist() == flat and isinstance(stream.tokens, np.memmap)
    (tmp_path / "other").mkdir()
    write_megatron(tmp_path / "other" / "only", docs, dtype)
    assert load_tokens(str(tmp_path / "other"), vocab).tokens.tolist() == flat


def test_threefold_writer_matches_the_format(tmp_path):
    docs = [[1, 2, 3, 0], [7, 0], [5, 5, 5, 5, 5, 0]]
    w = IndexedWriter(tmp_path / "t", np.uint16)
    for d in docs:
        w.add(np.array(d))
    w.close()
    code, lengths, pointers, doc_idx, tokens = read_megatron(tmp_path / "t")
    assert code == 8 and lengths == (4, 2, 6) and pointers == (0, 8, 12) and doc_idx == (0, 1, 2, 3)
    assert tokens.tolist() == [t for d in docs for t in d]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin", "t.idx"]  # no temp files left


def test_sampler_reads_indexed_windows(tmp_path):
    docs = [[list(range(1, 200))], [list(range(200, 290))]]
    write_megatron(tmp_path / "ds", docs, np.uint16)
    stream = load_tokens(str(tmp_path / "ds"), 300)
    flat = np.arange(1, 290)
    s = GlobalBatchSampler(len(stream.tokens), 16, 4, seed=3)
    (x, y), *_ = s.microbatches(stream.tokens, 0, 0, 1, 4)
    for row, w in zip(x.tolist(), s.global_windows(0)):
        assert row == flat[w * 16 : w * 16 + 16].tolist()
    assert (y[:, :-1] == x[:, 1:]).all()


def test_vocab_from_prepare_sidecar_and_errors(tmp_path):
    write_megatron(tmp_path / "ds", [[[1, 2, 3]], [[4, 299]]], np.uint16)
    with pytest.raises(Exception, match="data.vocab: must be set for the indexed dataset"):
        load_tokens(str(tmp_path / "ds"))
    with pytest.raises(DataError, match="token id 299 found but data.vocab is 100"):
        load_tokens(str(tmp_path / "ds"), 100)
    (tmp_path / "ds.json").write_text('{"num_tokens": 5, "dtype": "uint16", "vocab": 300, "max_id": 299}')
    assert load_tokens(str(tmp_path / "ds")).vocab_size == 300


@pytest.mark.parametrize("damage", ["magic", "truncate", "bin"])
def test_broken_files_are_one_line_data_errors(tmp_path, damage):
    write_megatron(tmp_path / "ds", [[[1, 2, 3]], [[4, 5]]], np.uint16)
    idx = tmp_path / "ds.idx"
    if damage == "magic":
        idx.write_bytes(b"XXIDIDX\x00\x00" + idx.read_bytes()[9:])
    elif damage == "truncate":
        idx.write_bytes(idx.read_bytes()[:-8])
    else:
        (tmp_path / "ds.bin").write_bytes(b"\x01\x00" * 7)
    with pytest.raises(DataError) as err:
        read_indexed(tmp_path / "ds")
    assert "\n" not in str(err.value) and "ds." in str(err.value)
