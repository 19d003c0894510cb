"""Package names that load on first use (PEP 562): a package lists where each public name lives and gets the
module-level ``__getattr__`` and ``__dir__`` that import it when it is first read. ``import fastbert`` and the
``fastbert`` command's help and usage errors so stay free of torch."""
from __future__ import annotations

import importlib
import sys


def lazy_names(package: str, where: dict[str, str]):
    """``(__getattr__, __dir__)`` for ``package``, whose names ``where`` maps to the modules defining them."""
    namespace = vars(sys.modules[package])

    def __getattr__(name):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__():
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
