"""CoNLL-2003 NER reader (plain or ``.xz``), for both distributed variants.

One token per line, space-separated columns ``word POS chunk NER`` (only the first and last are
used, so two-column files work too); a blank line ends a sentence; ``-DOCSTART-`` lines are
document separators and are skipped. Splits are found by name: ``train.txt`` / ``valid.txt`` /
``test.txt`` (HF style, IOB2) or ``eng.train`` / ``eng.testa`` / ``eng.testb`` (the original
IOB1 release), each optionally ``.xz``-compressed.
"""
from __future__ import annotations

import lzma
from dataclasses import dataclass
from pathlib import Path

from fastbert.errors import DataError

SPLIT_NAMES = {
    "train": ("train.txt", "eng.train", "train"),
    "dev": ("valid.txt", "dev.txt", "eng.testa", "valid", "dev"),
    "test": ("test.txt", "eng.testb", "test"),
}


def split_tag(tag: str) -> tuple[str, str]:
    """``(prefix, type)`` of an IOB / IOBES tag: "B-PER" -> ("B", "PER"), "O" -> ("O", "")."""
    if tag in ("O", ""):
        return "O", ""
    prefix, sep, typ = tag.partition("-")
    if not sep or prefix not in ("B", "I", "E", "S"):
        raise ValueError(f"tag {tag!r} is not IOB/IOBES (expected O, or B-/I-/E-/S- followed by a type)")
    return prefix, typ


@dataclass
class Sentence:
    words: list[str]
    tags: list[str]


def find_split(data: Path, split: str) -> Path:
    data = Path(data)
    if not data.is_dir():
        raise DataError(f"NER data folder not found: {data} (expected a folder with CoNLL-2003 files)")
    for name in SPLIT_NAMES[split]:
        for cand in (data / name, data / f"{name}.xz"):
            if cand.is_file():
                return cand
    raise DataError(f"no {split} file in {data}: expected one of "
                    f"{', '.join(n + '[.xz]' for n in SPLIT_NAMES[split])}")


def _open(path: Path):
    return lzma.open(path, "rt", encoding="utf-8") if path.suffix == ".xz" else open(path, encoding="utf-8")


def read_conll(path: Path, max_sentences: int | None = None) -> list[Sentence]:
    path = Path(path)
    sentences: list[Sentence] = []
    words: list[str] = []
    tags: list[str] = []

    def flush():
        if words:
            sentences.append(Sentence(list(words), list(tags)))
            words.clear()
            tags.clear()

    with _open(path) as f:
        for lineno, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                flush()
            elif line.startswith("-DOCSTART-"):
                flush()
            else:
                cols = line.split()
                if len(cols) < 2:
                    raise DataError(f"{path}:{lineno}: expected 'word ... tag' columns, got {line!r}")
                try:
                    split_tag(cols[-1])
                except ValueError as e:
                    raise DataError(f"{path}:{lineno}: {e}") from None
                words.append(cols[0])
                tags.append(cols[-1])
            if max_sentences is not None and len(sentences) >= max_sentences:
                break
        flush()
    if max_sentences is not None:
        sentences = sentences[:max_sentences]
    if not sentences:
        raise DataError(f"{path} holds no sentences")
    return sentences
