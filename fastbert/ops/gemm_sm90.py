"""The FFN's GEMMs with the exact (erf) GELU in their epilogues on Hopper: ``fastbert/_gemm_sm90*.so``, built from
``csrc/gemm_sm90/gemm_gelu.cu`` (CUTLASS 3's warp-specialized sm_90a kernels) when setup.py finds nvcc and the
CUTLASS headers, called through ctypes with torch's pointers and current stream.

* :func:`bias_gelu`: ``(y, g)`` with ``y = gelu(z)`` and ``g = gelu'(z)``, ``z = x @ w.T + bias``, one kernel: the
  backward keeps GELU's derivative, not z, so erf is evaluated once, in this epilogue, for both outputs;
* :func:`dgelu`: ``dz = (d @ w2) * g`` and d(bias), dz's column sums: one kernel writing one fp32 row of
  partial sums a tile row, then ``_common.column_sums`` of those rows (a few KB; torch's sum over the rows of
  BERT-large's (128, 4,096) took 8.6 us on an H200, twenty-fourth session).

cuBLASLt's GELU epilogues are the tanh formula (ops/cublaslt.py), and a Triton 3.6 GEMM cannot hide an epilogue
behind the next tile's MMA on sm_90 (no warp specialization there): both measured in benchmarks/RESULTS.md.
Where the library is missing, the GPU is not an sm_90 one, or the operands do not fit its rules (bf16, CUDA,
contiguous, 16-byte aligned, last sizes multiples of 8), :func:`eligible` says False and ops/ffn.py keeps cuBLAS + a
Triton GELU pass. The epilogues compute in fp32, erf by Abramowitz & Stegun 7.1.26 as ops/ffn.py's ``_half_erfc``
(|error| <= 1.5e-7, far below a bf16 rounding step; libdevice's ``erff`` took twice the instructions, and the
epilogue's arithmetic is what these kernels wait on); ``tests/ops/test_gemm_sm90.py`` compares them with float64
on the card.
"""
from __future__ import annotations

import ctypes
import os
import warnings
from pathlib import Path
from typing import Optional

import torch

from fastbert.ops._common import column_sums, device_index, raw_stream

# The launch shape each function uses (the .cu file lists them); None: by the operands' shape
# (:func:`forward_variant`). The backward keeps v0 (cooperative 128 x 256 tiles, 2 x 1 clusters) everywhere. The
# up-projection takes v2 (ping-pong 128 x 128) from K = 1,024 (BERT-large's hidden size) and v0 below: inside the
# BERT-large bf16 graph step on two H200s, v2 -0.29 and -0.28 ms a step (interleaved runs), while at BERT-base's
# size v2 cost +0.33 ms a step (as `benchmarks/bench_ops.py --ops sm90` had it there: 342-350 us against v0's
# 326-335); benchmarks/RESULTS.md, nineteenth, twentieth and thirty-sixth sessions.
VARIANT: dict = {"bias_gelu": None, "dgelu": 0}
_WIDE_K = 1024  # K from which the up-projection takes v2
# FASTBERT_GEMM_SM90=0 keeps cuBLAS + the GELU passes (read at import; benchmarks compare both by setting this
# module attribute, which is read on every call).
ENABLED = os.environ.get("FASTBERT_GEMM_SM90", "") != "0"

ABI = 2  # the library's fb_sm90_abi(): what bias_gelu stores (2: gelu'(z); libraries before it stored z)
_LIB: dict = {}    # "lib" -> the loaded library or None; ("sm90", device index) -> bool; ("tile", variant) -> (m, n)


def library_path() -> Path:
    """Where the library is looked for: $FASTBERT_GEMM_SM90 if it names a file, else ``fastbert/_gemm_sm90*.so``
    (setup.py's build)."""
    env = os.environ.get("FASTBERT_GEMM_SM90", "")
    if env not in ("", "0", "1"):
        return Path(env)
    package = Path(__file__).resolve().parent.parent
    return next(iter(sorted(package.glob("_gemm_sm90*.so"))), package / "_gemm_sm90.so")


def _cached(key, make):
    """``_LIB[key]``, made once: loading, the device check and the tile shapes stay off the FFN's hot path."""
    if key not in _LIB:
        _LIB[key] = make()
    return _LIB[key]


def _load():
    """The library with its functions' signatures, or None (not built, no CUDA, or not loadable: warned)."""
    path = library_path()
    if not path.exists() or not torch.cuda.is_available():
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        warnings.warn(f"fastbert: {path} could not be loaded ({e}); the FFN keeps cuBLAS + a GELU pass", stacklevel=4)
        return None
    if not _abi_ok(lib, path):
        return None
    vp, i = ctypes.c_void_p, ctypes.c_int
    lib.fb_sm90_bias_gelu.argtypes = [vp, vp, vp, vp, vp, i, i, i, i, vp]
    lib.fb_sm90_dgelu.argtypes = [vp, vp, vp, vp, vp, i, i, i, i, vp]
    lib.fb_sm90_tile_m.argtypes = lib.fb_sm90_tile_n.argtypes = [i]
    for f in (lib.fb_sm90_bias_gelu, lib.fb_sm90_dgelu, lib.fb_sm90_variants, lib.fb_sm90_tile_m, lib.fb_sm90_tile_n):
        f.restype = i
    return lib


