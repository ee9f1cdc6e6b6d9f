"""Find a corpus, turn it into one flat token stream on disk, and memory-map it.

Byte-level corpora (text files, or the Python stdlib by default) are tokenized once into a
uint16 cache file; later runs, and every rank of a multi-process run, just map that file.
Pre-tokenized `.bin` files are mapped directly and only checked against the vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from threefold.atomic import atomic_open, atomic_write
from threefold.data.blend import Blend, Part, parse_blend
from threefold.data.indexed import indexed_prefix, read_indexed
from threefold.data.tokenizer import ByteTokenizer, open_tokenizer
from threefold.errors import ConfigError, DataError

DTYPES = ("uint16", "uint32")
_CACHE_FORMAT = 1  # bump when the cache layout changes, so stale caches are rebuilt
_CHECK_CHUNK = 1 << 24  # tokens per chunk when scanning a .bin for its max id (64 MiB at u32)


@dataclass
class TokenFile:
    """A memory-mapped, 1-D token stream and the vocabulary it was made for."""

    tokens: np.memmap  # or a Blend of several streams (data.path "0.7 a/ 0.3 b/")
    vocab_size: int
    source: str  # one line for logs: where the tokens came from

    def __len__(self) -> int:
        return len(self.tokens)


def stdlib_source_files() -> list[Path]:
    """Every `*.py` of this Python's standard library, without installed packages.

    Sorted by relative path so that machines with the same Python build the same stream.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    # Prune installed packages while walking (torch alone is tens of thousands of entries);
    # like rglob, symlinked directories are not followed.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
        for name in filenames:
            f = Path(dirpath) / name
            if name.endswith(".py") and f.is_file():
                files.append((f.relative_to(root).as_posix(), f))
    return [f for _, f in sorted(files)]


def default_cache_dir() -> Path:
    return Path(os.environ.get("THREEFOLD_CACHE") or Path.home() / ".cache" / "threefold")


def load_tokens(
    path: str, vocab: int = 0, dtype: str = "uint16", cache_dir: str = "", tokenizer: str = ""
) -> TokenFile:
    """Map the corpus at `path` ("" = stdlib sources; a `.bin` file = pre-tokenized ids).

    `vocab` is the model's vocabulary: required for `.bin` (unless a `tokenizer` file gives it),
    optional for text corpora (0 means the tokenizer's size, 256 for bytes; a larger value is
    allowed, e.g. padded for tensor parallelism). Text is tokenized with `tokenizer` (a
    tokenizer.json) when given, else byte-level.
    """
    if dtype not in DTYPES:
        raise ConfigError("data.dtype", f"unknown token dtype {dtype!r}", "uint16 or uint32")
    if vocab < 0:
        raise ConfigError("data.vocab", f"must be >= 0, got {vocab}", "0 = tokenizer's own")
    tok = open_tokenizer(tokenizer)
    blend = parse_blend(path)
    if blend is not None:
        return _load_blend(blend, vocab, dtype, cache_dir, tokenizer)
    prefix = indexed_prefix(path) if path else None
    if prefix is not None:
        return _load_indexed(prefix, vocab or (tok.vocab_size if tokenizer else 0))
    if path and path.endswith(".bin"):
        return _load_bin(Path(path), vocab or (tok.vocab_size if tokenizer else 0), dtype)

    if vocab and vocab < tok.vocab_size:
        raise ConfigError(
            "data.vocab",
            f"{vocab} is smaller than the tokenizer's {tok.vocab_size} ids",
            f"0 or >= {tok.vocab_size} for a text corpus",
        )
    if path:
        root = Path(path)
        if not root.exists():
            raise DataError(
                f"{root}: no such file or directory (data.path must be a text "
                "file, a directory of text files, a .bin token file, an indexed "
                "dataset prefix, a blend 'W1 PATH1 W2 PATH2', or empty for the Python stdlib)"
            )
        files = _text_files(root)
        if not files:
            what = "file is empty" if root.is_file() else "directory has no non-empty files"
            raise DataError(f"{root}: {what} (data.path needs at least one non-empty UTF-8 text file)")
        label = str(root)
    else:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [(f.relative_to(root).as_posix(), f) for f in stdlib_source_files()]
        label = f"python stdlib {root}"
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    tokens, meta = _cached_tokens(root, files, tok, cache)
    kind = "byte" if isinstance(tok, ByteTokenizer) else f"{tok.vocab_size}-id {Path(tok.path).name}"
    source = f"{label}: {meta['documents']} files, {meta['num_tokens']:,} {kind} tokens" + (
        f", {meta['skipped']} binary/non-UTF-8 files skipped" if meta["skipped"] else ""
    )
    return TokenFile(tokens, vocab or tok.vocab_size, source)


