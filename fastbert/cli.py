"""The ``fastbert`` command. Each subcommand lives in ``fastbert/commands/<name>.py`` and defines
``add_parser(subparsers)`` and ``run(args) -> int``."""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

from fastbert.errors import UsageError


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


def _strip_launcher_local_rank(argv: list[str]) -> list[str]:
    """The ``deepspeed`` launcher passes ``--local_rank=N`` before the subcommand; move it to the
    environment (where torchrun puts it) so ``deepspeed --module fastbert.cli pretrain ...`` works."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in ("--local_rank", "--local-rank"):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "0")
            os.environ.setdefault("LOCAL_RANK", value)
            i += 1 if "=" in arg else 2
            continue
        out.append(arg)
        i += 1
    return out


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(_strip_launcher_local_rank(list(sys.argv[1:] if argv is None else argv)))
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
    except KeyboardInterrupt as e:
        from fastbert.training.interrupt import Terminated
        terminated = isinstance(e, Terminated)       # SIGTERM, where a command turned it into an exception
        print(f"fastbert {args.command}: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 143 if terminated else 130


if __name__ == "__main__":
    sys.exit(main())
