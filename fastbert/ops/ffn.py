"""The FFN: up-projection with bias + GELU, ``gelu(x @ weight.T + bias)`` (:func:`linear_bias_gelu`), and
the whole block without its output bias, ``gelu(x @ w1.T + b1) @ w2.T`` (:func:`ffn`).

``approximate`` is ``"none"`` (exact erf GELU, BERT's) or ``"tanh"``. This file holds the
plain-PyTorch references; the fast paths live beside them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_bias_gelu_ref(x, weight, bias, approximate="none"):
    """Reference. ``x``: ``(tokens, in)``, ``weight``: ``(out, in)``, ``bias``: ``(out,)``."""
    return F.gelu(F.linear(x, weight, bias), approximate=approximate)


def gelu_grad_ref(z, approximate="none"):
    """d gelu(z) / dz in fp32 (float64 stays float64); the formulas of the kernels' ``gelu_grad`` below."""
    z = z if z.dtype == torch.float64 else z.float()
    if approximate == "tanh":
        t = torch.tanh(0.7978845608028654 * (z + 0.044715 * z ** 3))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * 0.7978845608028654 * (1 + 0.134145 * z * z)
    return 0.5 * (1 + torch.erf(z * 0.7071067811865476)) + z * torch.exp(-0.5 * z * z) * 0.3989422804014327


def ffn_ref(x, w1, b1, w2, approximate="none", residual=False):
    """Reference of the FFN without its output bias. ``w1``: ``(intermediate, hidden)``, ``w2``:
    ``(hidden, intermediate)``. ``residual=True`` returns ``(out, x)`` (as :func:`ffn`)."""
    out = F.linear(linear_bias_gelu_ref(x, w1, b1, approximate), w2)
    return (out, x) if residual else out


# ============================================================================= Triton kernels
# Everything below is the fast path. The GEMM is cuBLAS's, with the bias in its epilogue; GELU is one
# Triton pass over the pre-activation (kept for the backward when grad is on, as eager torch keeps
# it, else overwritten in place); the backward's GELU derivative is one Triton pass that also reduces
# d(bias); dgrad / wgrad are cuBLAS matmuls. With the tanh GELU on 16-bit CUDA operands, cuBLASLt's
# epilogues (ops/cublaslt.py) do both GELU passes inside GEMMs instead: the up-projection applies bias +
# GELU and keeps the pre-activation; in :func:`ffn`'s backward, the down-projection's input-gradient GEMM
# multiplies by GELU's derivative. With the exact GELU on bf16 operands on an sm_90 GPU, CUTLASS's warp-
# specialized kernels (ops/gemm_sm90.py) do the same. A Triton GEMM with bias + GELU in its epilogue was
# this file's forward until the fifth session: on an H100 it ran at 0.84-0.94x cuBLAS + a separate GELU
# (`benchmarks/bench_ops.py --ops ffn`, benchmarks/RESULTS.md), so it is gone.
from fastbert.ops import cublaslt, gemm_sm90, grad_accum  # noqa: E402
from fastbert.ops._common import (  # noqa: E402
    autocast_dtype, autocast_inputs, cdiv, check_triton_device, column_sums, fast_launch, next_power_of_2, num_sms,
    register_op, tl, triton)
from fastbert.ops.linear import bias_grad, linear_grads, wgrad  # noqa: E402

@triton.jit
def _tanh(u):
    # exp of -2|u| never overflows; odd symmetry restores the sign.
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(u >= 0, t, -t)


