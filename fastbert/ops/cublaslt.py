"""cuBLASLt GEMMs with GELU epilogues or an added matrix, called through ctypes on the libcublasLt that
torch loaded.

torch reaches cuBLASLt's GELU epilogue only without its auxiliary output (``torch._addmm_activation``),
which a training step cannot use: the backward needs the pre-activation; and its ``addmm`` copies the
added matrix into the output before the GEMM (a pass over it). :func:`gemm` computes ``D = a @ b``
(row-major views, 16-bit) with one of these epilogues:

====================  =======================================================================
``"default"``         D [+ c] (c read by the GEMM, not copied first)
``"gelu[_bias]"``     gelu(D [+ bias]) (bias: one value per column of D)
``"gelu_aux[_bias]"`` gelu(D [+ bias]), and the pre-activation written to ``aux``
``"dgelu"``           D * gelu'(aux)
====================  =======================================================================

:func:`scaled_addmm` is the FP8 GEMM ``torch._scaled_mm`` runs (per-tensor scales, fp32 accumulation) with an
added 16-bit matrix, which ``_scaled_mm`` does not take: the FP8 linears' input gradient plus the residual's
(ops/fp8.py).

cuBLASLt's GELU is the tanh approximation (torch's ``F.gelu(approximate="tanh")``, HF's
``gelu_pytorch_tanh``), so only models with that activation take these paths (ops/ffn.py).

cuBLASLt is column-major. A row-major ``(r, c)`` matrix is a column-major ``(c, r)`` one, so
``D = a @ b`` is ``Dᵀ = bᵀ aᵀ`` there: cuBLASLt's A is ``b`` and its B is ``a``. :func:`plan` holds that
mapping and is plain Python (``tests/ops/test_cublaslt.py`` checks it on the CPU against an emulation
of cuBLASLt's semantics); :func:`gemm` runs a plan. Descriptors and the heuristic's algorithm are made
once per shape, layout and alignment and kept, so a step pays only the attribute updates and the
launch, and a CUDA graph captures the launch like any cuBLAS call. When cuBLASLt is missing or has no
algorithm for a problem, :func:`eligible` / :func:`gemm` say so (False / None) and the caller keeps its
own path.

Measured on an H100 (cuBLAS 13, benchmarks/RESULTS.md, sixth session), and why only these epilogues:
``"default"`` with ``c`` saves torch.addmm's copy of c (22 us per (16K, 1024) bf16 matrix);
both GELU epilogues are fused into the GEMM's kernel (+~45 us over the plain GEMM at 16K x 1024 -> 4096,
against ~95 us for GELU as its own pass forward and ~165 us backward); the bias-gradient epilogues
(DGELU_BGRAD, BGRADB) run as a separate reduction kernel, 0.6 ms for DGELU_BGRAD there, no faster than
torch's own sum; and timing the heuristic's other candidates per shape won nothing in the training step.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import warnings
from typing import NamedTuple, Optional

import torch

from fastbert.ops._common import raw_stream

# cublasLtEpilogue_t values
EPILOGUES = {"default": 1, "gelu": 32, "gelu_bias": 36, "gelu_aux": 160, "gelu_aux_bias": 164, "dgelu": 192}
_HAS_BIAS = ("gelu_bias", "gelu_aux_bias")
_HAS_AUX = ("gelu_aux", "gelu_aux_bias", "dgelu")
_CUDA_TYPES = {torch.float16: 2, torch.bfloat16: 14}  # cudaDataType_t
_FP8_TYPES = {torch.float8_e4m3fn: 28, torch.float8_e5m2: 29}
_COMPUTE_32F, _R_32F = 68, 0                            # cublasComputeType_t, cudaDataType_t
_TYPES = {**_CUDA_TYPES, **_FP8_TYPES, torch.float32: _R_32F}
# cublasLtMatmulDescAttributes_t, cublasLtMatmulPreferenceAttributes_t
_TRANSA, _TRANSB, _EPILOGUE, _BIAS_POINTER, _AUX_POINTER, _AUX_LD = 3, 4, 7, 8, 11, 12
_A_SCALE_POINTER, _B_SCALE_POINTER = 17, 18
_PREF_WORKSPACE, _PREF_ALIGN = 1, (5, 6, 7, 8)          # max workspace; min alignment of A, B, C, D
_WORKSPACE = 32 * 2**20


class _Problem(NamedTuple):
    desc: object      # cublasLtMatmulDesc_t
    layouts: list     # A, B, D (C has D's)
    algo: object      # the heuristic's first choice (a _Heuristic)


class Plan(NamedTuple):
    """cuBLASLt's column-major problem ``D (m, n) = op(A) (m, k) @ op(B) (k, n)`` for a row-major
    ``D (M, N) = a (M, K) @ b (K, N)``: m = N, n = M, k = K; A is ``b``, B is ``a``."""
    m: int
    n: int
    k: int
    trans_a: bool
    lda: int
    trans_b: bool
    ldb: int
    ldd: int


def _stored(t: torch.Tensor):
    """(transposed, ld) of a 2-D row-major view as cuBLASLt sees its memory: a row-contiguous view is
    stored as its transpose (no op needed to get the transpose); a column-contiguous one (``w.t()``) as
    itself. None for any other layout."""
    rows, cols = t.shape
    if t.stride(1) == 1 and t.stride(0) >= max(cols, 1):
        return False, t.stride(0)
    if t.stride(0) == 1 and t.stride(1) >= max(rows, 1):
        return True, t.stride(1)
    return None


def plan(a: torch.Tensor, b: torch.Tensor) -> Optional[Plan]:
    """The plan for ``a @ b`` (2-D views, each row- or column-contiguous), D row-major contiguous; None
    when a layout does not map."""
    sa, sb = _stored(a), _stored(b)
    if sa is None or sb is None or a.shape[1] != b.shape[0]:
        return None
    (m_rows, k), n = a.shape, b.shape[1]
    # op(A) = bᵀ (n_cols x k): b's memory is bᵀ already unless b is a column-contiguous view.
    # op(B) = aᵀ (k x m_rows): likewise.
    return Plan(m=n, n=m_rows, k=k, trans_a=sb[0], lda=sb[1], trans_b=sa[0], ldb=sa[1], ldd=n)


# ------------------------------------------------------------------------------------------ the library
class _Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _library_path() -> Optional[str]:
    """The libcublasLt torch loaded (one copy in the process), else one beside torch's CUDA wheels."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if "libcublasLt.so" in os.path.basename(path):
                    return path
    except OSError:
        pass
    site = os.path.dirname(os.path.dirname(torch.__file__))
    hits = sorted(glob.glob(os.path.join(site, "nvidia", "**", "libcublasLt.so*"), recursive=True))
    return hits[-1] if hits else ctypes.util.find_library("cublasLt")


