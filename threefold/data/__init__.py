"""Data: byte tokenizer, corpus -> memory-mapped token stream, layout-invariant sampler,
background prefetcher. Depends only on numpy/torch and threefold.errors."""

from threefold.data.corpus import TokenFile, load_tokens, stdlib_source_files
from threefold.data.prefetch import Prefetcher
from threefold.data.sampler import GlobalBatchSampler
from threefold.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "GlobalBatchSampler", "Prefetcher", "TokenFile", "load_tokens", "stdlib_source_files"]
