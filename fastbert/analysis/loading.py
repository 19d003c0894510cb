"""Loading a checkpoint + tokenizer for the analysis commands (features, attention, cluster), and
reading their text inputs, with one clear error for each kind of bad input."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from fastbert.ops import resolve_kernels


def resolve_device(device: Optional[str]) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def load_encoder(model_dir, kernels: Optional[str] = None, device: Optional[str] = None, cls=None,
                 dtype: Optional[torch.dtype] = None):
    """``(model, tokenizer, device)`` for an HF BERT checkpoint folder (any Bert* head: the encoder is
    taken), in ``dtype``: by default fp32 on the CPU and bf16 on CUDA."""
    from fastbert.errors import UsageError, not_a_checkpoint_hint
    from fastbert.model import BertModel
    from fastbert.tokenization import load_tokenizer

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UsageError(f"model checkpoint folder not found: {model_dir} (pass an HF BERT checkpoint directory)")
    for need in ("config.json", "vocab.txt"):
        if not (model_dir / need).is_file():
            raise UsageError(f"{model_dir} has no {need}: pass an HF BERT checkpoint directory with config.json, "
                             "weights and vocab.txt" + not_a_checkpoint_hint(model_dir))
    dev = resolve_device(device)
    kernels = resolve_kernels(kernels, dev)
    model = (cls or BertModel).from_pretrained(model_dir, kernels=kernels).to(dev)
    if dtype is None:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = model.to(dtype)
    model.eval()
    return model, load_tokenizer(model_dir), dev


def read_inputs(path, pair_separator: str = " ||| ", column: Optional[str] = None,
                pair_column: Optional[str] = None) -> tuple[list[str], list[Optional[str]]]:
    """Texts (and pair texts) of an input file.

    Plain text: every non-empty line is one input; a line ``a ||| b`` is the sentence pair (a, b),
    as in Google's extract_features.py. A ``.tsv`` file (also ``.tsv.xz`` / ``.tsv.gz``), or any
    file when ``column`` is given, is read by column (tab-separated, no quoting, as GLUE's files):
    ``column`` / ``pair_column`` name header columns (the first row is the header), or are 0-based
    numbers (every row is data). Without ``column`` the GLUE layout is recognised
    (``fastbert.data.glue.text_columns``: SST-2's ``sentence``, MRPC's ``#1 String`` / ``#2 String``,
    CoLA's header-less 4th column, ...); labels and ids are never read as text."""
    from fastbert.errors import UsageError
    from fastbert.textio import READ_ERRORS, open_text, unreadable

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"input file not found: {path} (one text per line; 'a ||| b' for a pair)")
    if pair_column is not None and column is None:
        raise UsageError("--pair-column needs --column (the column of the first text)")
    try:
        with open_text(path) as f:
            lines = [line.rstrip("\r\n") for line in f]
    except READ_ERRORS as e:
        raise UsageError(str(unreadable(path, e))) from None
    if lines:
        lines[0] = lines[0].removeprefix("\ufeff")  # MRPC's files start with a byte-order mark
    if column is not None or ".tsv" in path.suffixes:
        rows = {lineno: line.split("\t") for lineno, line in enumerate(lines, start=1) if line.strip()}
        texts, pairs = _columns(path, rows, column, pair_column)
    else:
        texts, pairs = [], []
        for line in lines:
            if not line.strip():
                continue
            a, sep, b = line.partition(pair_separator)
            texts.append(a.strip())
            pairs.append(b.strip() if sep else None)
    if not texts:
        raise UsageError(f"{path} has no text lines")
    return texts, pairs


def _columns(path: Path, rows: dict[int, list[str]], column, pair_column) -> tuple[list[str], list[Optional[str]]]:
    """The text (and pair) column of tab-separated ``rows`` ({line number: fields}); see read_inputs."""
    from fastbert.data.glue import text_columns
    from fastbert.errors import UsageError

    if not rows:
        return [], []
    first = next(iter(rows.values()))
    if column is None:
        found = text_columns(first)
        if found is None:
            if all(len(r) == 1 for r in rows.values()):  # one column: plain lines
                return [r[0].strip() for r in rows.values()], [None] * len(rows)
            raise UsageError(f"{path}: cannot tell which tab-separated column holds the text (first row: "
                             f"{first[:6]}); pass --column NAME (a header name, or a 0-based number for a "
                             f"file without a header) and --pair-column NAME for sentence pairs")
        a, b, header = found
    else:
        header = not str(column).isdigit()
        if pair_column is not None and str(pair_column).isdigit() == header:
            raise UsageError("--column and --pair-column must both be header names or both 0-based numbers")
        names = first if header else []
        a, b = (None if c is None else _column_index(path, names, c) for c in (column, pair_column))
    body = list(rows.items())[1:] if header else rows.items()
    need = max(a, b if b is not None else -1) + 1
    texts, pairs = [], []
    for lineno, row in body:
        if len(row) < need:
            raise UsageError(f"{path}:{lineno}: expected at least {need} tab-separated columns, got {len(row)}")
        texts.append(row[a].strip())
        pairs.append(row[b].strip() if b is not None else None)
    return texts, pairs


def _column_index(path: Path, header: list[str], name: str) -> int:
    from fastbert.errors import UsageError

    if str(name).isdigit():
        return int(name)
    if name not in header:
        raise UsageError(f"{path}: the header row has no column {name!r} (columns: {', '.join(header)})")
    return header.index(name)