def _load_blend(pairs, vocab: int, dtype: str, cache_dir: str, tokenizer: str) -> TokenFile:
    parts = []
    for weight, p in pairs:
        if parse_blend(p) is not None:
            raise ConfigError("data.path", f"blend component {p} is itself a blend", "datasets only")
        f = load_tokens(p, vocab, dtype, cache_dir, tokenizer)
        parts.append((f, Part(p, weight, f.tokens)))
    top = max(f.vocab_size for f, _ in parts)
    blend = Blend([part for _, part in parts])
    return TokenFile(blend, top, blend.describe())


def _load_indexed(prefix: Path, vocab: int) -> TokenFile:
    """A Megatron indexed dataset. Its vocabulary is data.vocab, else the tokenizer's, else the
    one `data prepare` recorded beside it (prefix.json), which also spares the scan for the
    largest id when it describes this very .bin."""
    ds = read_indexed(prefix)
    try:
        side = json.loads(Path(f"{prefix}.json").read_text())
        known = side["num_tokens"] == len(ds.tokens) and side["dtype"] == ds.tokens.dtype.name
    except (OSError, ValueError, KeyError, TypeError):
        side, known = {}, False
    vocab = vocab or (int(side["vocab"]) if known else 0)
    if not vocab:
        raise ConfigError(
            "data.vocab", f"must be set for the indexed dataset {prefix}", "the tokenizer's vocabulary size, > 0"
        )
    top = int(side["max_id"]) if known else _max_id(ds.tokens)
    if top >= vocab or ds.tokens.dtype.kind == "i" and _min_id(ds.tokens) < 0:
        raise DataError(
            f"{prefix}.bin: token id {top} found but data.vocab is {vocab} (ids must be in [0, vocab); wrong vocab?)"
        )
    source = (
        f"{prefix}: {ds.num_documents:,} documents, {len(ds.tokens):,} {ds.tokens.dtype.name} tokens, vocab {vocab}"
    )
    return TokenFile(ds.tokens, vocab, source)


def _max_id(tokens: np.ndarray) -> int:
    # Scan in chunks: a multi-GB corpus must not be pulled into RAM just to be checked.
    return max(int(tokens[i : i + _CHECK_CHUNK].max()) for i in range(0, len(tokens), _CHECK_CHUNK))


def _min_id(tokens: np.ndarray) -> int:
    return min(int(tokens[i : i + _CHECK_CHUNK].min()) for i in range(0, len(tokens), _CHECK_CHUNK))


