"""Megatron-LM's indexed dataset: a `.bin` of token ids and a `.idx` that says where each
sequence and document lies in it. Byte-compatible with megatron/core/datasets/indexed_dataset.py,
so files made by its `preprocess_data.py` train here and files made here train there.

The `.idx` layout (all little-endian):

    b"MMIDIDX\\x00\\x00"            9-byte magic
    <Q version = 1
    <B dtype code                   1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
                                    7 float32, 8 uint16 (the element type of the .bin)
    <Q sequence count S
    <Q document count D             D = documents + 1: document_indices starts with 0
    int32[S]  sequence lengths      in elements
    int64[S]  sequence pointers     byte offset of each sequence in the .bin
    int64[D]  document indices      document k spans sequences [doc[k], doc[k+1])

The `.bin` is the sequences back to back, so it is also one flat token stream: training maps it
as such and the sampler cuts windows across documents, exactly as for a raw `.bin`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from threefold.atomic import PendingFile, atomic_open
from threefold.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count


def megatron_dtype(vocab_size: int) -> np.dtype:
    """The element type Megatron's preprocess_data.py picks for a vocabulary (uint16 below
    65500 ids, else int32: the format has no uint32 code)."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def idx_bin(prefix: str | Path) -> tuple[Path, Path]:
    p = str(prefix)
    return Path(p + ".idx"), Path(p + ".bin")


def indexed_prefix(path: str) -> Path | None:
    """The dataset prefix `path` names, or None when it is not an indexed dataset: a prefix
    with prefix.idx and prefix.bin, prefix.bin or prefix.idx with the other beside it, or a
    directory holding exactly one such pair."""
    p = Path(path)
    if p.suffix in (".bin", ".idx"):
        p = p.with_suffix("")
        return p if all(f.is_file() for f in idx_bin(p)) else None
    if all(f.is_file() for f in idx_bin(p)):
        return p
    if p.is_dir():
        pairs = sorted(f.with_suffix("") for f in p.glob("*.idx") if f.with_suffix(".bin").is_file())
        if len(pairs) > 1:
            names = ", ".join(f.name for f in pairs[:4])
            raise DataError(
                f"{p}: holds {len(pairs)} indexed datasets ({names}...); name one prefix, or blend them "
                '(data.path "0.5 dir/a 0.5 dir/b")'
            )
        return pairs[0] if pairs else None
    return None


@dataclass
class IndexedDataset:
    """A memory-mapped indexed dataset: `tokens` is the whole .bin as one stream."""

    prefix: Path
    tokens: np.memmap
    sequence_lengths: np.ndarray  # int32, memory-mapped from the .idx
    sequence_pointers: np.ndarray  # int64 byte offsets
    document_indices: np.ndarray  # int64, starts with 0

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def document_offsets(self) -> np.ndarray:
        """Token offset where each document starts, plus the end (length documents + 1)."""
        item = self.tokens.dtype.itemsize
        first = self.sequence_pointers[self.document_indices[:-1]] // item if len(self.sequence_pointers) else []
        return np.append(np.asarray(first, dtype=np.int64), len(self.tokens))

    def document(self, k: int) -> np.ndarray:
        lo, hi = self.document_indices[k], self.document_indices[k + 1]
        if lo == hi:
            return self.tokens[:0]
        start = int(self.sequence_pointers[lo]) // self.tokens.dtype.itemsize
        return self.tokens[start : start + int(self.sequence_lengths[lo:hi].sum())]


