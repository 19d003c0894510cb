"""FP8 linear layers with per-tensor delayed scaling (``BertConfig.fp8``, ``train.precision=fp8``).

``fp8_linear(x, weight, bias, history, rows)`` is ``F.linear`` with its three GEMMs in FP8 through
``torch._scaled_mm``: forward ``x @ W^T`` in e4m3 x e4m3, the input gradient ``dy @ W`` and the weight
gradient ``dy^T @ x`` with ``dy`` in e5m2 (more range, the gradients' need). Accumulation is fp32;
results come out in the input's dtype (bf16 under autocast), the weight gradient in the weight's.

Delayed scaling (Transformer Engine's recipe): every tensor that is cast (each linear's input,
weight and output gradient) has a row of ``AmaxHistory``: the largest finite ``|value|`` seen in each
of the last ``HISTORY`` training forwards. A cast scales by ``fp8_max / max(row)`` taken over the
previous forwards only, and records its own amax into the current slot in the same pass, so scaling
needs nothing from the host and a step can be replayed from a CUDA graph. The first cast of a row
(no history yet: a host flag, so never inside a capture) first measures its tensor (just-in-time
scaling, once). ``AmaxHistory.advance`` starts a new slot; the encoder calls it at every training
forward. Non-finite values are left out of the amax: a step the guard skips for an inf does not
poison the next ``HISTORY`` steps' scales.

``_scaled_mm`` takes its second operand column-major, so each cast also writes the transpose the
backward needs (``x^T`` for the weight gradient, ``W^T`` for the input gradient, ``dy^T``); the
saved activation is the 1-byte transposed copy, not the 16-bit input. GEMM dimensions must be
multiples of 16; a call whose shapes are not (a padded batch's odd token count) runs ``F.linear``.

The casts are a Triton kernel on CUDA (one pass: scale from the history, cast, transpose, amax; each program
walks its tiles in a software-pipelined loop, the next tile's loads in flight while this one is cast) and
the plain-PyTorch reference ``cast_fp8_ref`` elsewhere; on the CPU the GEMMs multiply the FP8 values in float32
(``_mm8``), which is what the CPU tests use (the kernel itself is tested against the reference in the interpreter).
The kernel reads its source once, weights included (fp32 masters), and moves the transpose between threads
as a uint8 tile (the GELU cast: as 32-bit words of four fp8 codes); the GELU casts, which issue about as many
instructions as their bytes take to move, use a one-polynomial erf (``ffn._half_erfc``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastbert.ops import cublaslt, grad_accum, weight_casts
from fastbert.ops._common import (
    HAS_TRITON, INTERPRET, autocast_dtype, cdiv, column_sums, fast_launch, num_sms, tl, triton)
from fastbert.ops.ffn import gelu, gelu_grad, gelu_grad_ref

HISTORY = 16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
ALIGN = 16  # _scaled_mm: every GEMM dimension a multiple of 16


class AmaxHistory:
    """The amax rows of every cast of one model (``rows x HISTORY`` fp32 on the device; the model numbers
    the rows) and the slot counter. ``primed`` holds the rows whose first cast has run."""

    def __init__(self, n_rows: int, device):
        self.amax = torch.zeros((n_rows, HISTORY), dtype=torch.float32, device=device)
        self.step = torch.zeros((1,), dtype=torch.int64, device=device)
        self.primed: set[int] = set()

    def advance(self) -> None:
        """Open the next slot: zero it for every row (device ops only)."""
        self.step.add_(1)
        self.amax.index_fill_(1, torch.remainder(self.step, HISTORY), 0.0)

    def prime(self, row: int, x: torch.Tensor) -> None:
        """First cast of ``row`` (the caller checks ``primed``): record ``x``'s amax as the previous slot's,
        so it scales by its own."""
        prev = torch.remainder(self.step - 1, HISTORY)
        self.amax[row].index_copy_(0, prev, finite_amax(x).view(1))
        self.primed.add(row)


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    a = x.detach().abs().float()
    return torch.where(torch.isfinite(a), a, 0.0).amax()


def pre_op_ref(x: torch.Tensor, gelu: str | None, z: torch.Tensor | None) -> torch.Tensor:
    """What a cast casts, in fp32: ``x``, ``gelu(x)`` (``gelu`` set, no ``z``: the FFN's activation) or
    ``x * gelu'(z)`` (``gelu`` and ``z``: the activation's backward)."""
    if gelu is None:
        return x.float()
    if z is None:
        return F.gelu(x.float(), approximate=gelu)
    return x.float() * gelu_grad_ref(z, gelu)


def cast_fp8_ref(x: torch.Tensor, history: AmaxHistory, row: int, dtype: torch.dtype):
    """Reference cast of a 2-D ``x``: ``(x8, x8 transposed and contiguous, scale_inv)``; records
    ``x``'s amax in the current slot of ``row``. ``x8 * scale_inv`` approximates ``x``. The scale is
    ``fp8_max / max`` of the row's previous slots in IEEE division, as the kernel's ``div_rn`` (torch's
    ``float / tensor`` multiplies by the reciprocal: up to 1 ulp off)."""
    fmax = FP8_MAX[dtype]
    cur = torch.remainder(history.step, HISTORY)
    hist = history.amax[row]
    prev = torch.where(torch.arange(HISTORY, device=hist.device) == cur, 0.0, hist).amax()
    scale = torch.where(prev > 0, torch.full_like(prev, fmax) / prev, torch.ones_like(prev))
    x8 = (x.float() * scale).clamp(-fmax, fmax).to(dtype)
    hist.scatter_reduce_(0, cur, finite_amax(x).view(1), reduce="amax")
    return x8, x8.t().contiguous(), (1.0 / scale).reshape(())


# ============================================================================= Triton kernel
@triton.jit
def _pre_op(X, Z, r, c, mask, stride_xm, stride_zm, PRE: tl.constexpr, APPROX_TANH: tl.constexpr, ERF: tl.constexpr):
    """What the cast casts at rows ``r`` x columns ``c`` (broadcast index tensors), in fp32: ``pre_op_ref``, with
    the exact GELU's erf from ``ffn._half_erfc`` (ERF 1 or 2: 1.5e-7 from libdevice's, far below fp8's rounding)."""
    x = tl.load(X + r * stride_xm + c, mask=mask, other=0.0).to(tl.float32)
    if PRE == 1:
        x = gelu(x, APPROX_TANH, ERF)
    elif PRE == 2:
        z = tl.load(Z + r * stride_zm + c, mask=mask, other=0.0).to(tl.float32)
        x = x * gelu_grad(z, APPROX_TANH, ERF)
    return x


