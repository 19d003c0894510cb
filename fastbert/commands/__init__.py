"""Subcommands of the ``fastbert`` CLI, one module each (see fastbert/cli.py)."""
