"""Tokenizers: the C++ WordPiece tokenizer (``WordPieceTokenizer``) and the pure-Python reference
(``ReferenceTokenizer``, the oracle the C++ one is tested against). Both are one HF-style front end
(``base.TokenizerBase``: ``__call__``, ``encode``, ``convert_tokens_to_ids``, ``convert_ids_to_tokens``,
``decode``, ``vocab``) over their own ``tokenize`` and ``encode_batch``."""
from __future__ import annotations

import importlib

_LAZY = {
    "ReferenceTokenizer": "fastbert.tokenization.reference",
    "WordPieceTokenizer": "fastbert.tokenization.wordpiece",
    "train_wordpiece_vocab": "fastbert.tokenization.vocab_trainer",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fastbert.tokenization' has no attribute {name!r}")


def load_tokenizer(path, **kwargs):
    """The fastest available tokenizer for a vocab.txt file or an HF checkpoint directory.

    Uses the C++ ``WordPieceTokenizer`` when the extension provides it, else the reference.
    """
    from pathlib import Path
    try:
        cls = __getattr__("WordPieceTokenizer")
    except (ImportError, AttributeError):
        cls = __getattr__("ReferenceTokenizer")
    if Path(path).is_dir():
        return cls.from_pretrained(path, **kwargs)
    return cls(path, **kwargs)


__all__ = ["ReferenceTokenizer", "WordPieceTokenizer", "load_tokenizer", "train_wordpiece_vocab"]
