"""`threefold data prepare --out DIR [--data.path CORPUS] ...`: tokenize a corpus into a Megatron
indexed dataset (threefold.data.prepare)."""

from __future__ import annotations

import argparse
from pathlib import Path

from threefold.data.prepare import PREFIX, prepare


def data_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="threefold data")
    sub = parser.add_subparsers(dest="action", required=True)
    prep = sub.add_parser("prepare", help="tokenize a corpus into a Megatron indexed dataset (tokens.bin/.idx)")
    prep.add_argument("--out", required=True, help="directory for tokenizer.json and tokens.bin/.idx/.json")
    prep.add_argument("--data.path", dest="path", default="", help="corpus ('' = Python stdlib sources)")
    prep.add_argument("--format", default="auto", help="auto (by file names), jsonl, parquet, text or hf")
    prep.add_argument("--json-key", default="text", help="JSON key / Parquet or dataset column of the text")
    prep.add_argument("--tokenizer", default="", help="tokenizer.json to use (default: train a BPE one)")
    prep.add_argument("--vocab", type=int, default=8192, help="size of the BPE tokenizer to train (default 8192)")
    prep.add_argument("--sample-mb", type=float, default=256.0, help="MB of text the BPE tokenizer trains on")
    prep.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    prep.add_argument("--max-bad", type=int, default=1000, help="bad records tolerated before exit 2")
    prep.add_argument("--shard-mb", type=float, default=32.0, help="input MB per shard, at most (unit of work, resume)")
    args = parser.parse_args(argv)
    meta = prepare(
        args.path,
        args.out,
        args.vocab,
        tokenizer=args.tokenizer,
        json_key=args.json_key,
        fmt=args.format,
        workers=args.workers,
        max_bad=args.max_bad,
        shard_mb=args.shard_mb,
        sample_mb=args.sample_mb,
    )
    out = Path(args.out)
    print(
        f"wrote {out / 'tokenizer.json'} ({meta['vocab']} ids) and {out / PREFIX}.bin/.idx "
        f"({meta['num_tokens']:,} {meta['dtype']} tokens from {meta['documents']:,} documents)"
    )
    print(
        f"train with: --data.path {out / PREFIX} --data.tokenizer {out / 'tokenizer.json'} "
        f"--model.vocab {meta['vocab']}"
    )
    return 0
