"""Sentence-pair TSV reader for Sentence-BERT training.

The layout is recognized from the header row (tab-separated, no quoting, as GLUE):

* MRPC: ``Quality  #1 ID  #2 ID  #1 String  #2 String`` (label 0/1);
* STS-B: ``... sentence1  sentence2  score`` (similarity 0..5);
* NLI (SNLI / MNLI): ``... sentence1  sentence2 ... gold_label`` (entailment / neutral / contradiction);
* generic: a header naming ``sentence1`` and ``sentence2`` plus ``label`` (class names) or
  ``score`` (numbers).

``read_pairs`` returns the pairs with string labels or float scores; the caller picks the
objective (classification on labels, cosine regression on scores).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from fastbert.data.tsv import read_first_row, read_tsv
from fastbert.errors import DataError

LAYOUTS = (
    # (name, first sentence column, second, target column, target kind)
    ("mrpc", "#1 String", "#2 String", "Quality", "label"),
    ("stsb", "sentence1", "sentence2", "score", "score"),
    ("nli", "sentence1", "sentence2", "gold_label", "label"),
    ("generic", "sentence1", "sentence2", "label", "label"),
)


@dataclass
class SentencePair:
    a: str
    b: str
    target: Union[str, float]


def detect_layout(header: list[str], path: Path) -> tuple[str, int, int, int, str]:
    for name, ca, cb, ct, kind in LAYOUTS:
        if ca in header and cb in header and ct in header:
            return name, header.index(ca), header.index(cb), len(header) - 1 - header[::-1].index(ct), kind
    raise DataError(f"{path}: cannot tell the sentence-pair layout from the header ({', '.join(header)}); "
                    "expected MRPC (#1 String, #2 String, Quality), STS-B (sentence1, sentence2, score), "
                    "NLI (sentence1, sentence2, gold_label) or sentence1, sentence2, label")


def check_pairs_file(path) -> tuple[str, int, int, int, str]:
    """``detect_layout`` of ``path``'s header row, after checking the file is there (read_pairs reads and checks
    every row)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"sentence-pair file not found: {path}")
    header = read_first_row(path)
    if header is None:
        raise DataError(f"{path} needs a header row and at least one pair")
    return detect_layout(header, path)


def read_pairs(path, max_samples: Optional[int] = None) -> tuple[list[SentencePair], str, str]:
    """``(pairs, layout name, "label" | "score")``. NLI rows with gold_label "-" (no consensus) are skipped."""
    path = Path(path)
    layout, ia, ib, it, kind = check_pairs_file(path)
    rows = read_tsv(path)
    if len(rows) < 2:
        raise DataError(f"{path} needs a header row and at least one pair")
    need = max(ia, ib, it) + 1
    pairs = []
    for lineno, row in enumerate(rows[1:], start=2):
        if not row or row == [""]:
            continue
        if len(row) < need:
            raise DataError(f"{path}:{lineno}: expected at least {need} tab-separated columns, got {len(row)}")
        raw = row[it].strip()
        if kind == "score":
            try:
                target: Union[str, float] = float(raw)
            except ValueError:
                raise DataError(f"{path}:{lineno}: score {raw!r} is not a number") from None
        else:
            if layout == "nli" and raw == "-":
                continue
            if not raw:
                raise DataError(f"{path}:{lineno}: empty label")
            target = raw
        pairs.append(SentencePair(row[ia], row[ib], target))
        if max_samples is not None and len(pairs) >= max_samples:
            break
    if not pairs:
        raise DataError(f"{path} holds no sentence pairs")
    return pairs, layout, kind