class _Lt:
    """The loaded library, one handle, and the per-problem descriptors (kept for the process)."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        sigs = {
            "cublasLtCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i, i],
            "cublasLtMatmulDescSetAttribute": [vp, i, vp, sz],
            "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i, vp, sz],
            "cublasLtMatmulPreferenceDestroy": [vp],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i, ctypes.POINTER(_Heuristic),
                                               ctypes.POINTER(i)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
        }
        for name, args in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, i
        self.lib = lib
        self.handle = vp()
        self._check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.problems: dict = {}  # key -> _Problem, or None (no algorithm)
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _check(status: int, what: str):
        if status != 0:
            raise RuntimeError(f"cuBLASLt: {what} returned status {status}")

    def _set(self, setter, obj, attr: int, value):
        self._check(setter(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"attribute {attr}")

    def problem(self, key, p: Plan, types: tuple, epilogue: str, ptrs: dict):
        """The :class:`_Problem` for ``key``, made on first sight; None when cuBLASLt offers no algorithm.
        ``types``: the cudaDataType_t of cuBLASLt's A (``b``), B (``a``) and C / D."""
        if key in self.problems:
            return self.problems[key]
        lib, vp = self.lib, ctypes.c_void_p
        desc = vp()
        self._check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "MatmulDescCreate")
        setd = lib.cublasLtMatmulDescSetAttribute
        self._set(setd, desc, _TRANSA, ctypes.c_int(int(p.trans_a)))
        self._set(setd, desc, _TRANSB, ctypes.c_int(int(p.trans_b)))
        self._set(setd, desc, _EPILOGUE, ctypes.c_uint32(EPILOGUES[epilogue]))
        if epilogue in _HAS_AUX:
            self._set(setd, desc, _AUX_LD, ctypes.c_int64(p.ldd))
        self.pointers(desc, epilogue, ptrs)  # the heuristic reads their alignment
        layouts = []
        for cuda_t, (rows, cols, ld) in zip(types, ((p.k, p.m, p.lda) if p.trans_a else (p.m, p.k, p.lda),
                                                    (p.n, p.k, p.ldb) if p.trans_b else (p.k, p.n, p.ldb),
                                                    (p.m, p.n, p.ldd))):
            layout = vp()
            self._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), cuda_t, rows, cols, ld), "LayoutCreate")
            layouts.append(layout)
        pref = vp()
        self._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        setp = lib.cublasLtMatmulPreferenceSetAttribute
        self._set(setp, pref, _PREF_WORKSPACE, ctypes.c_uint64(_WORKSPACE))
        for attr, name in zip(_PREF_ALIGN, ("b", "a", "c", "d")):  # cuBLASLt's A is b, its B is a
            self._set(setp, pref, attr, ctypes.c_uint32(_alignment(ptrs[name])))
        result, count = _Heuristic(), ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, layouts[0], layouts[1], layouts[2],
                                                    layouts[2], pref, 1, ctypes.byref(result), ctypes.byref(count))
        lib.cublasLtMatmulPreferenceDestroy(pref)
        ok = status == 0 and count.value > 0 and result.state == 0
        self.problems[key] = _Problem(desc, layouts, result) if ok else None
        return self.problems[key]

    def pointers(self, desc, epilogue: str, ptrs: dict):
        setd = self.lib.cublasLtMatmulDescSetAttribute
        if epilogue in _HAS_BIAS:
            self._set(setd, desc, _BIAS_POINTER, ctypes.c_void_p(ptrs["bias"]))
        if epilogue in _HAS_AUX:
            self._set(setd, desc, _AUX_POINTER, ctypes.c_void_p(ptrs["aux"]))
        if ptrs.get("scale_a"):  # FP8: cuBLASLt's A is b, its B is a
            self._set(setd, desc, _A_SCALE_POINTER, ctypes.c_void_p(ptrs["scale_b"]))
            self._set(setd, desc, _B_SCALE_POINTER, ctypes.c_void_p(ptrs["scale_a"]))


