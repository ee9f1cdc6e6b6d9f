"""Preprocessing throughput: `threefold data prepare` against Hugging Face `datasets.map`.

    python bench/data_prepare.py [--mb 200] [--dir DIR] [--workers 1,2] [--rounds 3] [--out FILE]

Generates a JSONL corpus of at least --mb MB from the Python stdlib sources (one document per
function-sized chunk, each copy tagged so no two documents are equal; nothing downloaded), trains
one 8192-id BPE tokenizer on 16 MB of it, then tokenizes the same files with the same tokenizer:

- threefold: `prepare(..., workers=N)`: JSON parsing, tokenization, indexed .bin/.idx shards and
  the final merge, all timed;
- datasets: `load_dataset("json")` (JSON -> Arrow, fresh cache) + `Dataset.map(batched=True,
  num_proc=N)` calling the same tokenizer's `encode_batch`; timed with and without the load.

TOKENIZERS_PARALLELISM=false on both sides, so N workers are N single-threaded processes and the
ratio compares equal cores. Tokens/s = tokens written (threefold counts the end-of-document id
per document; datasets' count adds it too) / wall seconds. Needs `pip install datasets`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from threefold.data.corpus import stdlib_source_files  # noqa: E402
from threefold.data.prepare import prepare, train_bpe  # noqa: E402


def make_corpus(root: Path, mb: float, files: int = 4) -> list[Path]:
    """`files` JSONL files of about mb/files MB together; reused when already there."""
    root.mkdir(parents=True, exist_ok=True)
    paths = [root / f"part-{i}.jsonl" for i in range(files)]
    target = int(mb * 2**20)
    if all(p.exists() for p in paths) and sum(p.stat().st_size for p in paths) >= target:
        return paths
    chunks = []
    for f in stdlib_source_files():
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        # Split at top-level definitions: documents of a few hundred bytes to a few KB.
        for block in text.split("\ndef "):
            if block.strip():
                chunks.append(block)
    outs = [open(p, "w") for p in paths]  # noqa: SIM115
    written, copy = 0, 0
    while written < target:
        for i, block in enumerate(chunks):
            line = json.dumps({"text": f"# copy {copy} chunk {i}\ndef {block}", "id": i}) + "\n"
            outs[i % files].write(line)
            written += len(line)
            if written >= target:
                break
        copy += 1
    for o in outs:
        o.close()
    return paths


def run_threefold(corpus: Path, tok: str, workers: int, scratch: Path) -> dict:
    out = scratch / f"tf-{workers}"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    meta = prepare(str(corpus), str(out), tokenizer=tok, workers=workers, log=lambda m: None)
    dt = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return {"seconds": dt, "tokens": meta["num_tokens"], "tokens_per_s": meta["num_tokens"] / dt}


def run_datasets(files: list[Path], tok_path: str, workers: int, scratch: Path) -> dict:
    import datasets
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    cache = scratch / f"hf-cache-{workers}"
    shutil.rmtree(cache, ignore_errors=True)
    tok = Tokenizer.from_file(tok_path)
    eod = tok.token_to_id("<|endoftext|>")

    def encode(batch):
        return {"ids": [e.ids + [eod] for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}

    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=[str(f) for f in files], split="train", cache_dir=str(cache))
    t1 = time.perf_counter()
    out = ds.map(encode, batched=True, num_proc=workers if workers > 1 else None, remove_columns=ds.column_names)
    t2 = time.perf_counter()
    tokens = sum(len(x) for b in out.iter(batch_size=10_000) for x in b["ids"])
    shutil.rmtree(cache, ignore_errors=True)
    return {
        "load_seconds": t1 - t0,
        "map_seconds": t2 - t1,
        "tokens": tokens,
        "tokens_per_s": tokens / (t2 - t0),
        "map_only_tokens_per_s": tokens / (t2 - t1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0)
    parser.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "threefold-bench-data"))
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--out", default="")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per worker count (order alternating)")
    args = parser.parse_args()
    # Imported here, not at the top: prepare's spawned workers re-import this file as their
    # main module, and stats pulls in torch (3 s per worker here), which is this script's cost,
    # not the tool's (the `threefold` command's main module imports nothing heavy).
    from stats import paired_ratio, show

    root = Path(args.dir)
    files = make_corpus(root / "corpus", args.mb)
    size = sum(f.stat().st_size for f in files) / 2**20
    tok = root / "tokenizer.json"
    if not tok.exists():
        sample = []  # about 16 MB: the first 10,000 documents (of every file, for a small corpus)
        for path in files:
            with open(path) as fh:
                sample += [json.loads(line)["text"] for _, line in zip(range(10_000 - len(sample)), fh)]
        train_bpe(iter(sample), 8192).save(str(tok))
    results = {"corpus_mb": size, "files": len(files), "cpus": os.cpu_count(), "runs": {}}
    print(f"corpus: {len(files)} JSONL files, {size:,.0f} MB; tokenizer {tok}")
    for w in [int(x) for x in args.workers.split(",")]:
        rounds = []
        for r in range(args.rounds):  # one of each per round, the order alternating: drift hits both
            first, second = (run_threefold, run_datasets) if r % 2 == 0 else (run_datasets, run_threefold)
            one = first(root / "corpus" if first is run_threefold else files, str(tok), w, root)
            two = second(root / "corpus" if second is run_threefold else files, str(tok), w, root)
            tf, hf = (one, two) if first is run_threefold else (two, one)
            rounds.append({"threefold": tf, "datasets": hf})
            print(
                f"workers {w} round {r + 1}: threefold {tf['tokens_per_s'] / 1e6:.2f}M tok/s "
                f"({tf['seconds']:.1f}s, {tf['tokens']:,} tokens)"
                f" | datasets load+map {hf['tokens_per_s'] / 1e6:.2f}M tok/s (load {hf['load_seconds']:.1f}s + map "
                f"{hf['map_seconds']:.1f}s; map alone {hf['map_only_tokens_per_s'] / 1e6:.2f}M tok/s)"
            )
        ratio = paired_ratio(
            [x["threefold"]["tokens_per_s"] for x in rounds], [x["datasets"]["tokens_per_s"] for x in rounds]
        )
        vs_map = paired_ratio(
            [x["threefold"]["tokens_per_s"] for x in rounds], [x["datasets"]["map_only_tokens_per_s"] for x in rounds]
        )
        results["runs"][w] = {"rounds": rounds, "ratio": asdict(ratio), "ratio_vs_map_only": asdict(vs_map)}
        print(f"workers {w}: threefold / datasets (load+map) {show(ratio)}; / map alone {show(vs_map)}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