@triton.jit
def _approx(x, OP: tl.constexpr):
    """PTX's one-instruction ``rcp`` / ``ex2`` approximations (flush-to-zero: no range handling around them)."""
    return tl.inline_asm_elementwise(OP + ".approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _half_erfc(z, SIGN: tl.constexpr, PTX: tl.constexpr):
    """``(SIGN * 0.5 * erfc(|z| / sqrt 2), exp(-z^2 / 2))``, the first = ``SIGN * Phi(-|z|)``, by Abramowitz & Stegun
    7.1.26 (|erfc error| <= 1.5e-7, ~1 ulp of the 1.0 that GELU adds erf to) with ``SIGN * 0.5`` folded into the
    coefficients: one polynomial, where libdevice's erff evaluates two ranges with their own coefficients; the
    exponential, which GELU's derivative needs, comes with it. Written from |z| with no sign select and no
    ``1 - erfc`` (GELU takes ``relu(z) - |z| Phi(-|z|)``): the GELU cast's fp32 instructions 16.6 an element
    against 20.6 as ``0.5 z (1 + erf(z / sqrt 2))`` (sm_90 compile reports, benchmarks/RESULTS.md, thirty-fourth
    session), with the same error as before or less (float64 check from -12 to 12). PTX
    (a GPU): the reciprocal and the exponential as PTX's approximations, ~1-2 ulp, without IEEE range handling."""
    d = 1.0 + 0.23164189758 * tl.abs(z)  # 1 + 0.3275911 |z| / sqrt(2)
    t = _approx(d, "rcp") if PTX else 1.0 / d
    c: tl.constexpr = 0.5 * SIGN
    p = t * (c * 0.254829592 + t * (c * -0.284496736 + t * (c * 1.421413741 + t * (c * -1.453152027
                                                                                    + t * (c * 1.061405429)))))
    e = _approx(z * (z * -0.7213475204444817), "ex2") if PTX else tl.exp(-0.5 * z * z)  # log2(e) / 2
    return p * e, e


@triton.jit
def gelu(z, APPROX_TANH: tl.constexpr, ERF: tl.constexpr):
    """GELU in fp32: exact ``z * Phi(z)`` (0.70710678 = 1/sqrt(2)) or the tanh approximation
    (0.79788456 = sqrt(2/pi)). The exact one's erf: ERF 0 libdevice's (the 16-bit paths, which match torch's
    F.gelu); 1 ``_half_erfc``, 2 the same with PTX's approximations (the FP8 casts, whose rounding is 2^-4 of a
    value; 1 in the interpreter, 2 on a GPU)."""
    if APPROX_TANH:
        t = _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
        return 0.5 * z * (1.0 + t)
    elif ERF > 0:  # z Phi(z) = relu(z) - |z| Phi(-|z|)
        return tl.maximum(z, 0.0) + tl.abs(z) * _half_erfc(z, -1.0, ERF == 2)[0]
    else:
        return 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))


@triton.jit
def gelu_grad(z, APPROX_TANH: tl.constexpr, ERF: tl.constexpr):
    """d gelu(z) / dz in fp32 (ERF: see ``gelu``)."""
    if APPROX_TANH:
        t = _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
        dt = 0.7978845608028654 * (1.0 + 0.134145 * z * z)
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * dt
    elif ERF > 0:  # Phi(z) + z phi(z), Phi(z) = 1 - Phi(-|z|) for z >= 0
        lo, gauss = _half_erfc(z, 1.0, ERF == 2)  # gauss = exp(-z^2 / 2)
        return tl.where(z >= 0.0, 1.0 - lo, lo) + (z * gauss) * 0.3989422804014327
    else:
        cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
        pdf = tl.exp(-0.5 * z * z) * 0.3989422804014327
        return cdf + z * pdf


