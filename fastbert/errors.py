"""The errors fastbert raises across layers, at the bottom of the import graph so that any module may
raise them: library code raises ``UsageError`` / ``DataError`` / ``ConfigError`` and the ``fastbert``
command (``fastbert/cli.py``) turns them into one ``error:`` line and an exit status."""
from __future__ import annotations


class UsageError(Exception):
    """Bad input from the command line: printed as one ``error:`` line, exit status 2."""


class DataError(ValueError):
    """Malformed task data; the message names the file, the line and what was expected."""


class ConfigError(ValueError):
    """An invalid config value; the message says which field and how to fix it."""


__all__ = ["UsageError", "DataError", "ConfigError"]
