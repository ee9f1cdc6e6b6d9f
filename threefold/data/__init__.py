"""Data: tokenizers, corpus -> memory-mapped token stream, Megatron indexed datasets, weighted
blends, layout-invariant sampler, background prefetcher. Depends only on numpy/torch and
threefold.errors.

Names are imported on first use, so that `data prepare`'s worker processes load numpy and
tokenizers but not torch.
"""

from importlib import import_module

_EXPORTS = {
    "ByteTokenizer": "threefold.data.tokenizer",
    "GlobalBatchSampler": "threefold.data.sampler",
    "Prefetcher": "threefold.data.prefetch",
    "TokenFile": "threefold.data.corpus",
    "load_tokens": "threefold.data.corpus",
    "stdlib_source_files": "threefold.data.corpus",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'threefold.data' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
