"""Loading a checkpoint + tokenizer for the analysis commands (features, attention, cluster), and
reading their text inputs, with one clear error for each kind of bad input."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch


def resolve_device(device: Optional[str]) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def load_encoder(model_dir, kernels: Optional[str] = None, device: Optional[str] = None, cls=None):
    """``(model, tokenizer, device)`` for an HF BERT checkpoint folder (any Bert* head: the encoder is
    taken). fp32 on the CPU, bf16 on CUDA unless ``FASTBERT_FP32=1``."""
    import os

    from fastbert.cli import UsageError
    from fastbert.model import BertModel
    from fastbert.tokenization import load_tokenizer

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UsageError(f"model checkpoint folder not found: {model_dir} (pass an HF BERT checkpoint directory)")
    for need in ("config.json", "vocab.txt"):
        if not (model_dir / need).is_file():
            from fastbert.hf import not_a_checkpoint_hint
            raise UsageError(f"{model_dir} has no {need}: pass an HF BERT checkpoint directory with config.json, "
                             "weights and vocab.txt" + not_a_checkpoint_hint(model_dir))
    dev = resolve_device(device)
    kernels = kernels or ("triton" if dev.type == "cuda" else "torch")
    model = (cls or BertModel).from_pretrained(model_dir, kernels=kernels).to(dev)
    if dev.type == "cuda" and os.environ.get("FASTBERT_FP32") != "1":
        model = model.to(torch.bfloat16)
    model.eval()
    return model, load_tokenizer(model_dir), dev


def read_inputs(path, pair_separator: str = " ||| ") -> tuple[list[str], list[Optional[str]]]:
    """Non-empty lines of a text file; a line ``a ||| b`` is the sentence pair (a, b), as in Google's
    extract_features.py."""
    from fastbert.cli import UsageError
    from fastbert.textio import READ_ERRORS, open_text, unreadable

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"input file not found: {path} (one text per line; 'a ||| b' for a pair)")
    texts, pairs = [], []
    try:
        with open_text(path) as f:
            for line in f:
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                a, sep, b = line.partition(pair_separator)
                texts.append(a.strip())
                pairs.append(b.strip() if sep else None)
    except READ_ERRORS as e:
        raise UsageError(str(unreadable(path, e))) from None
    if not texts:
        raise UsageError(f"{path} has no text lines")
    return texts, pairs