@triton.jit
def _fp8_codes(v, FP8_MAX: tl.constexpr, E5M2: tl.constexpr, HW: tl.constexpr):
    """The fp8 bit patterns (0..255, in int32) of fp32 ``v``, saturated to +-FP8_MAX. On a GPU (HW) the
    conversion instruction that torch's own cast runs (round to nearest even; satfinite saturates, NaN stays
    NaN), written into a 32-bit register, so that no 8-bit tensor is ever moved between threads. The
    interpreter's own casts to fp8 are not round-to-nearest (tests/ops/test_fp8.py), so there the codes are
    computed from the bits: e5m2 as fp16's top byte rounded to nearest even (e5m2 has fp16's exponent; off
    torch's value only where rounding twice meets a tie), e4m3 from fp32's bits (20 mantissa bits rounded off
    to nearest even, the exponent rebased from 127 to 7; below 2^-6, the multiples of e4m3's subnormal step
    2^-9 rounded to nearest even): torch's value."""
    if HW:
        fmt: tl.constexpr = "e5m2x2" if E5M2 else "e4m3x2"
        return tl.inline_asm_elementwise(
            "{ .reg .b16 t; cvt.rn.satfinite." + fmt + ".f32 t, 0f00000000, $1; cvt.u32.u16 $0, t; }",
            "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)
    nan = v != v
    v = tl.clamp(v, -FP8_MAX, FP8_MAX)
    if E5M2:
        h = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return (h + 0x7F + ((h >> 8) & 1)) >> 8
    b = v.to(tl.int32, bitcast=True)
    a = b & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
    steps = tl.abs(v) * 512.0
    subnormal = ((steps + 8388608.0) - 8388608.0).to(tl.int32)  # 2^23 added: fp32 rounds to a whole number
    code = tl.where(a >= (121 << 23), normal, subnormal) | tl.where(b < 0, 0x80, 0)
    return tl.where(nan, 0x7F, code)


@triton.jit
def _fp8_bytes(v, FP8_MAX: tl.constexpr, E5M2: tl.constexpr, HW: tl.constexpr):
    """:func:`_fp8_codes` as uint8: on a GPU four conversions a 32-bit register (two ``cvt ... x2`` and a move:
    ~0.75 instructions an element, where the int32 codes take two and their packing into bytes one more)."""
    if HW:
        fmt: tl.constexpr = "e5m2x2" if E5M2 else "e4m3x2"
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite." + fmt + ".f32 lo, $2, $1; cvt.rn.satfinite." + fmt
            + ".f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [v], dtype=tl.uint8, is_pure=True, pack=4)
    return _fp8_codes(v, FP8_MAX, E5M2, HW).to(tl.uint8)


@triton.jit
def history_scale(HIST, STEP, HISTORY_LEN: tl.constexpr, FP8_MAX: tl.constexpr):
    """(scale, current slot) of one amax history row: ``FP8_MAX / max`` of the row's previous slots (IEEE
    division, as torch's; 1 while the row is empty), as ``cast_fp8_ref`` computes it."""
    slots = tl.arange(0, HISTORY_LEN)
    cur = tl.load(STEP) % HISTORY_LEN
    prev = tl.max(tl.where(slots == cur, 0.0, tl.load(HIST + slots)), axis=0)
    return tl.where(prev > 0.0, tl.math.div_rn(tl.full((), FP8_MAX, tl.float32), prev), 1.0), cur


@triton.jit
def finite_amax_of(a):
    """The largest finite value of a 2-D tile of ``|x|`` (inf and NaN left out, as ``finite_amax``)."""
    m = tl.max(tl.max(a, axis=1), axis=0)
    if (m >= float("inf")) | (m != m):  # an inf or NaN here (rare): the largest finite |x|
        m = tl.max(tl.max(tl.where(a < float("inf"), a, 0.0), axis=1), axis=0)
    return m


@triton.jit
def _store_words_t(YT, codes, row_tile, cols, ci, M, N, BLOCK_M: tl.constexpr):
    """Store the transpose of the int32 codes tile ``codes`` (rows ``row_tile * BLOCK_M + [0, BLOCK_M)``,
    columns ``cols``; ``ci``: them as offsets) into YT, the ``(N, ceil(M / 4))`` int32 words holding four rows
    of the source each: the transpose moves 32-bit values between threads, and a column's bytes go out as whole
    words."""
    shifts = tl.arange(0, 4) * 8
    words = tl.sum(tl.reshape(tl.trans(codes), (codes.shape[1], BLOCK_M // 4, 4)) << shifts[None, None, :], axis=2)
    wi = row_tile * (BLOCK_M // 4) + tl.arange(0, BLOCK_M // 4)
    words_m = (M + 3) // 4
    tl.store(YT + ci[:, None] * words_m + wi[None, :], words, mask=(cols[:, None] < N) & (wi[None, :] < words_m))


@triton.jit
def _store_bytes_t(YT, codes, rows, cols, ri, ci, M, N):
    """Store the transpose of the uint8 codes tile ``codes`` (rows ``rows``, columns ``cols``; ``ri``, ``ci``: them
    as offsets) into YT, the ``(N, M rounded up to a multiple of 4)`` bytes: the compiler's layout conversion moves
    the uint8 tile between threads (or makes it again in the transposed layout: the cast's BYTE_T)."""
    m4 = (M + 3) // 4 * 4
    tl.store(YT + ci[:, None] * m4 + ri[None, :], tl.trans(codes), mask=(cols[:, None] < N) & (rows[None, :] < m4))


@fast_launch
@triton.jit
def _transpose_codes_kernel(X, YT, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """YT = the transpose of the fp8 codes X ``(M, N)``, both as bytes (``_store_bytes_t``)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    codes = tl.load(X + rows.to(tl.int64)[:, None] * N + cols[None, :],
                    mask=(rows[:, None] < M) & (cols[None, :] < N), other=0)
    _store_bytes_t(YT, codes, rows, cols, rows, cols.to(tl.int64), M, N)


@fast_launch
@triton.jit
def _cast_fp8_kernel(X, Z, Y, YT, HIST, STEP, SCALE_INV, COLSUM, M, N, stride_xm, stride_zm, tiles_n, num_tiles,
                     FP8_MAX: tl.constexpr, E5M2: tl.constexpr, HW: tl.constexpr, HISTORY_LEN: tl.constexpr,
                     PRE: tl.constexpr, APPROX_TANH: tl.constexpr, WITH_COLSUM: tl.constexpr, WIDE: tl.constexpr,
                     BYTE_T: tl.constexpr, STAGES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(BLOCK_M, BLOCK_N) tiles ``program_id, program_id + programs, ...`` of the ``num_tiles`` (row-major over
    ``tiles_n`` column tiles): scale from the history row's previous slots, then per tile cast, store the tile and
    its transpose, and with WITH_COLSUM the tile's fp32 column sums (a bias gradient: a row of partial sums a row
    tile, reduced by the caller); the tiles' finite amax goes into the current slot at the end, one relaxed atomic
    max a program (nothing reads the slot before the next kernel). The loop is software-pipelined (STAGES): the
    next tile's loads are in flight while this one is cast. What is cast (``pre_op_ref``): PRE 0 ``x``, 1
    ``gelu(x)``, 2 ``x * gelu'(z)``.

    The source is read once from memory and the pre-op computed once. ``Y`` is the (M, N) result as bytes; ``YT``
    the transpose, its rows padded to a multiple of 4 bytes, written one of two ways. BYTE_T: the codes as a uint8
    tile (``_fp8_bytes``), stored transposed (``_store_bytes_t``); the compiler moves the uint8 codes between
    threads (fp32 sources, GELU's derivative), or converts the source tile and casts it again in the transposed
    layout (unpipelined 16-bit sources), or re-reads it from the pipeline's shared-memory stage (pipelined ones:
    ``CAST_LAUNCH`` says which pays). Otherwise the int32 codes go into 32-bit words of four source rows, which
    ``_store_words_t`` transposes (GELU, whose arithmetic the compiler would repeat in the second layout). Neither
    moves fp8-typed values between threads (Triton 3.6 moved transposed fp8 tiles wrongly on an H100 for fp32
    sources and after the GELU-derivative pre-op, scripts/fp8_diag.py; 8-bit integer tiles are not affected,
    triton-lang/triton#11111).
    Offsets are 32-bit (fewer registers) unless WIDE: a tensor of 2**31 elements or more."""
    scale, cur = history_scale(HIST, STEP, HISTORY_LEN, FP8_MAX)
    amax = tl.zeros((), dtype=tl.float32)
    for t in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), num_stages=STAGES):
        tm = t // tiles_n
        rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (t - tm * tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        ri = rows.to(tl.int64) if WIDE else rows
        ci = cols.to(tl.int64) if WIDE else cols
        x = _pre_op(X, Z, ri[:, None], ci[None, :], mask, stride_xm, stride_zm, PRE, APPROX_TANH, 2 if HW else 1)
        if BYTE_T:  # masked-off elements: 0
            codes = _fp8_bytes(x * scale, FP8_MAX, E5M2, HW)
            tl.store(Y + ri[:, None] * N + ci[None, :], codes, mask=mask)
            _store_bytes_t(YT, codes, rows, cols, ri, ci, M, N)
        else:
            codes = _fp8_codes(x * scale, FP8_MAX, E5M2, HW)
            tl.store(Y + ri[:, None] * N + ci[None, :], codes.to(tl.uint8), mask=mask)
            _store_words_t(YT, codes, tm, cols, ci, M, N, BLOCK_M)
        amax = tl.maximum(amax, finite_amax_of(tl.abs(x)))
        if WITH_COLSUM:
            tl.store(COLSUM + tm * N + ci, tl.sum(x, axis=0), mask=cols < N)
    tl.atomic_max(HIST + cur, amax, sem="relaxed")
    if tl.program_id(0) == 0:
        tl.store(SCALE_INV, tl.math.div_rn(tl.full((), 1.0, tl.float32), scale))


# (BLOCK_M, BLOCK_N, num_warps, pipeline stages, programs an SM, BYTE_T) of the cast on a GPU: per (pre-op, column
# sums) for 16-bit sources (pre-op none, GELU, GELU's derivative), one launch for fp32 sources (the weights' masters,
# which lose from pipelining: a 64 x 64 fp32 stage in flight takes registers from the cast); H200 sweeps,
# benchmarks/RESULTS.md (thirty-third and thirty-fourth sessions). BYTE_T (the kernel's two ways to the transpose)
# pays everywhere but GELU (computed twice with it): plain 16-bit casts take it unpipelined, where the compiler
# converts the source tile through swizzled shared memory; pipelined, it re-reads the cp.async stage down its
# columns instead (bank conflicts: 2x slower). Tensors of at least _WIDE elements index in 64 bits.
CAST_LAUNCH = {(0, False): (64, 128, 4, 1, 8, True), (0, True): (128, 64, 4, 1, 8, True),
               (1, False): (32, 128, 4, 3, 8, False), (1, True): (32, 128, 4, 3, 8, False),
               (2, False): (128, 64, 4, 2, 4, True), (2, True): (128, 64, 4, 2, 4, True)}
CAST_LAUNCH_FP32 = (64, 64, 4, 1, 8, True)
_WIDE = 2**31


def cast_fp8_triton(x: torch.Tensor, history: AmaxHistory, row: int, dtype: torch.dtype, colsum: bool = False,
                    gelu: str | None = None, z: torch.Tensor | None = None, launch: tuple | None = None):
    """``cast_fp8_ref`` of ``pre_op_ref(x, gelu, z)`` in one kernel pass (the tiles' amax goes in with an
    atomic max); with ``colsum`` also its column sums in fp32 (per row tile, then ``column_sums``: deterministic),
    else None. ``launch``: (BLOCK_M, BLOCK_N, num_warps, stages, programs an SM, BYTE_T); default ``CAST_LAUNCH``
    of the pre-op and ``colsum`` (fp32 sources: ``CAST_LAUNCH_FP32``; the interpreter: 32 x 32 tiles, 4 warps, one
    stage, 8 programs an SM, where num_sms is 2, and the GPU's way to the transpose)."""
    m, n = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if z is not None and z.stride(1) != 1:
        z = z.contiguous()
    m4 = -(-m // 4) * 4  # the transpose's rows as whole int32 words
    x8 = torch.empty((m, n), dtype=dtype, device=x.device)
    x8t = torch.empty((n, m4), dtype=dtype, device=x.device)
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    pre = 0 if gelu is None else (1 if z is None else 2)
    if launch is None:
        launch = CAST_LAUNCH_FP32 if x.dtype == torch.float32 else CAST_LAUNCH[pre, colsum]
        if INTERPRET:
            launch = (32, 32, 4, 1, 8, launch[5])
    block_m, block_n, warps, stages, per_sm, byte_t = launch
    tiles_m, tiles_n = cdiv(m, block_m), cdiv(n, block_n)
    parts = torch.empty((tiles_m, n) if colsum else (0,), dtype=torch.float32, device=x.device)
    wide = m4 * max(n, x.stride(0), z.stride(0) if z is not None else 0) >= _WIDE
    programs = max(1, min(tiles_m * tiles_n, num_sms(x.device) * per_sm))
    _cast_fp8_kernel[(programs,)](x, z if z is not None else x, x8.view(torch.uint8),
                                  x8t.view(torch.uint8 if byte_t else torch.int32),
                                  history.amax[row], history.step, scale_inv, parts, m, n, x.stride(0),
                                  z.stride(0) if z is not None else 0, tiles_n, tiles_m * tiles_n,
                                  FP8_MAX=FP8_MAX[dtype], E5M2=dtype == E5M2, HW=not INTERPRET, HISTORY_LEN=HISTORY,
                                  PRE=pre, APPROX_TANH=gelu == "tanh", WITH_COLSUM=colsum, WIDE=wide,
                                  BYTE_T=byte_t, STAGES=stages, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    if m4 != m:  # rows that are not whole words (never in the model: its GEMM dimensions are multiples of 16)
        x8t = x8t[:, :m].contiguous()
    return x8, x8t, scale_inv, column_sums(parts) if colsum else None


def transpose_codes(x8: torch.Tensor, tile: tuple = (64, 64, 4)) -> torch.Tensor:
    """The transpose of the 2-D fp8 tensor ``x8``, contiguous (``x8.t().contiguous()``), in one pass that moves
    the codes as uint8; ``tile``: (BLOCK_M, BLOCK_N, num_warps) on a GPU."""
    m, n = x8.shape
    m4 = -(-m // 4) * 4
    out = torch.empty((n, m4), dtype=x8.dtype, device=x8.device)
    block_m, block_n, warps = (32, 32, 1) if INTERPRET else tile
    if m and n:
        _transpose_codes_kernel[(cdiv(m, block_m), cdiv(n, block_n))](
            x8.contiguous().view(torch.uint8), out.view(torch.uint8), m, n, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=warps)
    return out if m4 == m else out[:, :m].contiguous()


def cast_fp8(x, history: AmaxHistory, row: int, dtype: torch.dtype, colsum: bool = False,
             gelu: str | None = None, z: torch.Tensor | None = None):
    """``(v8, v8 transposed, scale_inv, v.sum(0) in fp32 or None)`` for ``v = pre_op_ref(x, gelu, z)``:
    the kernel on CUDA when Triton is there, else the reference (also under TRITON_INTERPRET: the
    interpreter's fp8 conversion loses the carry when rounding up reaches a power of two)."""
    kernel = HAS_TRITON and x.is_cuda
    v = None if kernel else pre_op_ref(x, gelu, z)
    if row not in history.primed:
        history.prime(row, v if v is not None else pre_op_ref(x, gelu, z))
    if kernel:
        return cast_fp8_triton(x, history, row, dtype, colsum, gelu, z)
    return (*cast_fp8_ref(v, history, row, dtype), v.sum(0) if colsum else None)


def weight_fp8(w: torch.Tensor, history: AmaxHistory, row: int) -> tuple:
    """``cast_fp8(w, history, row, E4M3)[:3]`` for a weight. While training keeps the weights' casts for an
    optimizer step (``weight_casts.derived``: steps of several micro-batches) the codes, their transpose and scale
    are made once a step, scaled by the weight's own amax of that moment (measured first, as a row's first cast
    is: the micro-batches between two refreshes record nothing in the weight's history row, whose slots the
    forwards go on zeroing), and the step's later micro-batches reuse them (BERT-large: 96 casts of 302 M fp32
    weights less a micro-batch; the academic-budget command with FP8 +0.66% on an H200, benchmarks/RESULTS.md,
    thirty-seventh session)."""
    def make(p):
        history.prime(row, p.detach())
        return cast_fp8(p, history, row, E4M3)[:3]

    kept = weight_casts.derived(w, ("fp8", id(history), row), make)
    return kept if kept is not None else cast_fp8(w, history, row, E4M3)[:3]


# ============================================================================= autograd + entry point
def _mm8(a8, b8, scale_a, scale_b, out_dtype, bias=None, fast_accum=False):
    """``torch._scaled_mm(a8, b8, ...)``: ``(scale_a a8) @ (scale_b b8)`` (+ bias) in ``out_dtype``, fp32
    accumulation. On the CPU (the tests: FP8 training has no other use there) the same product of the FP8 values
    through a float32 ``torch.mm``: torch 2.13's CPU ``_scaled_mm`` took 0.94 s for 128 x 128 x 512 against 2 ms,
    and made FP8 model tests run minutes; the two differ by fp32 summation order (bf16 results by at most
    one rounding)."""
    if a8.device.type != "cpu":
        return torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    y = torch.mm(a8.float(), b8.float()) * (scale_a.float() * scale_b.float())
    return (y if bias is None else y + bias.float()).to(out_dtype)


def _scaled_mm_bias(a8, b8, scale_a, scale_b, bias, out_dtype):
    """The forward GEMM (fast accumulation, as Transformer Engine's forward) with the bias in cuBLASLt's
    epilogue; an fp32 output (fp32 training) has no bias epilogue there, so the bias is added after."""
    fused = bias is not None and out_dtype != torch.float32
    y = _mm8(a8, b8, scale_a, scale_b, out_dtype, bias=bias.to(out_dtype) if fused else None, fast_accum=True)
    return y + bias.to(out_dtype) if bias is not None and not fused else y


def _dgrad(g8, wt8, sg, sw, out_dtype, dres):
    """The input gradient ``(sg g8) @ (sw W)`` (``wt8``: W's transposed cast) plus ``dres``, the gradient that
    reached the input through the residual connection, or None: added by the GEMM where cuBLASLt can take it
    (``cublaslt.scaled_addmm``), else by torch after ``_scaled_mm``."""
    if dres is not None:
        dx = cublaslt.scaled_addmm(dres.contiguous(), g8, wt8.t(), sg, sw) if dres.dtype == out_dtype else None
        if dx is not None:
            return dx
    dx = _mm8(g8, wt8.t(), sg, sw, out_dtype)
    return dx if dres is None else dx + dres


def linear_forward(x2, weight, bias, history, rows, out_dtype):
    """An FP8 linear's forward: ``(x2 @ W^T + b, saved)``, the casts in history rows ``rows`` and ``rows + 1``;
    ``saved``: the transposed casts and scales :func:`linear_backward` needs (for ``ctx.save_for_backward``)."""
    x8, x8t, sx, _ = cast_fp8(x2, history, rows, E4M3)
    w8, w8t, sw = weight_fp8(weight, history, rows + 1)
    return _scaled_mm_bias(x8, w8.t(), sx, sw, bias, out_dtype), (x8t, w8t, sx, sw)


def _wgrad(g8t, x8t, sg, sx, dtype, acc):
    """The weight gradient ``dy^T @ x`` from the transposed casts ``(N, T)`` and ``(K, T)`` in ``dtype``; with
    ``acc`` (its buffer, ``ops/grad_accum.py``) added into it, inside the GEMM where cuBLASLt can, and None."""
    if acc is None:
        return _mm8(g8t, x8t.t(), sg, sx, dtype)
    if not cublaslt.accumulate(acc, g8t, x8t.t(), sg, sx):
        acc.add_(_mm8(g8t, x8t.t(), sg, sx, acc.dtype))
    return None


def linear_backward(saved, dtypes, g8, g8t, sg, db, dres, wacc=None):
    """``(dx, dW, db)`` of a :func:`linear_forward` from its ``saved`` tensors, the dtypes of (x, W, b) (b's None
    without a bias: then db is None whatever the cast's column sums) and the cast of its output gradient ``(g8,
    g8t, sg, column sums)``; ``dres``: the residual's gradient that joins dx (or None); ``wacc``: W's
    accumulator (``_wgrad``; dW then None)."""
    x8t, w8t, sx, sw = saved
    x_dtype, w_dtype, b_dtype = dtypes
    # dx = dy @ W: (T, N) x (N, K), W column-major = W^T's rows; dW = dy^T @ x: (N, T) x (T, K).
    dx = _dgrad(g8, w8t, sg, sw, x_dtype, dres)
    return dx, _wgrad(g8t, x8t, sg, sx, w_dtype, wacc), db.to(b_dtype) if b_dtype is not None else None


class _Fp8Linear(torch.autograd.Function):
    """``(x2 @ W^T + b, x2)``: the input is handed back as a second output for a residual connection, whose
    gradient then joins the input gradient inside its GEMM (``_dgrad``; unused, it costs nothing)."""

    @staticmethod
    def forward(ctx, x2, weight, bias, history, rows, out_dtype):
        y, saved = linear_forward(x2, weight, bias, history, rows, out_dtype)
        ctx.save_for_backward(*saved)
        ctx.history, ctx.rows = history, rows
        ctx.dtypes = (x2.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.wacc = grad_accum.buffer_for(weight) if ctx.needs_input_grad[1] else None
        ctx.set_materialize_grads(False)  # an unused output's gradient is None, not zeros
        return y, x2

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dres):
        if dy is None:  # only the residual's gradient arrived
            return dres, None, None, None, None, None
        cast = cast_fp8(dy, ctx.history, ctx.rows + 2, E5M2, colsum=ctx.dtypes[2] is not None)
        return (*linear_backward(ctx.saved_tensors, ctx.dtypes, *cast, dres, ctx.wacc), None, None, None)


class _Fp8Ffn(torch.autograd.Function):
    """``(gelu(x @ W1^T + b1) @ W2^T, x)`` (no output bias) with four FP8 GEMMs forward and back; the GELU
    runs inside the cast of the down-projection's input (the activation never exists in 16 bits) and
    its derivative inside the cast of the up-projection's output gradient, which also sums d(b1). x comes
    back for a residual connection, as from ``_Fp8Linear``."""

    @staticmethod
    def forward(ctx, x2, w1, b1, w2, history, rows, approximate, out_dtype):
        up, down = rows, rows + 3
        x8, x8t, sx, _ = cast_fp8(x2, history, up, E4M3)
        w18, w18t, sw1 = weight_fp8(w1, history, up + 1)
        z = _scaled_mm_bias(x8, w18.t(), sx, sw1, b1, out_dtype)
        y8, y8t, sy, _ = cast_fp8(z, history, down, E4M3, gelu=approximate)
        w28, w28t, sw2 = weight_fp8(w2, history, down + 1)
        out = _mm8(y8, w28.t(), sy, sw2, out_dtype, fast_accum=True)
        ctx.save_for_backward(x8t, w18t, sx, sw1, z, y8t, w28t, sy, sw2)
        ctx.history, ctx.rows, ctx.approximate = history, rows, approximate
        ctx.dtypes = (x2.dtype, w1.dtype, b1.dtype if b1 is not None else None, w2.dtype)
        ctx.accs = tuple(grad_accum.buffer_for(w) if ctx.needs_input_grad[i] else None
                         for i, w in ((1, w1), (3, w2)))
        ctx.set_materialize_grads(False)
        return out, x2

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dres):
        if dout is None:
            return dres, None, None, None, None, None, None, None
        x8t, w18t, sx, sw1, z, y8t, w28t, sy, sw2 = ctx.saved_tensors
        x_dtype, w1_dtype, b1_dtype, w2_dtype = ctx.dtypes
        up, down = ctx.rows, ctx.rows + 3
        g8, g8t, sg, _ = cast_fp8(dout, ctx.history, down + 2, E5M2)
        dy = _mm8(g8, w28t.t(), sg, sw2, z.dtype)
        w1acc, w2acc = ctx.accs
        dw2 = _wgrad(g8t, y8t, sg, sy, w2_dtype, w2acc)
        dz8, dz8t, sdz, db1 = cast_fp8(dy, ctx.history, up + 2, E5M2, colsum=b1_dtype is not None,
                                       gelu=ctx.approximate, z=z)
        dx = _dgrad(dz8, w18t, sdz, sw1, x_dtype, dres)
        dw1 = _wgrad(dz8t, x8t, sdz, sx, w1_dtype, w1acc)
        return dx, dw1, db1.to(b1_dtype) if db1 is not None else None, dw2, None, None, None, None


def _aligned(*dims: int) -> bool:
    return all(d % ALIGN == 0 and d > 0 for d in dims)


def _apply(function, x: torch.Tensor, in_features: int, out_features: int, residual: bool, *args):
    """``function`` (an FP8 autograd function) on ``x`` as ``(tokens, in_features)`` rows, outside autocast;
    its result in the dtype F.linear would give (autocast's, else x's), shaped like ``x``; with ``residual``
    also x for the residual connection (the function's second output: its gradient joins the input
    gradient's GEMM)."""
    out_dtype = autocast_dtype(x.device) or x.dtype
    with torch.autocast(x.device.type, enabled=False):
        y, x2 = function.apply(x.reshape(-1, in_features), *args, out_dtype)
    y = y.view(*x.shape[:-1], out_features)
    return (y, x2.view(x.shape)) if residual else y


def fp8_ffn(x: torch.Tensor, w1: torch.Tensor, b1, w2: torch.Tensor, history: AmaxHistory, rows: int,
            approximate: str = "none", residual: bool = False):
    """``F.linear(F.gelu(F.linear(x, w1, b1), approximate), w2)`` with FP8 GEMMs; ``rows``: the up-projection's
    first history row, the down-projection's three follow. ``residual``: return ``(output, x)``, x to be used
    for the residual connection (see ``_apply``). Shapes ``_scaled_mm`` cannot take run the 16/32-bit ops."""
    if not _aligned(x.numel() // w1.shape[1], *w1.shape, *w2.shape):
        y = F.linear(F.gelu(F.linear(x, w1, b1), approximate=approximate), w2)
        return (y, x) if residual else y
    return _apply(_Fp8Ffn, x, w1.shape[1], w2.shape[0], residual, w1, b1, w2, history, rows, approximate)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias, history: AmaxHistory, rows: int,
               residual: bool = False):
    """``F.linear(x, weight, bias)`` with FP8 GEMMs; ``rows``: the first of this linear's three
    history rows (input, weight, output gradient). Under autocast the result is in the autocast
    dtype, as F.linear's; shapes that ``_scaled_mm`` cannot take run F.linear itself. ``residual``: return
    ``(output, x)``, x to be used for the residual connection (see ``_apply``)."""
    if not _aligned(x.numel() // weight.shape[1], *weight.shape):
        y = F.linear(x, weight, bias)
        return (y, x) if residual else y
    return _apply(_Fp8Linear, x, weight.shape[1], weight.shape[0], residual, weight, bias, history, rows)