def _alignment(ptr: int) -> int:
    """The largest power of two (<= 256) dividing ``ptr``."""
    return min(256, ptr & -ptr) if ptr else 256


_LT: dict = {}  # "lt" -> _Lt, or None when cuBLASLt cannot be loaded


def _lt() -> Optional[_Lt]:
    if "lt" not in _LT:
        _LT["lt"] = None
        if torch.cuda.is_available() and torch.version.cuda is not None:
            torch.cuda.init()
            path = _library_path()
            try:
                _LT["lt"] = _Lt(path) if path else None
            except (OSError, AttributeError, RuntimeError) as e:
                warnings.warn(f"fastbert: cuBLASLt ({path}) could not be loaded ({e}); the GEMM epilogues fall "
                              "back to separate kernels", stacklevel=3)
    return _LT["lt"]


def eligible(*tensors, sizes=()) -> bool:
    """Whether :func:`gemm` can take these operands (None entries are skipped): CUDA, not empty, all float16
    or all bfloat16, each last size and each of ``sizes`` a multiple of 8, 2-D views row- or column-contiguous
    with a leading stride that is a multiple of 8, pointers 16-byte aligned (cuBLASLt's epilogue rules),
    and cuBLASLt loadable."""
    live = [t for t in tensors if t is not None]
    if not live or not all(t.is_cuda for t in live) or live[0].dtype not in _CUDA_TYPES:
        return False
    for t in live:
        if t.dtype != live[0].dtype or t.numel() == 0 or t.data_ptr() % 16 or t.dim() not in (1, 2) or t.shape[-1] % 8:
            return False
        stored = _stored(t) if t.dim() == 2 else (False, 8)
        if stored is None or stored[1] % 8:
            return False
    if any(s % 8 for s in sizes):
        return False
    return _lt() is not None