def _abi_ok(lib, path) -> bool:
    """Whether ``lib`` stores what this fastbert's backward reads (``ABI``); warns if not: a library built from an
    older csrc/gemm_sm90 stored z, which the backward would read as gelu'(z)."""
    abi = lib.fb_sm90_abi() if hasattr(lib, "fb_sm90_abi") else 1
    if abi != ABI:
        warnings.warn(f"fastbert: {path} was built from another version of csrc/gemm_sm90 (ABI {abi}, this fastbert "
                      f"needs {ABI}): rebuild it (pip install --no-deps --no-build-isolation -e .); until then the FFN "
                      "keeps cuBLAS + a GELU pass", stacklevel=5)
    return abi == ABI


def _lib():
    return _cached("lib", _load)


def _sm90(index: int) -> bool:
    return _cached(("sm90", index), lambda: torch.cuda.get_device_capability(index) == (9, 0))


def eligible(*tensors) -> bool:
    """Whether the library can take these operands: enabled and loaded, an sm_90 device, every tensor bf16 on it,
    contiguous, not empty, 16-byte aligned, its last size a multiple of 8 (TMA's 16-byte strides; the row count
    is free) and fewer than 2^31 elements."""
    if not ENABLED or not tensors or any(t is None for t in tensors):
        return False
    dev = tensors[0].device
    if dev.type != "cuda" or _lib() is None:
        return False
    if not _sm90(device_index(dev)):
        return False
    for t in tensors:
        if (t.device != dev or t.dtype != torch.bfloat16 or not t.is_contiguous() or t.numel() == 0
                or t.numel() >= 2**31 or t.data_ptr() % 16 or t.shape[-1] % 8):
            return False
    return True


def _check(status: int, what: str):
    if status != 0:
        raise RuntimeError(f"fastbert: the sm_90 GEMM {what} failed (status {status}: CUTLASS's Status + 1, 100 a "
                           "workspace it was not built for, 200 a launch error, -1 an unknown variant)")


def forward_variant(k: int) -> int:
    """The up-projection's launch shape for an inner size ``k``: ``VARIANT["bias_gelu"]`` when set, else v2 from
    ``_WIDE_K`` on and v0 below (measured, see ``VARIANT``)."""
    v = VARIANT["bias_gelu"]
    return v if v is not None else (2 if k >= _WIDE_K else 0)


def bias_gelu(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> tuple:
    """``(y, g)``, both ``(M, N)``: ``y = gelu(z)``, ``g = gelu'(z)`` (what :func:`dgelu` takes), ``z = x @ w.T +
    bias`` (not stored). x ``(M, K)``, w ``(N, K)``, bias ``(N,)``; call :func:`eligible` first."""
    (m, k), n = x.shape, w.shape[0]
    y = x.new_empty((m, n))
    g = torch.empty_like(y)
    _check(_lib().fb_sm90_bias_gelu(x.data_ptr(), w.data_ptr(), bias.data_ptr(), g.data_ptr(), y.data_ptr(), m, n, k,
                                    forward_variant(k), raw_stream(x.device)),
           f"bias + GELU ({m} x {k} -> {n})")
    return y, g


def dgelu(d: torch.Tensor, w2: torch.Tensor, g: torch.Tensor) -> tuple:
    """``(dz, dbias)``: ``dz = (d @ w2) * g`` ``(M, N)`` like g, g GELU's derivative as :func:`bias_gelu` stored it,
    dbias dz's fp32 column sums ``(N,)``; d ``(M, K)``, w2 ``(K, N)``; call :func:`eligible` first."""
    (m, k), n = d.shape, w2.shape[1]
    lib, v = _lib(), VARIANT["dgelu"]
    tile_m, tile_n = _cached(("tile", v), lambda: (lib.fb_sm90_tile_m(v), lib.fb_sm90_tile_n(v)))
    dz = torch.empty_like(g)
    partial = torch.empty((-(-m // tile_m), -(-n // tile_n) * tile_n), dtype=torch.float32, device=d.device)
    _check(lib.fb_sm90_dgelu(d.data_ptr(), w2.data_ptr(), g.data_ptr(), dz.data_ptr(), partial.data_ptr(), m, n, k, v,
                             raw_stream(d.device)),
           f"GELU derivative ({m} x {k} -> {n})")
    return dz, column_sums(partial)[:n]


def variants() -> int:
    """How many launch shapes the library offers (0 without it)."""
    lib = _lib()
    return lib.fb_sm90_variants() if lib is not None else 0


def ready() -> Optional[str]:
    """None when the library is enabled, loaded and the current device is an sm_90 one, else why not (for logs)."""
    if not ENABLED:
        return "FASTBERT_GEMM_SM90=0"
    if _lib() is None:
        return f"{library_path()} not built or not loadable (setup.py builds it with nvcc and CUTLASS's headers)"
    if not _sm90(torch.cuda.current_device()):
        return f"the GPU is sm_{''.join(map(str, torch.cuda.get_device_capability()))}, the kernels are sm_90a"
    return None
