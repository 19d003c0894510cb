"""Deterministic mode (``--deterministic`` / ``train.deterministic``): same seed, same hardware, same
rank count -> a bit-identical loss curve.

What it sets, before any CUDA work:

* ``torch.use_deterministic_algorithms(True)``: torch ops with a deterministic variant use it and
  the rest raise instead of silently varying; cuDNN deterministic, no cuDNN benchmark autotuning.
* ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: what cuBLAS needs for reproducible GEMMs (CUDA >= 10.2).
* ``TRITON_CACHE_AUTOTUNING=1``: Triton autotuning picks a kernel config by timing, which can differ
  from run to run (and with it the reduction order); with the cache the first run's choice is
  stored and every later run on this machine reuses it.
* The fused embedding backward scatter-adds with atomics (float sums in arrival order). The op
  table routes that op to the reference (``F.embedding``'s backward: a sorted segment reduction)
  while deterministic algorithms are enabled; ``check_ops`` reports whether the table in use does.

Unaffected and already deterministic: the data order, masking and dropout RNGs (seeded per rank),
the other Triton kernels (no atomics; LayerNorm partial sums are reduced in a fixed order, the MLM
loss's row kernel reduces each row in one program), and NCCL/gloo reductions for a fixed rank count
and topology.
"""
from __future__ import annotations

import os

import torch


def enable() -> dict:
    """Switch the process to deterministic algorithms; returns what was set (for the manifest)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ["TRITON_CACHE_AUTOTUNING"] = "1"
    torch.use_deterministic_algorithms(True)
    # A debugging aid that use_deterministic_algorithms switches on: it fills every torch.empty with
    # NaN (bandwidth spent on every allocation, e.g. DeepSpeed's flat gradient buffers, for no
    # determinism gain when no op reads uninitialized memory).
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return {"use_deterministic_algorithms": True, "fill_uninitialized_memory": False,
            "CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"],
            "TRITON_CACHE_AUTOTUNING": "1", "cudnn.deterministic": True, "cudnn.benchmark": False}


def check_ops(kernels: str) -> list[str]:
    """Ops of the ``kernels`` table that are not run-to-run deterministic right now (empty = all are)."""
    if kernels != "triton":
        return []
    from fastbert.ops import get_ops
    from fastbert.ops.embeddings import bert_embeddings_ref
    ops = get_ops("triton")
    problems = []
    if ops.embeddings is not bert_embeddings_ref:
        problems.append("embeddings (the fused backward accumulates with atomics)")
    return problems
