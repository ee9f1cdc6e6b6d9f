"""`threefold data prepare`: JSONL / Parquet / text / datasets inputs, parallel shards, exact
document boundaries, bad-record accounting, resume without redoing finished shards."""

from __future__ import annotations

import json

import numpy as np
import pytest

import threefold.data.prepare as prep
from threefold.cli import main
from threefold.data.indexed import read_indexed
from threefold.errors import DataError

pytest.importorskip("tokenizers")


def _texts(n, seed=0):
    rng = np.random.default_rng(seed)
    words = ["def", "return", "self", "x", "ünï", "café", "0", "+", "class", "\n", "    "]
    return [" ".join(rng.choice(words, rng.integers(1, 30))) for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    prep.train_bpe(iter(_texts(300)), 300).save(str(path))
    return str(path)


def _encode(tokenizer, texts):
    from threefold.data.tokenizer import FileTokenizer

    tok = FileTokenizer(tokenizer)
    return [tok.encode(t) + [tok.separator] for t in texts]


def _docs(out):
    ds = read_indexed(out / "tokens")
    return [ds.document(k).tolist() for k in range(ds.num_documents)]


def _jsonl(path, texts):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t, "id": 1}) + "\n")


def test_jsonl_in_two_workers_keeps_every_document_in_order(tmp_path, tokenizer):
    texts = _texts(400, 1)
    (tmp_path / "in").mkdir()
    _jsonl(tmp_path / "in" / "a.jsonl", texts[:250])
    _jsonl(tmp_path / "in" / "b.jsonl", texts[250:])
    # Tiny shards: byte ranges cut lines in the middle, each line must land in exactly one shard.
    meta = prep.prepare(
        str(tmp_path / "in"), str(tmp_path / "out"), tokenizer=tokenizer, workers=2, shard_mb=0.002, log=print
    )
    assert _docs(tmp_path / "out") == _encode(tokenizer, texts)
    assert meta["documents"] == 400 and meta["bad"] == {} and meta["dtype"] == "uint16"
    assert not list((tmp_path / "out").glob(".prepare-*"))  # work directory removed once merged


def test_parquet_text_and_datasets_inputs(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = _texts(60, 2)
    pq.write_table(pa.table({"body": texts[:40] + [None]}), tmp_path / "a.parquet", row_group_size=7)
    prep.prepare(str(tmp_path / "a.parquet"), str(tmp_path / "pq"), tokenizer=tokenizer, json_key="body", log=print)
    assert _docs(tmp_path / "pq") == _encode(tokenizer, texts[:40])
    assert json.loads((tmp_path / "pq" / "tokens.json").read_text())["bad"] == {"key": 1}
    with pytest.raises(DataError, match="no column 'text'"):
        prep.prepare(str(tmp_path / "a.parquet"), str(tmp_path / "x"), tokenizer=tokenizer, log=print)

    (tmp_path / "txt").mkdir()
    for i, t in enumerate(texts[:5]):
        (tmp_path / "txt" / f"f{i}.txt").write_text(t)
    prep.prepare(str(tmp_path / "txt"), str(tmp_path / "tx"), tokenizer=tokenizer, log=print)
    assert _docs(tmp_path / "tx") == _encode(tokenizer, texts[:5])

    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "hf"))
    prep.prepare(str(tmp_path / "hf"), str(tmp_path / "hfo"), tokenizer=tokenizer, log=print)
    assert _docs(tmp_path / "hfo") == _encode(tokenizer, texts)


def _bad_corpus(path):
    good = _texts(20, 3)
    with open(path, "wb") as f:
        for i, t in enumerate(good):
            f.write((json.dumps({"text": t}) + "\n").encode())
            if i % 5 == 0:
                f.write(b"{not json\n")
            if i % 7 == 0:
                f.write(b'{"other": "x"}\n')
        f.write(b'{"text": "caf\xe9"}\n')  # latin-1, not UTF-8
        f.write(b'{"text": "\\ud800 lone surrogate"}\n')
        f.write(b'{"text": 5}\n')
    return good


def test_bad_records_counted_per_class(tmp_path, tokenizer, capsys):
    good = _bad_corpus(tmp_path / "bad.jsonl")
    args = ["data", "prepare", "--data.path", str(tmp_path / "bad.jsonl"), "--tokenizer", tokenizer]
    assert main([*args, "--out", str(tmp_path / "o1"), "--max-bad", "3"]) == 2
    err = capsys.readouterr().err.splitlines()
    lines = [e for e in err if "skipped" in e]
    first_key = len(_line(good[0])) + len(b"{not json" + b"\n")
    assert lines == [
        f"prepare: skipped 4 records: invalid JSON line (first at {tmp_path / 'bad.jsonl'} byte {len(_line(good[0]))})",
        f"prepare: skipped 3 records: missing key / null value (first at {tmp_path / 'bad.jsonl'} byte {first_key})",
        lines[2],
        lines[3],
    ]
    assert lines[2].startswith("prepare: skipped 1 records: value is not a string (first at ")
    assert lines[3].startswith("prepare: skipped 2 records: not valid UTF-8 (first at ")
    assert err[-1].startswith("threefold: error: 10 bad records exceed --max-bad 3; no dataset written")
    out = tmp_path / "o1"
    assert not (out / "tokens.json").exists() and not (out / "tokens.bin").exists()
    # Raising the limit reuses the finished shard and writes the dataset without the bad records.
    assert main([*args, "--out", str(out), "--max-bad", "10"]) == 0
    assert _docs(out) == _encode(tokenizer, good)
    assert json.loads((out / "tokens.json").read_text())["bad"] == {"json": 4, "key": 3, "type": 1, "utf8": 2}


def _line(text):
    return (json.dumps({"text": text}) + "\n").encode()


def test_interrupted_run_resumes_without_redoing_finished_shards(tmp_path, tokenizer, monkeypatch):
    texts = _texts(200, 4)
    _jsonl(tmp_path / "c.jsonl", texts)
    kw = dict(tokenizer=tokenizer, shard_mb=0.001, log=print)
    real, calls = prep.tokenize_shard, []

    def crash_after_three(job):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(job[0])
        return real(job)

    monkeypatch.setattr(prep, "tokenize_shard", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(str(tmp_path / "c.jsonl"), str(tmp_path / "out"), **kw)
    assert not (tmp_path / "out" / "tokens.json").exists()
    (work,) = (tmp_path / "out").glob(".prepare-*")
    assert len(list(work.glob("*.done"))) == 3 and not list(work.glob(".*tmp"))

    redone = []
    monkeypatch.setattr(prep, "tokenize_shard", lambda job: redone.append(job[0]) or real(job))
    meta = prep.prepare(str(tmp_path / "c.jsonl"), str(tmp_path / "out"), **kw)
    assert sorted(set(redone) & set(calls)) == [] and len(redone) + 3 == len(set(redone) | set(calls))
    assert _docs(tmp_path / "out") == _encode(tokenizer, texts) and meta["documents"] == 200
    redone.clear()  # a finished dataset is recognised, not rebuilt
    assert prep.prepare(str(tmp_path / "c.jsonl"), str(tmp_path / "out"), **kw)["key"] == meta["key"]
    assert redone == []
