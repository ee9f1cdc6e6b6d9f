"""Corpus inputs for `threefold data prepare`: find the files, cut them into shards, stream records.

A shard is a unit of work a worker process tokenizes on its own: a byte range of a JSONL file
(it owns the lines that start inside the range), a run of Parquet row groups, a row range of a
`datasets.save_to_disk` directory, or a group of whole text files (one document each). Shards
are planned from file sizes alone, so the same inputs give the same plan and an interrupted run
can skip the shards it finished. Records are streamed: no reader holds more than one batch.

A record is either the document's text or a `Bad` naming its problem class; bad records are
counted, never tokenized.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from threefold.errors import DataError, UserError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
FORMATS = ("auto", "jsonl", "parquet", "text", "hf")
BAD_CLASSES = {
    "json": "invalid JSON line",
    "key": "missing key / null value",
    "type": "value is not a string",
    "utf8": "not valid UTF-8",
}
_ROWS_PER_HF_SHARD = 100_000
_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Bad:
    """A record that cannot be a document: its class (a key of BAD_CLASSES) and where it is."""

    kind: str
    where: str


@dataclass(frozen=True)
class Shard:
    """One unit of work: `kind` (jsonl, parquet, hf, text), its files and its range in them."""

    kind: str
    files: tuple[str, ...]
    start: int = 0  # byte offset (jsonl), first row group (parquet) or row (hf)
    end: int = 0  # exclusive
    size: int = 0  # bytes, for progress

    def to_dict(self) -> dict:
        return {"kind": self.kind, "files": list(self.files), "start": self.start, "end": self.end, "size": self.size}


def detect_format(root: Path, fmt: str) -> str:
    if fmt not in FORMATS:
        raise DataError(f"--format {fmt!r} is unknown (valid: {', '.join(FORMATS)})")
    if fmt != "auto":
        return fmt
    if root.is_dir() and (root / "state.json").is_file() and (root / "dataset_info.json").is_file():
        return "hf"
    files = [root] if root.is_file() else [f for f in root.rglob("*") if f.is_file()]
    names = [f.name for f in files if not f.name.startswith(".")]
    if any(n.endswith(PARQUET_SUFFIXES) for n in names):
        return "parquet"
    if any(n.endswith(JSONL_SUFFIXES) for n in names):
        return "jsonl"
    return "text"


def plan_shards(root: Path, fmt: str, key: str, shard_bytes: int) -> list[Shard]:
    """The shards of the corpus at `root` in a fixed order; a missing key or column in Parquet
    and Hugging Face inputs (whole-file problems, not per-record ones) is a DataError here."""
    from threefold.data.corpus import _text_files

    if not root.exists():
        raise DataError(f"{root}: no such file or directory (--data.path must be JSONL, Parquet, text or a dataset)")
    if fmt == "hf":
        return _hf_shards(root, key)
    suffixes = {"jsonl": JSONL_SUFFIXES, "parquet": PARQUET_SUFFIXES}.get(fmt)
    files = [f for _, f in _text_files(root)]
    if suffixes:
        files = [f for f in files if f.name.endswith(suffixes)]
    if not files:
        raise DataError(f"{root}: no non-empty {fmt} files")
    if fmt == "jsonl":
        out = []
        for f in files:
            size = f.stat().st_size
            for a in range(0, size, shard_bytes):
                out.append(Shard("jsonl", (str(f),), a, min(size, a + shard_bytes), min(size, a + shard_bytes) - a))
        return out
    if fmt == "parquet":
        return [s for f in files for s in _parquet_shards(f, key, shard_bytes)]
    return text_shards(files, shard_bytes)


def text_shards(files: list[Path], shard_bytes: int) -> list[Shard]:
    """Whole text files (one document each), grouped in order into shards of about shard_bytes."""
    out, group, size = [], [], 0
    for f in files:
        group.append(str(f))
        size += f.stat().st_size
        if size >= shard_bytes:
            out.append(Shard("text", tuple(group), size=size))
            group, size = [], 0
    if group:
        out.append(Shard("text", tuple(group), size=size))
    return out


def _pyarrow(what: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{what} needs pyarrow: `pip install pyarrow` (or the [data] extra)") from None
    return pq


def _parquet_shards(f: Path, key: str, shard_bytes: int) -> list[Shard]:
    pq = _pyarrow(f"Parquet input {f}")
    try:
        meta = pq.ParquetFile(f).metadata
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError with its own message
        raise DataError(f"{f}: not a readable Parquet file ({str(err).splitlines()[0]})") from None
    names = meta.schema.names
    if key not in names:
        raise DataError(f"{f}: no column {key!r} (--json-key names the text column; columns: {', '.join(names)})")
    out, first, size = [], 0, 0
    for g in range(meta.num_row_groups):
        size += meta.row_group(g).total_byte_size
        if size >= shard_bytes or g == meta.num_row_groups - 1:
            out.append(Shard("parquet", (str(f),), first, g + 1, size))
            first, size = g + 1, 0
    return out


def _open_hf(path: str, key: str):
    try:
        import datasets
    except ImportError:
        raise UserError(f"{path} is a Hugging Face dataset directory: `pip install datasets` to read it") from None
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        raise DataError(f"{path}: a DatasetDict; point --data.path at one split ({', '.join(ds)})")
    if key not in ds.column_names:
        raise DataError(f"{path}: no column {key!r} (--json-key names the text column: {', '.join(ds.column_names)})")
    return ds


def _hf_shards(root: Path, key: str) -> list[Shard]:
    ds = _open_hf(str(root), key)
    n = len(ds)
    per_row = max(1, sum(f.stat().st_size for f in root.glob("*.arrow")) // max(1, n))
    step = _ROWS_PER_HF_SHARD
    return [Shard("hf", (str(root),), a, min(n, a + step), (min(n, a + step) - a) * per_row) for a in range(0, n, step)]


def records(shard: Shard, key: str) -> Iterator[str | Bad]:
    """The shard's documents, in order, as text or Bad."""
    if shard.kind == "jsonl":
        yield from _jsonl_records(shard, key)
    elif shard.kind == "parquet":
        pq = _pyarrow("Parquet input")
        pf = pq.ParquetFile(shard.files[0])
        groups = list(range(shard.start, shard.end))
        row = 0
        for batch in pf.iter_batches(batch_size=_BATCH_ROWS, row_groups=groups, columns=[key]):
            for value in batch.column(0).to_pylist():
                yield _value(value, f"{shard.files[0]} row group {shard.start}+ row {row}")
                row += 1
    elif shard.kind == "hf":
        ds = _open_hf(shard.files[0], key).with_format("arrow")
        for a in range(shard.start, shard.end, _BATCH_ROWS):
            values = ds[a : min(shard.end, a + _BATCH_ROWS)][key].to_pylist()
            for i, value in enumerate(values):
                yield _value(value, f"{shard.files[0]} row {a + i}")
    else:
        for name in shard.files:
            data = Path(name).read_bytes()
            try:
                yield data.decode("utf-8")
            except UnicodeDecodeError:
                yield Bad("utf8", name)


def _value(value, where: str) -> str | Bad:
    if value is None:
        return Bad("key", where)
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return Bad("utf8", where)
    return value if isinstance(value, str) else Bad("type", where)


def _jsonl_records(shard: Shard, key: str) -> Iterator[str | Bad]:
    name = shard.files[0]
    with open(name, "rb") as fh:
        pos = shard.start
        if pos > 0:
            # The line that straddles `start` belongs to the previous shard: step past its end
            # (reading from start-1 keeps a line that begins exactly at start).
            fh.seek(pos - 1)
            pos += len(fh.readline()) - 1
        while pos < shard.end:
            line = fh.readline()
            if not line:
                break
            where = f"{name} byte {pos}"
            pos += len(line)
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                yield Bad("utf8", where)
                continue
            try:
                obj = json.loads(text)
            except ValueError:
                yield Bad("json", where)
                continue
            if not isinstance(obj, dict):
                yield Bad("json", where)
            elif obj.get(key) is None:
                yield Bad("key", where)
            else:
                yield _value(obj[key], where)
