"""Open plain, xz- or gzip-compressed text files by extension, with clear errors for bad input."""
from __future__ import annotations

import gzip
import lzma
import os
from pathlib import Path

# What reading a damaged or non-text input raises, by format.
READ_ERRORS = (lzma.LZMAError, EOFError, gzip.BadGzipFile, UnicodeDecodeError)


def unreadable(path, exc: BaseException) -> ValueError:
    """The one clear error for an input that cannot be read as text."""
    kind = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else "a corrupt or truncated compressed file"
    return ValueError(f"cannot read {path}: {kind} ({type(exc).__name__}: {exc}); pass UTF-8 .txt, .xz or .gz files")


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
