"""raylm's data layer: find and check the files, tokenize them once into a parquet cache with
global sample ids (Ray Data), and read samples by id on the workers.

The public names are imported lazily (PEP 562): a Ray Data tokenization task imports
``raylm.data.tokenized``, which runs this file, and should not pay for importing torch.
"""

import importlib

_EXPORTS = {
    "BlockReader": "raylm.data.reader",
    "Prefetcher": "raylm.data.reader",
    "SUPPORTED_EXTENSIONS": "raylm.data.sources",
    "builtin_sample_files": "raylm.data.sources",
    "builtin_tokenizer_dir": "raylm.data.sources",
    "resolve_files": "raylm.data.sources",
    "validate_files": "raylm.data.sources",
    "TokenizedDataset": "raylm.data.tokenized",
    "build_tokenized_dataset": "raylm.data.tokenized",
    "default_cache_root": "raylm.data.tokenized",
    "train_tokenizer": "raylm.data.tokenizer_train",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'raylm.data' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
