"""Tab-separated task files as GLUE writes them: no quoting, an optional byte-order mark."""
from __future__ import annotations

import csv
from pathlib import Path


def _rows(f):
    return csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)


def _open(path: Path):
    return open(path, encoding="utf-8-sig", newline="")  # utf-8-sig: MRPC's files start with a byte-order mark


def read_tsv(path: Path) -> list[list[str]]:
    """The rows of a tab-separated file, each a list of its fields (no quoting, as GLUE's files)."""
    with _open(path) as f:
        return list(_rows(f))


def read_first_row(path: Path) -> list[str] | None:
    """The first row of a tab-separated file as read_tsv reads it; None when the file is empty."""
    with _open(path) as f:
        return next(_rows(f), None)


__all__ = ["read_first_row", "read_tsv"]
