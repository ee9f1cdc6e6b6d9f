"""Tokenizers: byte-level (every UTF-8 byte is a token, no vocabulary file, no dependency), or a
tokenizer.json through the `tokenizers` package."""

from __future__ import annotations

# Byte 0 separates documents. Text files that contain it are treated as binary and skipped,
# so inside a byte-level corpus a 0 token always means "document boundary".
DOC_SEPARATOR = 0


class ByteTokenizer:
    """Token id = UTF-8 byte value; 256 ids, id 0 doubles as the document separator."""

    name = "byte-utf8-v1"  # part of the token-cache key: change it if encoding changes
    vocab_size = 256
    separator = DOC_SEPARATOR

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # Sampled windows may cut a multi-byte character in half: replace, never raise.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


# Special tokens that separate documents, by the names common tokenizers give them.
SEPARATOR_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")


class FileTokenizer:
    """A tokenizer.json read through the `tokenizers` package (BPE, WordPiece, Unigram ...).

    Documents are separated by the tokenizer's end-of-text token when it has one."""

    def __init__(self, path: str):
        from pathlib import Path

        from threefold.errors import DataError, UserError

        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError(
                f"data.tokenizer {path} needs the tokenizers package: `pip install tokenizers` (or the [hf] extra)"
            ) from None
        p = Path(path)
        if not p.is_file():
            raise DataError(
                f"{path}: no such tokenizer file (data.tokenizer must be a tokenizer.json, or '' for byte-level)"
            )
        try:
            self.tok = Tokenizer.from_file(str(p))
        except Exception as err:  # the Rust side raises plain Exception with its own message
            raise DataError(f"{path}: not a tokenizers tokenizer.json ({str(err).splitlines()[0]})") from None
        import hashlib

        self.path = str(p)
        self.name = "tokenizers-" + hashlib.sha1(p.read_bytes()).hexdigest()[:16]
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        ids = [self.tok.token_to_id(n) for n in SEPARATOR_NAMES]
        self.separator = next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def open_tokenizer(path: str = "") -> ByteTokenizer | FileTokenizer:
    """The tokenizer data.tokenizer names ('' = byte-level, no dependency)."""
    return FileTokenizer(path) if path else ByteTokenizer()


def check_vocab(tokenizer, model_vocab: int, where: str) -> None:
    """A tokenizer whose ids do not all fit the model's embedding is refused in one line."""
    from threefold.errors import DataError

    if tokenizer.vocab_size > model_vocab:
        raise DataError(
            f"{where}: tokenizer has {tokenizer.vocab_size} ids but model.vocab is {model_vocab} "
            f"(use a tokenizer of at most {model_vocab} ids, or a model with model.vocab >= "
            f"{tokenizer.vocab_size})"
        )
