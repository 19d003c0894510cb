"""FFN up-projection with bias + GELU in the GEMM epilogue: ``gelu(x @ weight.T + bias)``.

``approximate`` is ``"none"`` (exact erf GELU, BERT's) or ``"tanh"``. This file holds the
plain-PyTorch reference; the Triton kernels live beside it.
"""
from __future__ import annotations

import torch.nn.functional as F


def linear_bias_gelu_ref(x, weight, bias, approximate="none"):
    """Reference. ``x``: ``(tokens, in)``, ``weight``: ``(out, in)``, ``bias``: ``(out,)``."""
    return F.gelu(F.linear(x, weight, bias), approximate=approximate)


# ============================================================================= Triton kernels
# Everything below is the fused path: a tiled GEMM (fp32 accumulation) whose epilogue adds the bias
# and applies GELU before the single store, so the (tokens, 4*hidden) pre-activation never makes a
# round trip through memory. With grad enabled the pre-activation is also stored (as eager torch
# keeps it) for the backward, whose elementwise GELU derivative is one fused kernel that also
# reduces d(bias); dgrad / wgrad are cuBLAS matmuls.
import torch  # noqa: E402

from fastbert.ops._common import (  # noqa: E402
    INTERPRET, autocast_dtype, check_triton_device, num_sms, register_op, tl, triton)

@triton.jit
def _tanh(u):
    # exp of -2|u| never overflows; odd symmetry restores the sign.
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(u >= 0, t, -t)


@triton.jit
def gelu(z, APPROX_TANH: tl.constexpr):
    """GELU in fp32: exact ``z * Phi(z)`` (0.70710678 = 1/sqrt(2)) or the tanh approximation
    (0.79788456 = sqrt(2/pi))."""
    if APPROX_TANH:
        t = _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
        return 0.5 * z * (1.0 + t)
    else:
        return 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))


@triton.jit
def gelu_grad(z, APPROX_TANH: tl.constexpr):
    """d gelu(z) / dz in fp32."""
    if APPROX_TANH:
        t = _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
        dt = 0.7978845608028654 * (1.0 + 0.134145 * z * z)
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * dt
    else:
        cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
        pdf = tl.exp(-0.5 * z * z) * 0.3989422804014327
        return cdf + z * pdf