@fast_launch
@triton.jit
def _gelu_fwd_kernel(Z, Y, numel, APPROX_TANH: tl.constexpr, BLOCK: tl.constexpr):
    """y = gelu(z) over a flat block (Y may be Z: in place)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    z = tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, gelu(z, APPROX_TANH, 0).to(Y.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit(do_not_specialize=["M", "rows_per_program"])
def _gelu_bwd_kernel(DY, Z, DZ, DB_PART, M, N, rows_per_program, stride_dy, stride_z, stride_dz,
                     APPROX_TANH: tl.constexpr, GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dz = dy * gelu'(z) over a column strip of ``rows_per_program`` rows (GRAD: Z holds gelu'(z) itself); the
    strip's column sums of dz (partial d(bias)) go to DB_PART[program_id(1)]."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    row_start = tl.program_id(1) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(row_start, row_end, BLOCK_M):
        rows = (r + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows[:, None] < row_end) & col_mask[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        z = tl.load(Z + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dz = dy * (z if GRAD else gelu_grad(z, APPROX_TANH, 0))
        tl.store(DZ + rows[:, None] * stride_dz + cols[None, :], dz.to(DZ.dtype.element_ty), mask=mask)
        acc += dz
    tl.store(DB_PART + tl.program_id(1) * N + cols, tl.sum(acc, axis=0), mask=col_mask)


# ============================================================================= host wrappers
def _check_approximate(approximate):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")


_GELU_BLOCK = 4096


def _lt_fwd(x2, weight, bias, store_pre):
    """(y, z) of the tanh GELU from cuBLASLt's epilogue, or None when it cannot take these operands."""
    if not cublaslt.eligible(x2, weight, bias, sizes=weight.shape):
        return None
    y = x2.new_empty((x2.shape[0], weight.shape[0]))
    z = torch.empty_like(y) if store_pre else None
    epilogue = ("gelu_aux" if store_pre else "gelu") + ("_bias" if bias is not None else "")
    if cublaslt.gemm(x2, weight.t(), epilogue, bias=bias, aux=z, out=y) is None:
        return None
    return y, z


def keeps_grad(x, weight, bias, approximate) -> bool:
    """Whether the up-projection's forward keeps GELU's derivative gelu'(z) for the backward in place of the
    pre-activation z: with the exact GELU through ops/gemm_sm90.py, whose epilogue evaluates erf once for both
    gelu(z) and gelu'(z), so the backward's epilogue only multiplies. The backward asks again with the forward's
    own inputs (saved), so both sides agree (``gemm_sm90.ENABLED`` is not to change between them)."""
    return approximate == "none" and gemm_sm90.eligible(x.reshape(-1, x.shape[-1]), weight, bias)


def linear_bias_gelu_fwd(x, weight, bias, approximate, store_pre):
    """``x (..., K) -> (y, z)``: y = gelu(x @ weight.T + bias) like x; with ``store_pre`` z is what the backward
    needs (the pre-activation, or gelu'(z) where :func:`keeps_grad`), else an empty tensor."""
    n = weight.shape[0]
    out_shape = (*x.shape[:-1], n)
    x2 = x.reshape(-1, x.shape[-1])
    lt = _lt_fwd(x2, weight, bias, store_pre) if approximate == "tanh" else None
    if lt is None and store_pre and keeps_grad(x2, weight, bias, approximate):
        lt = gemm_sm90.bias_gelu(x2, weight, bias)
    if lt is not None:
        y, z = lt
        return y.view(out_shape), z.view(out_shape) if store_pre else y.new_empty((0,))
    z = F.linear(x2, weight, bias)  # (M, N), cuBLAS with the bias in its epilogue
    y = torch.empty_like(z) if store_pre else z
    if z.numel() > 0:
        _gelu_fwd_kernel[(cdiv(z.numel(), _GELU_BLOCK),)](
            z, y, z.numel(), APPROX_TANH=approximate == "tanh", BLOCK=_GELU_BLOCK, num_warps=8)
    return y.view(out_shape), z.view(out_shape) if store_pre else z.new_empty((0,))


