"""The errors fastbert raises across layers, at the bottom of the import graph so that any module may
raise them: library code raises ``UsageError`` / ``DataError`` / ``ConfigError`` and the ``fastbert``
command (``fastbert/cli.py``) turns them into one ``error:`` line and an exit status. ``not_a_checkpoint_hint``
adds to a message about a folder that is not an HF checkpoint where the checkpoint inside it is."""
from __future__ import annotations

from pathlib import Path


class UsageError(Exception):
    """Bad input from the command line: printed as one ``error:`` line, exit status 2."""


class DataError(ValueError):
    """Malformed task data; the message names the file, the line and what was expected."""


class ConfigError(ValueError):
    """An invalid config value; the message says which field and how to fix it."""


def not_a_checkpoint_hint(directory) -> str:
    """For a folder that is not an HF checkpoint: where the checkpoint inside it is, if it holds one
    (a ``fastbert pretrain`` output folder keeps its export in ``hf/``), else ''."""
    d = Path(directory)
    for sub in ("hf", "model"):
        if (d / sub / "config.json").is_file() and (d / sub / "vocab.txt").is_file():
            return f" ({d} looks like a training output folder: its HF checkpoint is {d / sub}, use --model {d / sub})"
    return ""


__all__ = ["UsageError", "DataError", "ConfigError", "not_a_checkpoint_hint"]
