"""`threefold data prepare`: train a BPE tokenizer on a corpus and write its token stream.

    threefold data prepare --out DIR [--vocab 8192] [--data.path CORPUS]

writes DIR/tokenizer.json (byte-level BPE from the `tokenizers` package, id 0 = <|endoftext|>,
which separates documents as byte 0 does in byte-level streams) and DIR/tokens.bin (uint16, or
uint32 above 65536 ids), and prints the keys that train on them. The corpus is found exactly as
`threefold train` finds it: a text file, a directory of text files, or the Python stdlib.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

from threefold.data.corpus import _text_files, read_texts, stdlib_source_files, write_token_file
from threefold.data.tokenizer import FileTokenizer
from threefold.errors import ConfigError, DataError, UserError

END_OF_TEXT = "<|endoftext|>"


def corpus_files(path: str) -> list[tuple[str, Path]]:
    if not path:
        root = Path(sysconfig.get_paths()["stdlib"])
        return [(f.relative_to(root).as_posix(), f) for f in stdlib_source_files()]
    root = Path(path)
    if path.endswith(".bin"):
        raise ConfigError("data.path", f"{path} is already tokenized", "a text file or directory of text files")
    if not root.exists():
        raise DataError(f"{root}: no such file or directory (data.path must be text files, or empty for the stdlib)")
    files = _text_files(root)
    if not files:
        raise DataError(f"{root}: no non-empty text files to train a tokenizer on")
    return files


def train_bpe(texts: list[str], vocab: int):
    """A byte-level BPE tokenizer of `vocab` ids (GPT-2's scheme: no unknown tokens)."""
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
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


def prepare(path: str, out: str, vocab: int) -> dict:
    if not 257 <= vocab <= 1 << 32:
        raise ConfigError("--vocab", f"{vocab} ids", "at least 257 (256 bytes + end of text)")
    files = corpus_files(path)
    texts = read_texts(files)
    if not texts:
        raise DataError(f"{path or 'stdlib'}: no UTF-8 text found")
    dst = Path(out)
    if dst.exists() and not dst.is_dir():
        raise DataError(f"{dst}: exists and is not a directory (--out must be a directory)")
    dst.mkdir(parents=True, exist_ok=True)
    train_bpe(texts, vocab).save(str(dst / "tokenizer.json"))
    tok = FileTokenizer(str(dst / "tokenizer.json"))
    meta = write_token_file(files, tok, dst / "tokens.bin")
    meta["vocab"] = tok.vocab_size
    (dst / "tokens.json").write_text(json.dumps(meta, indent=1))
    return meta


def data_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="threefold data")
    sub = parser.add_subparsers(dest="action", required=True)
    prep = sub.add_parser("prepare", help="train a BPE tokenizer on the corpus and write tokens.bin")
    prep.add_argument("--out", required=True, help="directory for tokenizer.json and tokens.bin")
    prep.add_argument("--vocab", type=int, default=8192, help="tokenizer size in ids (default 8192)")
    prep.add_argument("--data.path", dest="path", default="", help="corpus ('' = Python stdlib sources)")
    args = parser.parse_args(argv)
    meta = prepare(args.path, args.out, args.vocab)
    out = Path(args.out)
    print(
        f"wrote {out / 'tokenizer.json'} ({meta['vocab']} ids) and {out / 'tokens.bin'} "
        f"({meta['num_tokens']:,} {meta['dtype']} tokens from {meta['documents']} documents)"
    )
    print(
        f"train with: --data.path {out / 'tokens.bin'} --data.dtype {meta['dtype']} --data.vocab {meta['vocab']} "
        f"--data.tokenizer {out / 'tokenizer.json'} --model.vocab {meta['vocab']}"
    )
    return 0
