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


def not_utf8(exc: UnicodeDecodeError) -> str:
    """What went wrong and the fix, for a streamed file that is not UTF-8 (``exc.start`` counts from the
    start of the block being decoded, not of the file)."""
    return (f"not UTF-8 text ({exc.reason} at byte {exc.start} of a block); convert it to UTF-8 "
            "(e.g. iconv -f latin1 -t utf-8)")


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
