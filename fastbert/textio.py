"""Open plain, xz- or gzip-compressed text files by extension, with clear errors for bad input."""
from __future__ import annotations

import gzip
import lzma
import os
from pathlib import Path


def open_text(path: str | os.PathLike, errors: str = "strict"):
    """Open ``path`` for reading UTF-8 text, decompressing ``.xz`` / ``.gz``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input file not found: {path}")
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8", errors=errors)
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors=errors)
    return open(path, "rt", encoding="utf-8", errors=errors)