def read_indexed(prefix: str | Path) -> IndexedDataset:
    """Open prefix.idx / prefix.bin, checking the header and that the index covers the .bin."""
    idx, binf = idx_bin(prefix)
    try:
        with open(idx, "rb") as fh:
            head = fh.read(_HEADER.size)
        idx_size, bin_size = idx.stat().st_size, binf.stat().st_size
    except OSError as e:
        raise DataError(f"{e.filename}: cannot read indexed dataset ({e.strerror})") from None
    if len(head) < _HEADER.size or head[:9] != MAGIC:
        raise DataError(f"{idx}: not a Megatron index (expected the header {MAGIC!r})")
    _, version, code, nseq, ndoc = _HEADER.unpack(head)
    if version != VERSION:
        raise DataError(f"{idx}: index version {version}, only version {VERSION} is known")
    if code not in DTYPE_CODES or np.dtype(DTYPE_CODES[code]).kind not in "ui":
        raise DataError(f"{idx}: dtype code {code} is not an integer token type (valid: 1-5, 8)")
    dtype = np.dtype(DTYPE_CODES[code])
    need = _HEADER.size + nseq * 12 + ndoc * 8
    # A multimodal index adds one int8 mode per sequence; anything else is a broken file.
    if idx_size not in (need, need + nseq) or ndoc < 1:
        raise DataError(
            f"{idx}: {idx_size} bytes, but {nseq} sequences and {ndoc} document entries need {need} "
            "(truncated or not written by an indexed-dataset writer)"
        )
    raw = np.memmap(idx, dtype=np.uint8, mode="r")
    off = _HEADER.size
    lengths = raw[off : off + 4 * nseq].view(np.int32)
    pointers = raw[off + 4 * nseq : off + 12 * nseq].view(np.int64)
    docs = raw[off + 12 * nseq : need].view(np.int64)
    # O(1) checks: sequences are written back to back, so the last one ends at the file's end.
    end = int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize if nseq else 0
    if end != bin_size or docs[0] != 0 or docs[-1] != nseq:
        raise DataError(
            f"{binf}: {bin_size} bytes but its index describes {end} "
            f"(document indices {int(docs[0])}..{int(docs[-1])} of {nseq} sequences); "
            "the .bin and .idx do not belong together"
        )
    if bin_size == 0:
        raise DataError(f"{binf}: indexed dataset holds no tokens")
    tokens = np.memmap(binf, dtype=dtype, mode="r")
    return IndexedDataset(Path(str(prefix)), tokens, lengths, pointers, docs)


class IndexedWriter:
    """Streams documents into prefix.bin and writes prefix.idx on `close()`; one sequence per
    document, as preprocess_data.py writes without sentence splitting. Both files appear under
    their final names only when complete (written as temp files, then renamed: idx last)."""

    def __init__(self, prefix: str | Path, dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF:
            raise ValueError(f"no indexed-dataset code for {self.dtype}")
        self.idx, self.bin = idx_bin(prefix)
        self._pending_bin = PendingFile(self.bin)
        self.lengths: list[int] = []

    def add(self, ids: np.ndarray) -> None:
        self._pending_bin.file.write(np.asarray(ids, dtype=self.dtype).tobytes())
        self.lengths.append(len(ids))

    def add_lengths(self, data: bytes, lengths: np.ndarray) -> None:
        """Append pre-encoded documents: `data` holds them back to back, `lengths` each size."""
        self._pending_bin.file.write(data)
        self.lengths.extend(int(n) for n in lengths)

    def close(self) -> None:
        self._pending_bin.publish()
        write_index(self.idx, self.dtype, np.asarray(self.lengths, dtype=np.int32))

    def abort(self) -> None:
        self._pending_bin.discard()


def write_index(idx: Path, dtype: np.dtype, lengths: np.ndarray) -> None:
    """prefix.idx for one-sequence documents of `lengths` elements each, written atomically."""
    lengths = np.asarray(lengths, dtype=np.int32)
    n = len(lengths)
    pointers = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= np.dtype(dtype).itemsize
    docs = np.arange(n + 1, dtype=np.int64)

    with atomic_open(idx) as fh:
        fh.write(_HEADER.pack(MAGIC, VERSION, CODE_OF[np.dtype(dtype)], n, n + 1))
        fh.write(lengths.tobytes())
        fh.write(pointers.tobytes())
        fh.write(docs.tobytes())