def _load_bin(path: Path, vocab: int, dtype: str) -> TokenFile:
    if not vocab:
        raise ConfigError(
            "data.vocab", f"must be set for the pre-tokenized file {path}", "the tokenizer's vocabulary size, > 0"
        )
    if not path.is_file():
        raise DataError(
            f"{path}: no such token file (data.path ending in .bin must be a raw {dtype} array of token ids)"
        )
    size, item = path.stat().st_size, np.dtype(dtype).itemsize
    if size == 0:
        raise DataError(f"{path}: token file is empty (expected a raw {dtype} array)")
    if size % item:
        raise DataError(
            f"{path}: size {size} bytes is not a multiple of {item} "
            f"(is data.dtype={dtype} right? valid: uint16, uint32)"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r")
    top = _max_id(tokens)
    if top >= vocab:
        raise DataError(
            f"{path}: token id {top} found but data.vocab is {vocab} "
            f"(ids must be < vocab; wrong vocab or data.dtype={dtype}?)"
        )
    return TokenFile(tokens, vocab, f"{path}: {len(tokens):,} {dtype} tokens, vocab {vocab}")


def _text_files(root: Path) -> list[tuple[str, Path]]:
    """(relative path, path) of the files under `root`, sorted; hidden entries are skipped
    so that e.g. a `.git` folder inside a text directory is not trained on."""
    if root.is_file():
        return [(root.name, root)] if root.stat().st_size else []
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            f = Path(dirpath) / name
            if not name.startswith(".") and f.is_file() and f.stat().st_size:
                out.append((f.relative_to(root).as_posix(), f))
    return sorted(out)


def _cache_key(root: Path, files: list[tuple[str, Path]], tok) -> str:
    # Size + mtime stand in for content: cheap to compute on every start, and any edit
    # (or a different stdlib build) changes the key, so the cache can never go stale.
    h = hashlib.sha1(f"{tok.name}\0{_CACHE_FORMAT}\0{root.resolve()}".encode())
    for rel, f in files:
        st = f.stat()
        h.update(f"\0{rel}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def token_dtype(vocab_size: int) -> str:
    """The smallest element type that holds every id."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _cached_tokens(root, files, tok, cache: Path) -> tuple[np.memmap, dict]:
    key = _cache_key(root, files, tok)
    bin_path, meta_path = cache / f"tokens-{key}.bin", cache / f"tokens-{key}.json"
    meta = _read_meta(meta_path, bin_path, key)
    if meta is None:
        try:
            cache.mkdir(parents=True, exist_ok=True)
            meta = _build_cache(files, tok, bin_path, key)
            atomic_write(meta_path, json.dumps(meta, indent=1).encode())
        except OSError as e:
            raise DataError(
                f"{cache}: cannot write the token cache ({e.strerror}; set "
                "data.cache_dir or $THREEFOLD_CACHE to a writable directory)"
            ) from None
    if meta["num_tokens"] == 0:
        raise DataError(
            f"{root}: no UTF-8 text found ({meta['skipped']} binary or "
            "non-UTF-8 files skipped; data.path needs text files)"
        )
    return np.memmap(bin_path, dtype=meta["dtype"], mode="r"), meta


def _read_meta(meta_path: Path, bin_path: Path, key: str) -> dict | None:
    """The sidecar of a complete cache, or None. The sidecar is written after the token file,
    so its presence (with a matching size) means the token file is whole."""
    try:
        meta = json.loads(meta_path.read_text())
        size = np.dtype(meta["dtype"]).itemsize * meta["num_tokens"]
        ok = meta["key"] == key and bin_path.stat().st_size == size
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta if ok else None


def _build_cache(files, tok, bin_path: Path, key: str) -> dict:
    meta = write_token_file(files, tok, bin_path)
    return {"key": key, "format": _CACHE_FORMAT, **meta}


def _documents(files, skipped: list):
    """Text of each usable file, in order; binary and non-UTF-8 files are counted in `skipped`."""
    for rel, f in files:
        try:
            data = f.read_bytes()
        except OSError as e:
            raise DataError(f"{f}: cannot read corpus file ({e.strerror})") from None
        # NUL is the byte-level document separator, so a file containing it is binary to us.
        if b"\0" in data or not _is_utf8(data):
            skipped.append(rel)
            continue
        yield data


def read_texts(files) -> list[str]:
    """Every usable document of `files` as text (for training a tokenizer)."""
    return [data.decode("utf-8") for data in _documents(files, [])]


def write_token_file(files, tok, bin_path: Path, batch: int = 64) -> dict:
    """Tokenize `files` into one flat stream at `bin_path` (documents joined by the tokenizer's
    separator, if it has one); returns what the cache sidecar records about it."""
    dtype = token_dtype(tok.vocab_size)
    num_tokens = documents = 0
    skipped: list = []

    def encode(texts: list[bytes]) -> list:
        if isinstance(tok, ByteTokenizer):
            return [np.frombuffer(data, dtype=np.uint8) for data in texts]
        # Batches go through the Rust tokenizer's own thread pool.
        return [np.asarray(ids) for ids in tok.encode_batch([d.decode("utf-8") for d in texts])]

    def write(fh):
        pending: list[bytes] = []

        def flush():
            nonlocal num_tokens, documents
            for ids in encode(pending):
                if documents and tok.separator is not None:
                    fh.write(np.array([tok.separator], dtype=dtype).tobytes())
                    num_tokens += 1
                fh.write(ids.astype(dtype).tobytes())
                num_tokens += len(ids)
                documents += 1
            pending.clear()

        for data in _documents(files, skipped):
            pending.append(data)
            if len(pending) >= batch:
                flush()
        flush()

    # Concurrent ranks building the same cache each write a private temp file; the last
    # rename wins with identical bytes.
    with atomic_open(bin_path) as fh:
        write(fh)
    return {
        "tokenizer": tok.name,
        "dtype": dtype,
        "num_tokens": num_tokens,
        "documents": documents,
        "skipped": len(skipped),
    }


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
