"""The worker side of `threefold data prepare`: tokenize one shard into its own indexed dataset,
and merge the finished shards into the final one.

A shard's output is committed in three renames: its .bin, its .idx, then its .done marker (a JSON
of its counts). Only a shard with a marker counts as finished, so a run killed at any moment
leaves either a finished shard or nothing that a resumed run would trust.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from threefold.atomic import atomic_open, atomic_write
from threefold.data.indexed import IndexedWriter, idx_bin, read_indexed, write_index
from threefold.data.sources import Bad, Shard, records

_DOCS_PER_BATCH = 512
_TOKENIZER = None  # one per worker process, loaded once by init_worker


def init_worker(tokenizer_path: str) -> None:
    """Pool initializer: each worker tokenizes on one thread, so --workers N uses N cores."""
    global _TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _TOKENIZER = Tokenizer.from_file(tokenizer_path)


def shard_paths(work: Path, index: int) -> tuple[Path, Path]:
    """(dataset prefix, done marker) of shard `index` in the work directory."""
    return work / f"shard-{index:06d}", work / f"shard-{index:06d}.done"


def is_done(work: Path, index: int) -> dict | None:
    """The counts a finished shard recorded, or None when it has to be (re)done."""
    prefix, marker = shard_paths(work, index)
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return meta if all(f.is_file() for f in idx_bin(prefix)) else None


def tokenize_shard(job: tuple[int, dict, str, str, int, str]) -> dict:
    """Tokenize shard `index` into work/shard-index.{bin,idx}; each document ends with `eod`.
    Returns (and records in the .done marker) documents, tokens, max id and bad counts."""
    index, shard_dict, key, work, eod, dtype = job
    shard = Shard(shard_dict["kind"], tuple(shard_dict["files"]), shard_dict["start"], shard_dict["end"])
    prefix, marker = shard_paths(Path(work), index)
    t0 = time.perf_counter()
    writer = IndexedWriter(prefix, np.dtype(dtype))
    bad: dict[str, int] = {}
    first_bad: dict[str, str] = {}
    stats = {"documents": 0, "tokens": 0, "max_id": int(eod)}

    def write(encoded) -> None:
        docs, unreadable = encoded.result()
        for where in unreadable:
            bad["utf8"] = bad.get("utf8", 0) + 1
            first_bad.setdefault("utf8", f"record {where} of the shard")
        for ids in docs:
            ids.append(eod)
        # One array per batch, not per document: the per-document numpy overhead would cost
        # more than the tokenizer on short records.
        lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
        flat = np.fromiter(itertools.chain.from_iterable(docs), dtype=dtype, count=int(lengths.sum()))
        if len(docs):
            writer.add_lengths(flat.tobytes(), lengths)
            stats["documents"] += len(docs)
            stats["tokens"] += len(flat)
            stats["max_id"] = max(stats["max_id"], int(flat.max()))

    # Two stages: one thread encodes batch k+1 (the tokenizer releases the GIL) while this one
    # parses the JSON of the batch after it and writes batch k, so reading and writing cost no
    # time beside the tokenizer's. The batches are written in order.
    try:
        with cf.ThreadPoolExecutor(1, thread_name_prefix="threefold-encode") as encoder:
            pending = None
            for texts, wheres in _batches(records(shard, key), bad, first_bad):
                encoded = encoder.submit(_encode, texts, wheres)
                if pending is not None:
                    write(pending)
                pending = encoded
            if pending is not None:
                write(pending)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    meta = {**stats, "bad": bad, "first_bad": first_bad, "bytes": shard_dict["size"], "seconds": 0.0}
    meta["seconds"] = time.perf_counter() - t0
    atomic_write(marker, json.dumps(meta).encode())
    return meta


def _batches(recs, bad: dict, first_bad: dict):
    """(texts, record numbers) of _DOCS_PER_BATCH good records at a time; bad ones counted."""
    texts: list[str] = []
    wheres: list[str] = []
    for n, rec in enumerate(recs):
        if isinstance(rec, Bad):
            bad[rec.kind] = bad.get(rec.kind, 0) + 1
            first_bad.setdefault(rec.kind, rec.where)
            continue
        texts.append(rec)
        wheres.append(str(n))
        if len(texts) >= _DOCS_PER_BATCH:
            yield texts, wheres
            texts, wheres = [], []
    if texts:
        yield texts, wheres


def _encode(texts: list[str], wheres: list[str]) -> tuple[list[list[int]], list[str]]:
    """(ids of every readable document, record numbers of the unreadable ones)."""
    try:
        return [e.ids for e in _TOKENIZER.encode_batch(texts, add_special_tokens=False)], []
    except Exception:
        # A str that is not valid Unicode (a lone surrogate from a JSON "\ud800" escape) fails
        # the whole batch; find it document by document and count it as non-UTF-8.
        out, unreadable = [], []
        for text, where in zip(texts, wheres):
            try:
                out.append(_TOKENIZER.encode(text, add_special_tokens=False).ids)
            except Exception:
                unreadable.append(where)
        return out, unreadable


def merge_shards(work: Path, count: int, prefix: Path) -> tuple[int, int]:
    """Concatenate shards 0..count-1 into prefix.bin/.idx (streamed; the index is rebuilt from
    the shards' lengths). Returns (documents, tokens)."""
    lengths = []
    dtype = None

    def write(fh):
        nonlocal dtype
        for i in range(count):
            shard = read_indexed(shard_paths(work, i)[0]) if _nonempty(work, i) else None
            if shard is None:
                continue
            dtype = shard.tokens.dtype
            lengths.append(np.array(shard.sequence_lengths))
            with open(idx_bin(shard.prefix)[1], "rb") as src:
                shutil.copyfileobj(src, fh, 1 << 24)

    _, bin_path = idx_bin(prefix)
    with atomic_open(bin_path) as fh:
        write(fh)
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)
    write_index(idx_bin(prefix)[0], dtype if dtype is not None else np.dtype(np.uint16), all_lengths)
    return len(all_lengths), int(all_lengths.sum(dtype=np.int64))


def _nonempty(work: Path, i: int) -> bool:
    return idx_bin(shard_paths(work, i)[0])[1].stat().st_size > 0