def gelu_bwd(dy, z, approximate, grad=False):
    """``(dz, dbias)`` for ``y = gelu(z)``: dz like z, dbias the fp32 column sums of dz; ``grad``: z holds gelu'(z)
    (:func:`keeps_grad`)."""
    n = z.shape[-1]
    dy2 = dy.reshape(-1, n)
    z2 = z.reshape(-1, n)
    m = z2.shape[0]
    dz = torch.empty((m, n), dtype=z.dtype, device=z.device)
    block_n = min(next_power_of_2(max(n, 1)), 256)
    block_m = 16
    grid_n = cdiv(n, block_n)
    # Enough row strips to fill the GPU (several programs per SM), each a multiple of BLOCK_M rows.
    strips = max(1, min(cdiv(m, block_m), cdiv(num_sms(z.device) * 8, max(grid_n, 1))))
    rows_per_program = cdiv(cdiv(max(m, 1), strips), block_m) * block_m
    strips = max(1, cdiv(m, rows_per_program))
    db_part = torch.zeros((strips, n), dtype=torch.float32, device=z.device)
    if m > 0 and n > 0:
        _gelu_bwd_kernel[(grid_n, strips)](
            dy2, z2, dz, db_part, m, n, rows_per_program, dy2.stride(0), z2.stride(0), n,
            APPROX_TANH=approximate == "tanh", GRAD=grad, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
    return dz.view(z.shape), column_sums(db_part)


def linear_bias_gelu_bwd(dy, x, weight, bias, z, approximate, wdtype):
    """``(dx, dweight, dbias)``, dweight and dbias in ``wdtype`` (the parameters', ``linear.py``); dbias is
    empty when ``bias`` is None."""
    dz, db = gelu_bwd(dy, z, approximate, keeps_grad(x, weight, bias, approximate))
    dx, dw = linear_grads(dz, x, weight, wdtype=wdtype)
    return dx, dw, db.to(wdtype) if bias is not None else weight.new_empty((0,), dtype=wdtype)


def _fwd_fake(x, weight, bias, approximate, store_pre):
    out_shape = (*x.shape[:-1], weight.shape[0])
    y = x.new_empty(out_shape)
    return y, x.new_empty(out_shape) if store_pre else x.new_empty((0,))


def _bwd_fake(dy, x, weight, bias, z, approximate, wdtype):
    db = weight.new_empty((weight.shape[0] if bias is not None else 0,), dtype=wdtype)
    return torch.empty_like(x), torch.empty_like(weight, dtype=wdtype), db


_fwd_op = register_op(
    "linear_bias_gelu_fwd",
    "(Tensor x, Tensor weight, Tensor? bias, str approximate, bool store_pre) -> (Tensor, Tensor)",
    linear_bias_gelu_fwd, _fwd_fake)
_bwd_op = register_op(
    "linear_bias_gelu_bwd",
    "(Tensor dy, Tensor x, Tensor weight, Tensor? bias, Tensor z, str approximate, ScalarType wdtype) "
    "-> (Tensor, Tensor, Tensor)",
    linear_bias_gelu_bwd, _bwd_fake)


# ============================================================================= autograd + entry point
class LinearBiasGeluFn(torch.autograd.Function):
    """Takes the parameters themselves (fp32 masters under autocast), cast inside (``linear.py``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, approximate, store_pre):
        w, b = autocast_inputs(weight, bias)
        y, z = _fwd_op(x, w, b, approximate, store_pre)
        ctx.save_for_backward(x, w, b, z)
        ctx.approximate, ctx.wdtype = approximate, weight.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, z = ctx.saved_tensors
        dx, dw, db = _bwd_op(dy.contiguous(), x, weight, bias, z, ctx.approximate, ctx.wdtype)
        return dx, dw, db if bias is not None else None, None, None


def _compute_dtype(x, *weights):
    """x cast as autocast casts a matmul's input, and the dtype the weights will have inside the op: the
    autocast dtype, else their own (which must all be x's)."""
    cast = autocast_dtype(x.device)
    if cast is not None:
        return x.to(cast), cast
    return x, weights[0].dtype if all(w.dtype == weights[0].dtype for w in weights) else None


def linear_bias_gelu(x, weight, bias, approximate="none"):
    """Fused ``gelu(x @ weight.T + bias)``; same signature and semantics as :func:`linear_bias_gelu_ref`."""
    _check_approximate(approximate)
    check_triton_device(x, weight, bias)
    x, wdtype = _compute_dtype(x, weight)
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"linear_bias_gelu: x (..., {x.shape[-1]}) does not match weight {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"linear_bias_gelu: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if x.dtype != wdtype:
        raise TypeError(f"linear_bias_gelu: x is {x.dtype} but weight is {weight.dtype}; cast one (or use autocast "
                        "outside the op)")
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if not needs_grad:
        return _fwd_op(x, *autocast_inputs(weight, bias), approximate, False)[0]
    return LinearBiasGeluFn.apply(x, weight, bias, approximate, True)


# ============================================================================= the whole FFN
def ffn_fwd(x, w1, b1, w2, approximate, store_pre):
    """``(out, y, z)``: the FFN's output ``(..., hidden)``; with ``store_pre`` also its GELU output y and
    pre-activation z (or gelu'(z), :func:`keeps_grad`) ``(tokens, intermediate)`` for the backward (else empty
    tensors)."""
    y, z = linear_bias_gelu_fwd(x, w1, b1, approximate, store_pre)
    y2 = y.reshape(-1, w1.shape[0])
    out = F.linear(y2, w2).view(*x.shape[:-1], w2.shape[0])
    return (out, y2, z.reshape(y2.shape)) if store_pre else (out, y.new_empty((0,)), z)


def ffn_bwd(dout, dres, x, w1, b1, w2, y, z, approximate, wdtype, w1acc=None, w2acc=None):
    """``(dx, dw1, db1, dw2)``, the parameters' in ``wdtype`` (``linear.py``); db1 is empty when ``b1`` is None.
    ``w1acc`` / ``w2acc``: the accumulators dw1 / dw2 are added into (``linear.wgrad``), each then empty.
    ``dres``: the gradient that reached x through the residual connection (or None), added to dx inside its
    GEMM. On eligible operands the down-projection's input-gradient GEMM applies GELU's derivative in its
    epilogue: the tanh GELU through cuBLASLt, then d(b1) as one reduction (cuBLASLt's own d(bias) epilogue here
    runs as a separate 0.6 ms kernel on an H100, so it is not used); the exact one through ops/gemm_sm90.py
    (multiplying by the gelu'(z) its forward kept), whose epilogue sums d(b1) too. Otherwise that GEMM, then
    :func:`gelu_bwd` (which reduces d(b1) too)."""
    d2 = dout.reshape(-1, w2.shape[0])  # (M, hidden)
    dw2 = wgrad(d2, y, wdtype, w2acc)   # (hidden, M) @ (M, intermediate)
    dz = None
    grad = keeps_grad(x, w1, b1, approximate)
    if approximate == "tanh" and cublaslt.eligible(d2, w2, z):
        dz = cublaslt.gemm(d2, w2, "dgelu", aux=z)
        db = bias_grad(dz, wdtype) if dz is not None and b1 is not None else None
    elif grad and gemm_sm90.eligible(d2, w2, z):
        dz, db = gemm_sm90.dgelu(d2, w2, z)
    if dz is None:
        dz, db = gelu_bwd(d2 @ w2, z, approximate, grad)
    dx, dw1 = linear_grads(dz, x, w1, dres, wdtype, w1acc)
    empty = w1.new_empty((0,), dtype=wdtype)
    return (dx, empty if dw1 is None else dw1, db.to(wdtype) if b1 is not None else empty,
            empty if dw2 is None else dw2)


def _ffn_fwd_fake(x, w1, b1, w2, approximate, store_pre):
    out = x.new_empty((*x.shape[:-1], w2.shape[0]))
    inner = x.new_empty((x.numel() // x.shape[-1], w1.shape[0])) if store_pre else x.new_empty((0,))
    return out, inner, torch.empty_like(inner)


def _ffn_bwd_fake(dout, dres, x, w1, b1, w2, y, z, approximate, wdtype, w1acc=None, w2acc=None):
    db = w1.new_empty((w1.shape[0] if b1 is not None else 0,), dtype=wdtype)
    return (torch.empty_like(x), w1.new_empty(w1.shape if w1acc is None else (0,), dtype=wdtype), db,
            w2.new_empty(w2.shape if w2acc is None else (0,), dtype=wdtype))


_ffn_fwd_op = register_op(
    "ffn_fwd",
    "(Tensor x, Tensor w1, Tensor? b1, Tensor w2, str approximate, bool store_pre) -> (Tensor, Tensor, Tensor)",
    ffn_fwd, _ffn_fwd_fake)
_ffn_bwd_op = register_op(
    "ffn_bwd", "(Tensor dout, Tensor? dres, Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor y, Tensor z, "
    "str approximate, ScalarType wdtype, Tensor(a!)? w1acc, Tensor(b!)? w2acc) "
    "-> (Tensor, Tensor, Tensor, Tensor)", ffn_bwd, _ffn_bwd_fake)


class FfnFn(torch.autograd.Function):
    """Returns the FFN's output and x itself: a gradient reaching x through that second output (the
    residual connection's) is added to dx inside the last GEMM of the backward, not by autograd's
    own addition kernel (one pass over a (tokens, hidden) tensor less per layer). Takes the parameters
    themselves (fp32 masters under autocast), cast inside (``linear.py``). A second output nobody uses (Pre-LN
    adds the FFN's output to the residual stream, not its input) gives ``dres`` None: no tensor of zeros made and
    read by that GEMM (BERT-large, Pre-LN: 24 fills and reads of 32 MB a micro-batch before the twenty-fourth
    session)."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, approximate):
        ctx.set_materialize_grads(False)
        w1c, b1c, w2c = autocast_inputs(w1, b1, w2)
        out, y, z = _ffn_fwd_op(x, w1c, b1c, w2c, approximate, True)
        ctx.save_for_backward(x, w1c, b1c, w2c, y, z)
        ctx.approximate, ctx.wdtype = approximate, w1.dtype
        ctx.accs = tuple(grad_accum.buffer_for(w) if ctx.needs_input_grad[i] else None
                         for i, w in ((1, w1), (3, w2)))
        return out, x

    @staticmethod
    def backward(ctx, dout, dres):
        if dout is None:  # only the passed-through x was used: its gradient, none for the weights
            return dres, None, None, None, None
        x, w1, b1, w2, y, z = ctx.saved_tensors
        dres = dres.contiguous() if dres is not None else None
        dx, dw1, db1, dw2 = _ffn_bwd_op(dout.contiguous(), dres, x, w1, b1, w2, y, z, ctx.approximate, ctx.wdtype,
                                        *ctx.accs)
        w1acc, w2acc = ctx.accs
        return (dx, dw1 if w1acc is None else None, db1 if b1 is not None else None, dw2 if w2acc is None else None,
                None)


def ffn(x, w1, b1, w2, approximate="none", residual=False):
    """Fused FFN without its output bias, ``gelu(x @ w1.T + b1) @ w2.T``; same signature and semantics as
    :func:`ffn_ref`. ``residual=True`` returns ``(out, x)``: use that x for the residual connection and its
    gradient joins the input gradient inside the backward's last GEMM."""
    _check_approximate(approximate)
    check_triton_device(x, w1, b1, w2)
    x_in = x
    x, wdtype = _compute_dtype(x, w1, w2)
    if w1.dim() != 2 or w2.dim() != 2 or x.shape[-1] != w1.shape[1] or w2.shape[1] != w1.shape[0]:
        raise ValueError(f"ffn: x (..., {x.shape[-1]}), w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)} do not chain")
    if b1 is not None and b1.shape != (w1.shape[0],):
        raise ValueError(f"ffn: b1 must have shape ({w1.shape[0]},), got {tuple(b1.shape)}")
    if x.dtype != wdtype:
        raise TypeError(f"ffn: x, w1, w2 are {x.dtype}, {w1.dtype}, {w2.dtype}; cast them alike (or use autocast)")
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w1, b1, w2))
    if not needs_grad:
        out = _ffn_fwd_op(x, *autocast_inputs(w1, b1, w2), approximate, False)[0]
        return (out, x_in) if residual else out
    out, passed = FfnFn.apply(x, w1, b1, w2, approximate)
    if not residual:
        return out
    return out, (passed if x is x_in else x_in)  # a cast copy of x must not stand in for x in the residual
