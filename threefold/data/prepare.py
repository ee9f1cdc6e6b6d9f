"""`threefold data prepare`: a corpus in, a Megatron-LM indexed dataset out.

    threefold data prepare --out DIR [--data.path CORPUS] [--json-key text] [--workers N]
                           [--tokenizer tokenizer.json | --vocab 8192] [--max-bad N]

CORPUS is JSONL (one object per line, the text under --json-key), Parquet (that column, via
pyarrow), a directory saved by Hugging Face `datasets` (save_to_disk), text files / a directory
of them (one document per file), or '' for the Python stdlib sources. Without --tokenizer a
byte-level BPE tokenizer (id 0 = <|endoftext|>) is trained on the first --sample-mb of the corpus.

Writes DIR/tokenizer.json, DIR/tokens.bin + DIR/tokens.idx (every document followed by the
end-of-document id; uint16 ids below 65500, else int32, as Megatron-LM writes them) and
DIR/tokens.json (counts, vocabulary, largest id). Shards are tokenized in parallel by --workers
processes into DIR/.prepare-KEY/ and merged at the end; a rerun of the same command resumes,
skipping the shards already finished. Bad records are counted per class and skipped; more than
--max-bad of them stops the run with exit 2 and writes no dataset.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import multiprocessing
import shutil
import sys
import sysconfig
import time
from pathlib import Path

from threefold.atomic import atomic_write
from threefold.data.corpus import stdlib_source_files
from threefold.data.indexed import megatron_dtype
from threefold.data.prepare_workers import init_worker, is_done, merge_shards, tokenize_shard
from threefold.data.sources import BAD_CLASSES, Bad, detect_format, plan_shards, records, text_shards
from threefold.data.tokenizer import SEPARATOR_NAMES, FileTokenizer
from threefold.errors import ConfigError, DataError, UserError

END_OF_TEXT = "<|endoftext|>"
PREFIX = "tokens"  # DIR/tokens.bin, DIR/tokens.idx, DIR/tokens.json
MIN_SHARDS = 16  # a corpus is cut finer than --shard-mb down to this many shards...
MIN_SHARD_BYTES = 1 << 20  # ...but not below 1 MiB each


def train_bpe(texts, vocab: int):
    """A byte-level BPE tokenizer of `vocab` ids (GPT-2's scheme: no unknown tokens), trained
    from an iterator of texts (streamed, never a list of the whole corpus)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise UserError(
            "threefold data prepare trains with the tokenizers package: `pip install tokenizers` (or the [hf] extra)"
        ) from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[END_OF_TEXT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def _sample(shards, key: str, limit: int):
    """Documents from the start of the corpus up to `limit` bytes of text, for BPE training."""
    seen = 0
    for shard in shards:
        for rec in records(shard, key):
            if isinstance(rec, Bad):
                continue
            yield rec
            seen += len(rec)
            if seen >= limit:
                return


def _plan(path: str, fmt: str, key: str, shard_bytes: int):
    if not path:
        return (
            "text",
            text_shards(stdlib_source_files(), shard_bytes),
            f"python stdlib {sysconfig.get_paths()['stdlib']}",
        )
    if path.endswith((".bin", ".idx")):
        raise ConfigError("data.path", f"{path} is already tokenized", "JSONL, Parquet, text files or a dataset dir")
    root = Path(path)
    fmt = detect_format(root, fmt) if root.exists() else fmt
    shards = plan_shards(root, fmt, key, shard_bytes)
    # A small corpus cut at --shard-mb gives a few shards of unequal size, and the workers
    # finish at the largest one's pace; at least MIN_SHARDS keeps the tail short. The plan
    # depends on the corpus only, never on --workers, so a resume with other workers still matches.
    finer = max(MIN_SHARD_BYTES, sum(s.size for s in shards) // MIN_SHARDS)
    if len(shards) < MIN_SHARDS and finer < shard_bytes:
        shards = plan_shards(root, fmt, key, finer)
    return fmt, shards, str(root)


def _work_key(shards, key: str, tok_spec: str) -> str:
    # Sizes and mtimes stand in for content, as in the token cache: an edited input is a new plan.
    h = hashlib.sha1(f"{key}\0{tok_spec}".encode())
    for s in shards:
        h.update(json.dumps(s.to_dict()).encode())
        for f in s.files:
            st = Path(f).stat()
            h.update(f"\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def prepare(
    path: str,
    out: str,
    vocab: int = 8192,
    *,
    tokenizer: str = "",
    json_key: str = "text",
    fmt: str = "auto",
    workers: int = 1,
    max_bad: int = 1000,
    shard_mb: float = 32.0,
    sample_mb: float = 256.0,
    log=None,
) -> dict:
    """Tokenize the corpus at `path` into out/tokens.{bin,idx}; returns out/tokens.json's dict."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if not tokenizer and not 257 <= vocab <= 1 << 32:
        raise ConfigError("--vocab", f"{vocab} ids", "at least 257 (256 bytes + end of text)")
    if workers < 1:
        raise ConfigError("--workers", f"{workers}", "at least 1 process")
    if max_bad < 0 or shard_mb <= 0:
        raise ConfigError("--max-bad/--shard-mb", f"{max_bad}/{shard_mb}", "max-bad >= 0, shard-mb > 0")
    fmt, shards, label = _plan(path, fmt, json_key, int(shard_mb * (1 << 20)))
    dst = Path(out)
    if dst.exists() and not dst.is_dir():
        raise DataError(f"{dst}: exists and is not a directory (--out must be a directory)")
    dst.mkdir(parents=True, exist_ok=True)
    tok_spec = f"file {FileTokenizer(tokenizer).name}" if tokenizer else f"bpe {vocab} {sample_mb}"
    key = _work_key(shards, json_key, tok_spec)
    meta_path = dst / f"{PREFIX}.json"
    done_meta = _finished(meta_path, key)
    if done_meta:
        log(f"prepare: {dst} already holds this corpus ({done_meta['num_tokens']:,} tokens); nothing to do")
        return done_meta
    work = dst / f".prepare-{key}"
    work.mkdir(exist_ok=True)
    tok_file = work / "tokenizer.json"
    if not tok_file.is_file():
        if tokenizer:
            shutil.copyfile(tokenizer, tok_file)
        else:
            log(f"prepare: training a {vocab}-id BPE tokenizer on up to {sample_mb:g} MB of {label}")
            bpe = train_bpe(_sample(shards, json_key, int(sample_mb * (1 << 20))), vocab)
            atomic_write(tok_file, bpe.to_str().encode())
    tok = FileTokenizer(str(tok_file))
    if tok.separator is None:
        raise DataError(
            f"{tokenizer or tok_file}: the tokenizer has no end-of-document token (one of {', '.join(SEPARATOR_NAMES)})"
        )
    dtype = megatron_dtype(tok.vocab_size)
    results = _run_shards(shards, work, json_key, tok, dtype, workers, max_bad, label, log)
    bad = _report_bad(results, log)
    documents, tokens = merge_shards(work, len(shards), dst / PREFIX)
    shutil.copyfile(tok_file, dst / "tokenizer.json")
    meta = {
        "key": key,
        "format": "megatron-indexed",
        "input": label,
        "input_format": fmt,
        "tokenizer": tok.name,
        "vocab": tok.vocab_size,
        "dtype": dtype.name,
        "end_of_document": tok.separator,
        "num_tokens": tokens,
        "documents": documents,
        "max_id": max(r["max_id"] for r in results),
        "bad": bad,
    }
    atomic_write(meta_path, json.dumps(meta, indent=1).encode())  # last: its key marks the dataset done
    shutil.rmtree(work, ignore_errors=True)
    return meta


def _finished(meta_path: Path, key: str) -> dict | None:
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    ok = meta.get("key") == key and all((meta_path.parent / f"{PREFIX}{s}").is_file() for s in (".bin", ".idx"))
    return meta if ok else None


def _run_shards(shards, work: Path, key: str, tok, dtype, workers: int, max_bad: int, label: str, log) -> list:
    """Every shard's counts, tokenizing the unfinished ones over `workers` processes; stops
    (DataError) as soon as the bad records counted so far pass max_bad."""
    results: dict[int, dict] = {}
    for i in range(len(shards)):
        meta = is_done(work, i)
        if meta is not None:
            results[i] = meta
    todo = [i for i in range(len(shards)) if i not in results]
    total_mb = sum(s.size for s in shards) / 2**20
    log(
        f"prepare: {label}: {len(shards)} shards, {total_mb:,.0f} MB, {workers} worker(s)"
        + (f"; resuming, {len(results)} shards already done" if results else "")
    )
    jobs = [(i, shards[i].to_dict(), key, str(work), tok.separator, dtype.name) for i in todo]
    t0, done_mb, done_tokens = time.perf_counter(), 0.0, 0

    def finished(meta: dict) -> None:
        nonlocal done_mb, done_tokens
        done_mb += meta["bytes"] / 2**20
        done_tokens += meta["tokens"]
        dt = max(time.perf_counter() - t0, 1e-9)
        left = total_mb - sum(r["bytes"] for r in results.values()) / 2**20
        log(
            f"prepare: {len(results)}/{len(shards)} shards  {done_mb:,.0f} MB in {dt:.1f}s  "
            f"{done_tokens / dt / 1e6:.2f}M tokens/s  eta {left / max(done_mb / dt, 1e-9):.0f}s"
        )
        nbad = sum(sum(r["bad"].values()) for r in results.values())
        if nbad > max_bad:
            _report_bad(list(results.values()), log)
            raise DataError(
                f"{nbad} bad records exceed --max-bad {max_bad}; no dataset written (fix the input or raise "
                f"--max-bad; the {len(results)} finished shards are kept in {work} for the rerun)"
            )

    if workers == 1 or len(jobs) <= 1:
        init_worker(str(work / "tokenizer.json"))
        for job in jobs:
            results[job[0]] = tokenize_shard(job)
            finished(results[job[0]])
    elif jobs:
        # spawn: a forked child would inherit the parent's tokenizer thread pool state.
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(
            workers, ctx, initializer=init_worker, initargs=(str(work / "tokenizer.json"),)
        ) as pool:
            futures = {pool.submit(tokenize_shard, job): job[0] for job in jobs}
            try:
                for fut in cf.as_completed(futures):
                    results[futures[fut]] = fut.result()
                    finished(results[futures[fut]])
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    return [results[i] for i in range(len(shards))]


def _report_bad(results: list, log) -> dict:
    """One line per bad-record class with its count and first place; returns {class: count}."""
    counts: dict[str, int] = {}
    first: dict[str, str] = {}
    for r in results:
        for kind, n in r["bad"].items():
            counts[kind] = counts.get(kind, 0) + n
            first.setdefault(kind, r["first_bad"].get(kind, "?"))
    for kind in sorted(counts):
        log(f"prepare: skipped {counts[kind]} records: {BAD_CLASSES[kind]} (first at {first[kind]})")
    return counts
