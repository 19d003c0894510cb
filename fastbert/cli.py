"""The ``fastbert`` command. Each subcommand lives in ``fastbert/commands/<name>.py`` and defines
``add_parser(subparsers)`` and ``run(args) -> int``."""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


class UsageError(Exception):
    """Bad input from the command line: printed as one ``error:`` line, exit status 2."""


def _command_modules():
    import fastbert.commands as pkg
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            yield importlib.import_module(f"fastbert.commands.{info.name}")


def build_parser() -> argparse.ArgumentParser:
    from fastbert import __version__
    parser = argparse.ArgumentParser(prog="fastbert", description="Fast BERT pretraining and fine-tuning.")
    parser.add_argument("--version", action="version", version=f"fastbert {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _command_modules():
        before = set(sub.choices)
        module.add_parser(sub)
        for name in set(sub.choices) - before:
            sub.choices[name].set_defaults(run=module.run)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except UsageError as e:
        print(f"fastbert {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"fastbert {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"fastbert {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