def gemm(a: torch.Tensor, b: torch.Tensor, epilogue: str, *, bias=None, aux=None, c=None,
         out=None) -> Optional[torch.Tensor]:
    """``D = a @ b`` with ``epilogue`` (see the module's table) into ``out`` (a new ``(M, N)`` tensor when
    None). ``bias``: ``(N,)``; ``aux``: ``(M, N)`` contiguous, written by ``gelu_aux*``, read by ``dgelu``;
    ``c``: ``(M, N)`` contiguous, added (``"default"`` only).
    Returns None, having done nothing, when cuBLASLt has no algorithm for the problem (call
    :func:`eligible` first for the rest)."""
    p = plan(a, b)
    if p is None:
        raise ValueError(f"cublaslt.gemm: a {tuple(a.shape)} / {a.stride()} and b {tuple(b.shape)} / {b.stride()} "
                         "must be row- or column-contiguous 2-D views with a.shape[1] == b.shape[0]")
    if out is None:
        out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    if c is not None and (epilogue != "default" or c.shape != out.shape or not c.is_contiguous()):
        raise ValueError(f"cublaslt.gemm: c must be a contiguous {tuple(out.shape)} tensor, with the default epilogue")
    return _run(p, a, b, epilogue, c, out, {"bias": bias.data_ptr() if bias is not None else 0,
                                            "aux": aux.data_ptr() if aux is not None else 0})


def _run(p: Plan, a, b, epilogue: str, c, out, extra: dict) -> Optional[torch.Tensor]:
    """Run plan ``p`` (``out = a @ b`` [+ c], ``extra``: the epilogue's and scales' pointers); None when cuBLASLt
    has no algorithm."""
    ptrs = {"a": a.data_ptr(), "b": b.data_ptr(), "d": out.data_ptr(),
            "c": (c if c is not None else out).data_ptr(), **extra}
    types = tuple(_TYPES[t.dtype] for t in (b, a, out))
    lt = _lt()
    key = (types, a.device.index, p, epilogue, c is not None) + tuple(_alignment(v) for v in ptrs.values())
    entry = lt.problem(key, p, types, epilogue, ptrs)
    if entry is None:
        return None
    lt.pointers(entry.desc, epilogue, ptrs)
    ws = int(entry.algo.workspace_size)
    workspace = torch.empty(ws, dtype=torch.uint8, device=a.device) if ws else None
    status = lt.lib.cublasLtMatmul(
        lt.handle, entry.desc, ctypes.byref(lt.one), ptrs["b"], entry.layouts[0], ptrs["a"], entry.layouts[1],
        ctypes.byref(lt.one if c is not None else lt.zero), ptrs["c"], entry.layouts[2], ptrs["d"], entry.layouts[2],
        ctypes.byref(entry.algo.algo),
        workspace.data_ptr() if workspace is not None else None, ws, raw_stream(a.device))
    lt._check(status, f"cublasLtMatmul ({epilogue}, {p})")
    return out


def addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``c + a @ b`` as a new tensor: cuBLASLt reads ``c`` in the GEMM's epilogue where it can take the
    operands; elsewhere ``torch.addmm`` (which copies c into the output before its GEMM)."""
    out = gemm(a, b, "default", c=c) if eligible(a, b, c) and c.is_contiguous() else None
    return out if out is not None else torch.addmm(c, a, b)


def _fp8_plan(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, scale_a: torch.Tensor,
              scale_b: torch.Tensor) -> Optional[Plan]:
    """The plan of an FP8 GEMM ``(scale_a a) @ (scale_b b)`` adding ``c`` where cuBLASLt takes it: ``a`` row-major
    and ``b`` a column-major view (both K-major, cuBLASLt's "TN"), not both e5m2, one-element fp32 scales, sizes
    multiples of 16, ``c`` contiguous of the product's shape, pointers 16-byte aligned. None otherwise (c's dtype
    is the caller's rule)."""
    live = (a, b, c, scale_a, scale_b)
    if (not all(t.is_cuda for t in live) or a.dtype not in _FP8_TYPES or b.dtype not in _FP8_TYPES
            or a.dtype == b.dtype == torch.float8_e5m2 or not c.is_contiguous()
            or any(t.dtype != torch.float32 or t.numel() != 1 for t in (scale_a, scale_b))
            or any(t.data_ptr() % 16 for t in (a, b, c)) or any(d % 16 for d in (*a.shape, b.shape[1]))
            or c.shape != (a.shape[0], b.shape[1]) or _lt() is None):
        return None
    p = plan(a, b)
    return p if p is not None and p.trans_a and not p.trans_b else None


def scaled_addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                 scale_b: torch.Tensor) -> Optional[torch.Tensor]:
    """``c + (scale_a a) @ (scale_b b)`` for FP8 ``a`` (row-major) and ``b`` (a column-major view, as
    ``torch._scaled_mm`` takes them), ``c`` 16-bit and contiguous, fp32 accumulation, the result in c's dtype:
    ``torch._scaled_mm(a, b, scale_a=..., scale_b=..., out_dtype=c.dtype) + c`` with the addition done by the
    GEMM (one rounding, no pass of its own). ``scale_a`` / ``scale_b``: one-element fp32 device tensors (read by
    the GEMM: a CUDA graph replays them). None, having done nothing, where cuBLASLt cannot: the caller adds."""
    p = _fp8_plan(a, b, c, scale_a, scale_b) if c.dtype in _CUDA_TYPES else None
    if p is None:
        return None
    out = torch.empty_like(c)
    return _run(p, a, b, "default", c, out, {"scale_a": scale_a.data_ptr(), "scale_b": scale_b.data_ptr()})


def accumulate(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale_a: Optional[torch.Tensor] = None,
               scale_b: Optional[torch.Tensor] = None) -> bool:
    """``c += a @ b`` in place inside the GEMM (beta = 1: cuBLASLt reads ``c`` in its epilogue and writes the sum
    back into it, C and D one matrix): a weight gradient added into its fp32 accumulator with no pass of its own
    (``ops/grad_accum.py``). ``a``, ``b``: 16-bit, one dtype; or FP8 with their one-element fp32 scales (``a``
    row-major, ``b`` a column-major view, as ``torch._scaled_mm`` takes them). ``c``: fp32, contiguous, ``(M,
    N)``. False, having done nothing, where cuBLASLt cannot: the caller adds."""
    if c.dtype != torch.float32:
        return False
    if scale_a is not None:
        p = _fp8_plan(a, b, c, scale_a, scale_b)
    elif c.is_cuda and c.is_contiguous() and not c.data_ptr() % 16 and c.shape == (a.shape[0], b.shape[1]) \
            and eligible(a, b):
        p = plan(a, b)
    else:
        return False
    scales = {"scale_a": scale_a.data_ptr(), "scale_b": scale_b.data_ptr()} if scale_a is not None else {}
    return p is not None and _run(p, a, b, "default", c, c, scales) is not None
