"""Tab-separated task files as GLUE writes them: no quoting, an optional byte-order mark."""
from __future__ import annotations

import csv
from pathlib import Path


def read_tsv(path: Path) -> list[list[str]]:
    """The rows of a tab-separated file, each a list of its fields (no quoting, as GLUE's files)."""
    # utf-8-sig: MRPC's files start with a byte-order mark.
    with open(path, encoding="utf-8-sig", newline="") as f:
        return [row for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]


__all__ = ["read_tsv"]