@triton.jit
def mm_tile(A, B, pid_m, pid_n, M, N, K, stride_am, stride_ak, stride_bn, stride_bk,
            EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 tile ``A[pid_m rows] @ B[pid_n rows].T`` of A ``(M, K)`` and B ``(N, K)`` (B is a
    weight in nn.Linear layout). Rows past M / N wrap around (modulo) so the loads need no row
    masks; the caller masks the store."""
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


def matmul_configs(small):
    """Autotune space: H100 tiles for BERT GEMMs (M = tokens, N, K in 768..4096), each with the
    epilogue whole or in two column halves (fewer live registers beside the accumulator); one
    small tile under the interpreter, where every config would be executed on the CPU."""
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4, "SPLIT_EPILOGUE": split},
                              num_warps=4, num_stages=1) for split in (True,)]
    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split epilogue): the fastest of a wider sweep on
    # an H100 at 32768 x 768 -> 3072 and 32768 x 1024 -> 4096 (bf16).
    tiles = [(128, 256, 64, 8, 3, True), (128, 256, 64, 8, 4, True), (128, 256, 64, 8, 3, False),
             # 96 KiB of shared memory: two programs per SM, one's epilogue overlapping the other's loop
             (128, 128, 64, 4, 3, True), (256, 128, 64, 8, 3, False)]
    if small:
        tiles.append((64, 128, 64, 4, 4, True))
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "SPLIT_EPILOGUE": split},
                          num_warps=w, num_stages=st)
            for bm, bn, bk, w, st, split in tiles]


def input_precision(dtype):
    """fp32 inputs follow torch's TF32 switch for matmuls; 16-bit inputs are exact products anyway."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


@triton.jit
def _bias_gelu_store(z, BIAS, Y, Z, rows, cols, M, N, stride_ym, stride_zm,
                     HAS_BIAS: tl.constexpr, STORE_PRE: tl.constexpr, APPROX_TANH: tl.constexpr):
    if HAS_BIAS:
        z += tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)
    if STORE_PRE:
        tl.store(Z + rows64[:, None] * stride_zm + cols[None, :], z.to(Z.dtype.element_ty), mask=mask)
    y = gelu(z, APPROX_TANH)
    tl.store(Y + rows64[:, None] * stride_ym + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.autotune(configs=matmul_configs(small=True), key=["M_BUCKET", "N", "K", "STORE_PRE", "APPROX_TANH"])
@triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})
@triton.jit
def _linear_bias_gelu_kernel(X, W, BIAS, Y, Z, M, N, K, M_BUCKET,
                             stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_zm,
                             HAS_BIAS: tl.constexpr, STORE_PRE: tl.constexpr, APPROX_TANH: tl.constexpr,
                             INPUT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr, SPLIT_EPILOGUE: tl.constexpr):
    # Grouped tile order: GROUP_M row-tiles share their weight column-tiles in L2.
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % group_size
    pid_n = (pid % (GROUP_M * grid_n)) // group_size

    z = mm_tile(X, W, pid_m, pid_n, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                EVEN_K, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if SPLIT_EPILOGUE:
        # (BLOCK_M, BLOCK_N) -> two (BLOCK_M, BLOCK_N / 2) halves, finished one after the other
        halves = tl.permute(tl.reshape(z, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        z_lo, z_hi = tl.split(halves)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
        _bias_gelu_store(z_lo, BIAS, Y, Z, rows, cols, M, N, stride_ym, stride_zm, HAS_BIAS, STORE_PRE, APPROX_TANH)
        _bias_gelu_store(z_hi, BIAS, Y, Z, rows, cols + BLOCK_N // 2, M, N, stride_ym, stride_zm, HAS_BIAS,
                         STORE_PRE, APPROX_TANH)
    else:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        _bias_gelu_store(z, BIAS, Y, Z, rows, cols, M, N, stride_ym, stride_zm, HAS_BIAS, STORE_PRE, APPROX_TANH)


@triton.jit
def _gelu_bwd_kernel(DY, Z, DZ, DB_PART, M, N, rows_per_program, stride_dy, stride_z, stride_dz,
                     APPROX_TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dz = dy * gelu'(z) over a column strip of ``rows_per_program`` rows; the strip's column sums
    of dz (partial d(bias)) go to DB_PART[program_id(1)]."""
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
        dz = dy * gelu_grad(z, APPROX_TANH)
        tl.store(DZ + rows[:, None] * stride_dz + cols[None, :], dz.to(DZ.dtype.element_ty), mask=mask)
        acc += dz
    tl.store(DB_PART + tl.program_id(1) * N + cols, tl.sum(acc, axis=0), mask=col_mask)


# ============================================================================= host wrappers
def _check_approximate(approximate):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")


def linear_bias_gelu_fwd(x, weight, bias, approximate, store_pre):
    """``x (..., K) -> (y, z)``: y = gelu(x @ weight.T + bias) like x; z the pre-activation when
    ``store_pre`` (for the backward) else an empty tensor."""
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)  # (M, K)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    z = torch.empty((m, n) if store_pre else (0,), dtype=x.dtype, device=x.device)
    if m > 0 and n > 0:
        if k == 0:  # empty reduction: z = bias (no kernel for it)
            z0 = (bias if bias is not None else x.new_zeros(n)).float().expand(m, n)
            y.copy_(F.gelu(z0, approximate=approximate))
            if store_pre:
                z.copy_(z0)
        else:
            def grid(meta):
                return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
            _linear_bias_gelu_kernel[grid](
                x2, weight, bias, y, z, m, n, k, triton.next_power_of_2(m),
                x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), y.stride(0), n,
                HAS_BIAS=bias is not None, STORE_PRE=store_pre, APPROX_TANH=approximate == "tanh",
                INPUT_PRECISION=input_precision(x.dtype))
    out_shape = (*x.shape[:-1], n)
    return y.view(out_shape), z.view(out_shape) if store_pre else z


def gelu_bwd(dy, z, approximate, with_bias_grad=True):
    """``(dz, dbias)`` for ``y = gelu(z)``: dz like z, dbias the fp32 column sums of dz."""
    n = z.shape[-1]
    dy2 = dy.reshape(-1, n)
    z2 = z.reshape(-1, n)
    m = z2.shape[0]
    dz = torch.empty((m, n), dtype=z.dtype, device=z.device)
    block_n = min(triton.next_power_of_2(max(n, 1)), 256)
    block_m = 16
    grid_n = triton.cdiv(n, block_n)
    # Enough row strips to fill the GPU (several programs per SM), each a multiple of BLOCK_M rows.
    strips = max(1, min(triton.cdiv(m, block_m), triton.cdiv(num_sms(z.device) * 8, max(grid_n, 1))))
    rows_per_program = triton.cdiv(triton.cdiv(max(m, 1), strips), block_m) * block_m
    strips = max(1, triton.cdiv(m, rows_per_program))
    db_part = torch.zeros((strips, n), dtype=torch.float32, device=z.device)
    if m > 0 and n > 0:
        _gelu_bwd_kernel[(grid_n, strips)](
            dy2, z2, dz, db_part, m, n, rows_per_program, dy2.stride(0), z2.stride(0), n,
            APPROX_TANH=approximate == "tanh", BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
    return dz.view(z.shape), db_part.sum(0)


def linear_bias_gelu_bwd(dy, x, weight, bias, z, approximate):
    """``(dx, dweight, dbias)``; dbias is empty when ``bias`` is None."""
    k = x.shape[-1]
    n = weight.shape[0]
    dz, db = gelu_bwd(dy, z, approximate)
    dz2 = dz.reshape(-1, n)  # (M, N)
    dx = (dz2 @ weight).view(x.shape)  # (M, N) @ (N, K)
    dw = dz2.t() @ x.reshape(-1, k)  # (N, M) @ (M, K)
    db = db.to(bias.dtype) if bias is not None else weight.new_empty((0,))
    return dx, dw, db


def _fwd_fake(x, weight, bias, approximate, store_pre):
    out_shape = (*x.shape[:-1], weight.shape[0])
    y = x.new_empty(out_shape)
    return y, x.new_empty(out_shape) if store_pre else x.new_empty((0,))


def _bwd_fake(dy, x, weight, bias, z, approximate):
    db = torch.empty_like(bias) if bias is not None else weight.new_empty((0,))
    return torch.empty_like(x), torch.empty_like(weight), db


_fwd_op = register_op(
    "linear_bias_gelu_fwd",
    "(Tensor x, Tensor weight, Tensor? bias, str approximate, bool store_pre) -> (Tensor, Tensor)",
    linear_bias_gelu_fwd, _fwd_fake)
_bwd_op = register_op(
    "linear_bias_gelu_bwd",
    "(Tensor dy, Tensor x, Tensor weight, Tensor? bias, Tensor z, str approximate) -> (Tensor, Tensor, Tensor)",
    linear_bias_gelu_bwd, _bwd_fake)


# ============================================================================= autograd + entry point
class LinearBiasGeluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, approximate, store_pre):
        y, z = _fwd_op(x, weight, bias, approximate, store_pre)
        ctx.save_for_backward(x, weight, bias, z)
        ctx.approximate = approximate
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, z = ctx.saved_tensors
        dx, dw, db = _bwd_op(dy.contiguous(), x, weight, bias, z, ctx.approximate)
        return dx, dw, db if bias is not None else None, None, None


def linear_bias_gelu(x, weight, bias, approximate="none"):
    """Fused ``gelu(x @ weight.T + bias)``; same signature and semantics as :func:`linear_bias_gelu_ref`."""
    _check_approximate(approximate)
    check_triton_device(x, weight, bias)
    cast = autocast_dtype(x.device)
    if cast is not None:  # behave like F.linear under torch.autocast
        x, weight = x.to(cast), weight.to(cast)
        bias = bias.to(cast) if bias is not None else None
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"linear_bias_gelu: x (..., {x.shape[-1]}) does not match weight {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"linear_bias_gelu: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"linear_bias_gelu: x is {x.dtype} but weight is {weight.dtype}; cast one (or use autocast "
                        "outside the op)")
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if not needs_grad:
        return _fwd_op(x, weight, bias, approximate, False)[0]
    return LinearBiasGeluFn.apply(x, weight, bias, approximate, True)
