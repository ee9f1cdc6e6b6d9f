"""Byte-level tokenizer: every UTF-8 byte is a token, so no vocabulary file is needed."""
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
