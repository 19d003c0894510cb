"""DeepSpeed's just-in-time built CPU op: where it is cached, building it ahead of time, and saying so
before a run has to build it.

Without CUDA, ``deepspeed.init_distributed`` compiles ``deepspeed_shm_comm`` (shared-memory
collectives) the first time it runs, ~1 minute with no output of its own. ``scripts/install.sh``
builds it into the checkout's ``.torch_extensions/`` (``python -m fastbert.training.ds_ops --build``);
commands run from that checkout use that cache unless ``TORCH_EXTENSIONS_DIR`` says otherwise, and
announce the build when it has not happened yet.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

OP = "deepspeed_shm_comm"
CHECKOUT = Path(__file__).resolve().parents[2]


def extensions_dir() -> Path:
    """Where torch's JIT builds go: TORCH_EXTENSIONS_DIR, else the checkout's .torch_extensions when the
    install made one (then TORCH_EXTENSIONS_DIR is set to it, for DeepSpeed), else torch's default."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        local = CHECKOUT / ".torch_extensions"
        if local.is_dir() and (CHECKOUT / "setup.py").is_file():
            os.environ["TORCH_EXTENSIONS_DIR"] = str(local)
    from torch.utils.cpp_extension import _get_build_directory
    return Path(_get_build_directory(OP, verbose=False)).parent


def is_built() -> bool:
    return (extensions_dir() / OP / f"{OP}.so").is_file()


def announce_cpu_build(log) -> None:
    """Before DeepSpeed initialises on the CPU: point it at the prebuilt op, or say that it builds now."""
    if not is_built():
        log(f"[fastbert] building DeepSpeed's CPU communication op ({OP}) into {extensions_dir()} "
            "(one-time, ~1 min; scripts/install.sh does it ahead of time)")


def build() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    extensions_dir()
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    ShareMemCommBuilder().load(verbose=False)


if __name__ == "__main__":
    if sys.argv[1:] != ["--build"]:
        print("usage: python -m fastbert.training.ds_ops --build", file=sys.stderr)
        sys.exit(2)
    build()
    sys.exit(0 if is_built() else 1)
