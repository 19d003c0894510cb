"""Residual + bias + dropout + LayerNorm.

``out = LayerNorm(residual + dropout(x + x_bias))`` with fp32 statistics; with ``prenorm=True``
also returns the pre-norm sum (the residual stream of a Pre-LN block).

This file holds the plain-PyTorch reference first, then the Triton kernels, host wrappers
(``layer_norm_fwd`` / ``layer_norm_bwd``, registered as ``torch.ops.fastbert`` custom ops), the
``autograd.Function`` and the functional entry point ``dropout_add_layer_norm``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def dropout_add_layer_norm_ref(x, residual, weight, bias, eps, x_bias=None, dropout_p=0.0,
                               prenorm=False, seed=None, upcast=False):
    """Reference. ``x``, ``residual``: ``(..., hidden)``; ``residual`` and ``x_bias`` may be None.

    ``seed`` is accepted for signature parity with the fused op; the reference draws its dropout
    mask from torch's generator. With ``upcast`` the computation runs in fp32.
    """
    dtype = x.dtype
    if upcast:
        x, weight = x.float(), weight.float()
        bias = bias.float() if bias is not None else None
        residual = residual.float() if residual is not None else None
        x_bias = x_bias.float() if x_bias is not None else None
    if x_bias is not None:
        x = x + x_bias
    if dropout_p > 0.0:
        x = F.dropout(x, dropout_p, training=True)
    s = x if residual is None else residual + x
    out = F.layer_norm(s.float(), (s.shape[-1],), weight.float(), None if bias is None else bias.float(), eps)
    out = out.to(dtype)
    return (out, s.to(dtype)) if prenorm else out


# ============================================================================= Triton kernels
# Everything below is the fused path. The sum ``s = residual + dropout(x + x_bias)`` is formed in
# fp32. Two ways to the backward:
# - recompute (Post-LN): the backward forms s again from x and the residual (and draws the dropout mask
#   again from the seed), so the forward moves three tensors (x, residual in; y out), the minimum;
# - from the sum (``from_sum``: Pre-LN, which stores s anyway as its residual stream): the forward rounds s
#   to x's dtype before the statistics, as a same-dtype ``residual + x`` would be, and stores the dropout mask
#   as bits (one byte per 8 columns); the backward reads s and the bits instead of x and the residual: one
#   tensor less to read (-9 us of 150 a LayerNorm at BERT-large's 16,384 x 1,024 on an H100,
#   benchmarks/RESULTS.md), and x need not be kept. Post-LN would have to store s for it: no gain there.

from fastbert.ops._common import (  # noqa: E402
    bwd_row_partition, cdiv, check_dropout_p, check_hidden, check_triton_device, drop_threshold, dropout_bits,
    dropout_seed, fast_launch, keep_from_bits, register_op, row_block, sum_partials, tl, triton)


@triton.jit
def _prenorm_combine(x, res, xb, SEED, rows64, mask, N, threshold, scale,
                     HAS_RES: tl.constexpr, HAS_XB: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_N: tl.constexpr):
    """s = residual + dropout(x + x_bias) in fp32 for a (BLOCK_M, BLOCK_N) tile from its loaded rows (x, res in
    their storage dtypes; xb the fp32 bias row); also the keep mask and its ``dropout_bits`` (without dropout:
    the mask, and the mask in place of bits)."""
    s = x.to(tl.float32)
    if HAS_XB:
        s += xb[None, :]
    keep = mask
    bits = mask  # a placeholder: no bits without dropout
    if HAS_DROPOUT:
        bits = dropout_bits(tl.load(SEED), rows64, 0, N, threshold, BLOCK_N)
        keep = keep_from_bits(bits)
        s = tl.where(keep, s * scale, 0.0)
    if HAS_RES:
        s += res.to(tl.float32)
    return s, keep, bits


@triton.jit
def _prenorm_sum(X, RES, XB, rows64, cols, mask, col_mask, N, stride_x, stride_res, threshold, scale, SEED,
                 HAS_RES: tl.constexpr, HAS_XB: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_N: tl.constexpr):
    """:func:`_prenorm_combine` of a tile loaded here."""
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    res = 0.0
    if HAS_RES:
        res = tl.load(RES + rows64[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
    xb = 0.0
    if HAS_XB:
        xb = tl.load(XB + cols, mask=col_mask, other=0.0).to(tl.float32)
    return _prenorm_combine(x, res, xb, SEED, rows64, mask, N, threshold, scale, HAS_RES, HAS_XB, HAS_DROPOUT,
                            BLOCK_N)


@triton.jit
def _bits_ptrs(BITS, rows64, row_mask, N, BLOCK_N: tl.constexpr):
    """Pointers to the mask bytes of a tile's rows (``(M, ceil(N / 8))`` uint8, ``dropout_bits``' layout) and
    their mask."""
    nbytes = (N + 7) // 8
    j = tl.arange(0, BLOCK_N // 8)
    return BITS + rows64[:, None] * nbytes + j[None, :], row_mask[:, None] & (j[None, :] < nbytes)


@triton.jit
def layer_norm_stats(s, mask, N, eps):
    """LayerNorm statistics of a (BLOCK_M, BLOCK_N) fp32 tile of rows: the centred rows (0 where
    masked), mean and 1/std. The one copy of the forward row math (this file's and the embeddings')."""
    mean = tl.sum(s, axis=1) / N
    sc = tl.where(mask, s - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(sc * sc, axis=1) / N + eps)
    return sc, mean, rstd


@triton.jit
def layer_norm_bwd_rows(s, dy, w, mean, rstd, mask, N):
    """LayerNorm backward of a tile of rows: from the fp32 pre-norm rows ``s`` (recomputed), the fp32
    output gradient ``dy``, the weight ``w`` and the rows' stored statistics (fp32 ``(BLOCK_M,)``), the
    gradient of ``s`` and ``xhat`` (d(weight) sums ``dy * xhat``). The one copy of the backward row math (this
    file's and the embeddings')."""
    xhat = tl.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
    wdy = dy * w[None, :]
    c1 = tl.sum(xhat * wdy, axis=1) / N
    c2 = tl.sum(wdy, axis=1) / N
    return (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None], xhat


@fast_launch
@triton.jit(do_not_specialize=["M", "threshold"])
def _ln_fwd_kernel(X, RES, XB, W, B, Y, S, BITS, MEAN, RSTD,
                   M, N, stride_x, stride_res, stride_y, stride_s, eps, threshold, scale, SEED,
                   HAS_RES: tl.constexpr, HAS_XB: tl.constexpr, HAS_B: tl.constexpr,
                   HAS_DROPOUT: tl.constexpr, STORE_SUM: tl.constexpr, FROM_SUM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """FROM_SUM (with STORE_SUM): the statistics of s as stored (rounded to S's dtype), and the dropout
    mask's bits stored into BITS, for the backward to read."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    s, _, bits = _prenorm_sum(X, RES, XB, rows64, cols, mask, col_mask, N, stride_x, stride_res, threshold, scale,
                              SEED, HAS_RES, HAS_XB, HAS_DROPOUT, BLOCK_N)
    if STORE_SUM:
        s_stored = s.to(S.dtype.element_ty)
        tl.store(S + rows64[:, None] * stride_s + cols[None, :], s_stored, mask=mask)
        if FROM_SUM:
            s = s_stored.to(tl.float32)
            if HAS_DROPOUT:
                ptrs, bmask = _bits_ptrs(BITS, rows64, row_mask, N, BLOCK_N)
                tl.store(ptrs, bits, mask=bmask)
    sc, mean, rstd = layer_norm_stats(s, mask, N, eps)
    tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = sc * rstd[:, None] * w[None, :]
    if HAS_B:
        y += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_loads(DY, DS, X, RES, BITS, MEAN, RSTD, rows, row_end, cols, col_mask, N,
               stride_dy, stride_ds, stride_x, stride_res,
               HAS_DS: tl.constexpr, HAS_RES: tl.constexpr, HAS_DROPOUT: tl.constexpr, FROM_SUM: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """One strip's loads for the backward, in their storage dtypes: x (or the stored sum s), the residual (not
    FROM_SUM), the mask bits (FROM_SUM), dy, ds, mean and rstd (0.0 for what the case has not)."""
    row_mask = rows < row_end
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    res = 0.0
    bits = 0
    if FROM_SUM:
        if HAS_DROPOUT:
            ptrs, bmask = _bits_ptrs(BITS, rows64, row_mask, N, BLOCK_N)
            bits = tl.load(ptrs, mask=bmask, other=0)
    elif HAS_RES:
        res = tl.load(RES + rows64[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    ds = 0.0
    if HAS_DS:
        ds = tl.load(DS + rows64[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0)
    mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    return x, res, bits, dy, ds, mean, rstd


@fast_launch
@triton.jit(do_not_specialize=["M", "rows_per_program", "threshold"])
def _ln_bwd_kernel(DY, DS, X, RES, XB, W, BITS, MEAN, RSTD, DX, DRES, PART,
                   M, N, rows_per_program, stride_dy, stride_ds, stride_x, stride_res, stride_dx, stride_dres,
                   threshold, scale, SEED,
                   HAS_DS: tl.constexpr, HAS_RES: tl.constexpr, HAS_XB: tl.constexpr,
                   HAS_DROPOUT: tl.constexpr, STORE_DRES: tl.constexpr, FROM_SUM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Each program walks ``rows_per_program`` rows, BLOCK_M at a time, and writes its partial
    column sums for dweight / dbias [/ dx_bias] as one row of PART ``(programs, 2 or 3, N)``, which one
    reduction sums afterwards (deterministic, no atomics). FROM_SUM: X is the stored pre-norm sum and the
    dropout mask comes from BITS (RES is not read).

    The next strip's loads are issued before this strip's math (register prefetch): a program's loads no
    longer wait on its reductions, 23-34% off the kernel at BERT's sizes on an H200 (benchmarks/RESULTS.md,
    twenty-second session)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    xb = 0.0
    if HAS_XB:
        xb = tl.load(XB + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    dxb_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    nx, nres, nbits, ndy, nds, nmean, nrstd = _bwd_loads(
        DY, DS, X, RES, BITS, MEAN, RSTD, row_start + tl.arange(0, BLOCK_M), row_end, cols, col_mask, N,
        stride_dy, stride_ds, stride_x, stride_res, HAS_DS, HAS_RES, HAS_DROPOUT, FROM_SUM, BLOCK_N)
    for r in range(row_start, row_end, BLOCK_M):
        x, res, bits, dy, ds_in, mean, rstd = nx, nres, nbits, ndy, nds, nmean, nrstd
        rows = r + tl.arange(0, BLOCK_M)
        nx, nres, nbits, ndy, nds, nmean, nrstd = _bwd_loads(
            DY, DS, X, RES, BITS, MEAN, RSTD, rows + BLOCK_M, row_end, cols, col_mask, N,
            stride_dy, stride_ds, stride_x, stride_res, HAS_DS, HAS_RES, HAS_DROPOUT, FROM_SUM, BLOCK_N)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        if FROM_SUM:
            s = x.to(tl.float32)
            keep = mask
            if HAS_DROPOUT:
                keep = keep_from_bits(bits)
        else:
            s, keep, _ = _prenorm_combine(x, res, xb, SEED, rows64, mask, N, threshold, scale,
                                          HAS_RES, HAS_XB, HAS_DROPOUT, BLOCK_N)
        dy = dy.to(tl.float32)
        ds, xhat = layer_norm_bwd_rows(s, dy, w, mean, rstd, mask, N)
        if HAS_DS:
            ds += ds_in.to(tl.float32)
        if STORE_DRES:
            tl.store(DRES + rows64[:, None] * stride_dres + cols[None, :], ds.to(DRES.dtype.element_ty), mask=mask)
        dx = ds
        if HAS_DROPOUT:
            dx = tl.where(keep, ds * scale, 0.0)
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        db_acc += dy
        if HAS_XB:
            dxb_acc += dx
    part = PART + pid.to(tl.int64) * ((3 if HAS_XB else 2) * N) + cols
    tl.store(part, tl.sum(dw_acc, axis=0), mask=col_mask)
    tl.store(part + N, tl.sum(db_acc, axis=0), mask=col_mask)
    if HAS_XB:
        tl.store(part + 2 * N, tl.sum(dxb_acc, axis=0), mask=col_mask)


# ============================================================================= host wrappers
def _rows(t, n):
    """(..., n) -> (M, n) with unit column stride (a view when possible)."""
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 else t.contiguous()


def layer_norm_fwd(x, residual, weight, bias, eps, x_bias, dropout_p, seed, store_sum, from_sum):
    """Returns ``(y, s, mean, rstd, bits)``: y like x; s the pre-norm sum (x's dtype) when ``store_sum`` or
    ``from_sum``, else an empty tensor; mean, rstd fp32 ``(M,)``; with ``from_sum`` (the backward will read s,
    see above; x and the residual of one dtype) the statistics are those of s as stored and ``bits`` the
    dropout mask ``(M, ceil(N / 8))`` uint8 (empty without dropout or ``from_sum``)."""
    n = x.shape[-1]
    x2 = _rows(x, n)
    res2 = _rows(residual, n) if residual is not None else None
    m = x2.shape[0]
    store_sum = store_sum or from_sum
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    s = torch.empty((m, n) if store_sum else (0,), dtype=x.dtype, device=x.device)
    bits = torch.empty((m, (n + 7) // 8) if from_sum and dropout_p > 0.0 else (0,), dtype=torch.uint8,
                       device=x.device)
    mean = torch.empty((m,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m > 0:
        block_m, block_n, num_warps = row_block(n)
        _ln_fwd_kernel[(cdiv(m, block_m),)](
            x2, res2, x_bias, weight, bias, y, s, bits, mean, rstd,
            m, n, x2.stride(0), res2.stride(0) if res2 is not None else 0, y.stride(0), n,
            eps, drop_threshold(dropout_p), 1.0 / (1.0 - dropout_p), seed,
            HAS_RES=res2 is not None, HAS_XB=x_bias is not None, HAS_B=bias is not None,
            HAS_DROPOUT=dropout_p > 0.0, STORE_SUM=store_sum, FROM_SUM=from_sum,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return y.view(x.shape), s.view(x.shape) if store_sum else s, mean, rstd, bits


def layer_norm_bwd(dy, ds, x, residual, weight, bias, x_bias, mean, rstd, dropout_p, seed, bits, from_sum):
    """Returns ``(dx, dresidual, dweight, dbias, dx_bias)``. ``dresidual`` is empty when it equals
    ``dx`` (no dropout, same dtype: the caller reuses dx); ``dbias`` / ``dx_bias`` are empty
    when there is no such input. With ``from_sum`` (the forward's), ``x`` is the stored pre-norm sum and
    ``bits`` the forward's mask; the residual is then only looked at for its dtype."""
    n = x.shape[-1]
    x2 = _rows(x, n)
    dy2 = _rows(dy, n)
    ds2 = _rows(ds, n) if ds is not None else None
    res2 = _rows(residual, n) if residual is not None else None
    m = x2.shape[0]
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    store_dres = residual is not None and (dropout_p > 0.0 or residual.dtype != x.dtype)
    dres = torch.empty((m, n) if store_dres else (0,), dtype=residual.dtype if residual is not None else x.dtype,
                       device=x.device)
    block_m, block_n, num_warps, programs, rows_per_program = bwd_row_partition(m, n, x.device, elems_per_program=1024)
    # one partial-sum buffer and one reduction for all three column sums (three launches cost ~12 us more)
    part = torch.empty((programs, 3 if x_bias is not None else 2, n), dtype=torch.float32, device=x.device)
    if m > 0:
        _ln_bwd_kernel[(programs,)](
            dy2, ds2, x2, res2, x_bias, weight, bits, mean, rstd, dx, dres, part,
            m, n, rows_per_program, dy2.stride(0), ds2.stride(0) if ds2 is not None else 0, x2.stride(0),
            res2.stride(0) if res2 is not None else 0, n, n,
            drop_threshold(dropout_p), 1.0 / (1.0 - dropout_p), seed,
            HAS_DS=ds2 is not None, HAS_RES=res2 is not None, HAS_XB=x_bias is not None,
            HAS_DROPOUT=dropout_p > 0.0, STORE_DRES=store_dres, FROM_SUM=from_sum,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    else:
        part.zero_()
    dtypes = [weight.dtype, bias.dtype if bias is not None else weight.dtype]
    dw, db, *rest = sum_partials(part, dtypes + ([x_bias.dtype] if x_bias is not None else []))
    db = db if bias is not None else torch.empty((0,), dtype=weight.dtype, device=x.device)
    dxb = rest[0] if x_bias is not None else torch.empty((0,), dtype=x.dtype, device=x.device)
    return dx.view(x.shape), dres.view(x.shape) if store_dres else dres, dw, db, dxb


# ----------------------------------------------------------------------------- custom ops
def _fwd_fake(x, residual, weight, bias, eps, x_bias, dropout_p, seed, store_sum, from_sum):
    m = x.numel() // x.shape[-1] if x.dim() else 1
    s = torch.empty_like(x) if store_sum or from_sum else x.new_empty((0,))
    bits = x.new_empty((m, (x.shape[-1] + 7) // 8) if from_sum and dropout_p > 0.0 else (0,), dtype=torch.uint8)
    stats = x.new_empty((m,), dtype=torch.float32)
    return torch.empty_like(x), s, stats, stats.clone(), bits


def _bwd_fake(dy, ds, x, residual, weight, bias, x_bias, mean, rstd, dropout_p, seed, bits, from_sum):
    store_dres = residual is not None and (dropout_p > 0.0 or residual.dtype != x.dtype)
    dres = torch.empty_like(residual) if store_dres else x.new_empty((0,))
    db = torch.empty_like(bias) if bias is not None else weight.new_empty((0,))
    dxb = torch.empty_like(x_bias) if x_bias is not None else x.new_empty((0,))
    return torch.empty_like(x), dres, torch.empty_like(weight), db, dxb


_fwd_op = register_op(
    "dropout_add_layer_norm_fwd",
    "(Tensor x, Tensor? residual, Tensor weight, Tensor? bias, float eps, Tensor? x_bias, float dropout_p, "
    "Tensor? seed, bool store_sum, bool from_sum) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    layer_norm_fwd, _fwd_fake)
_bwd_op = register_op(
    "dropout_add_layer_norm_bwd",
    "(Tensor dy, Tensor? ds, Tensor x, Tensor? residual, Tensor weight, Tensor? bias, Tensor? x_bias, "
    "Tensor mean, Tensor rstd, float dropout_p, Tensor? seed, Tensor bits, bool from_sum) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    layer_norm_bwd, _bwd_fake)


# ============================================================================= autograd + entry point
class DropoutAddLayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, x_bias, dropout_p, prenorm, seed):
        ctx.set_materialize_grads(False)  # an unused pre-norm output costs no zeros tensor
        # Pre-LN's backward works from the stored sum (see the kernels' notes) where x and the residual share a
        # dtype (the sum is stored in x's).
        from_sum = prenorm and (residual is None or residual.dtype == x.dtype)
        y, s, mean, rstd, bits = _fwd_op(x, residual, weight, bias, eps, x_bias, dropout_p, seed, prenorm, from_sum)
        ctx.save_for_backward(s if from_sum else x, residual, weight, bias, x_bias, mean, rstd, bits)
        ctx.dropout_p, ctx.seed, ctx.prenorm, ctx.from_sum = dropout_p, seed, prenorm, from_sum
        if prenorm:
            return y, s
        return y

    @staticmethod
    def backward(ctx, dy, *rest):
        xs, residual, weight, bias, x_bias, mean, rstd, bits = ctx.saved_tensors
        ds = rest[0] if ctx.prenorm else None
        if dy is None:
            dy = torch.zeros_like(xs)
        dx, dres, dw, db, dxb = _bwd_op(dy.contiguous(), None if ds is None else ds.contiguous(), xs, residual,
                                        weight, bias, x_bias, mean, rstd, ctx.dropout_p, ctx.seed, bits,
                                        ctx.from_sum)
        if residual is None:
            dres = None
        elif dres.shape != residual.shape:
            dres = dx  # the kernel returns a placeholder when d(residual) == d(x) (no dropout, or no tokens)
        return (dx, dres, dw, db if bias is not None else None, None,
                dxb if x_bias is not None else None, None, None, None)


def dropout_add_layer_norm(x, residual, weight, bias, eps, x_bias=None, dropout_p=0.0, prenorm=False, seed=None):
    """Fused ``LayerNorm(residual + dropout(x + x_bias))``; same signature and semantics as
    :func:`dropout_add_layer_norm_ref` except that dropout draws a Philox mask from ``seed``
    (an int or tensor; ``None`` draws a fresh one, see ``_common.dropout_seed``). ``p == 0`` is exactly no
    dropout."""
    n = x.shape[-1]
    check_hidden(n, "dropout_add_layer_norm")
    check_dropout_p(dropout_p)
    check_triton_device(x, residual, weight, bias, x_bias)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"dropout_add_layer_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    for name, t in (("weight", weight), ("bias", bias), ("x_bias", x_bias)):
        if t is not None and t.shape != (n,):
            raise ValueError(f"dropout_add_layer_norm: {name} must have shape ({n},), got {tuple(t.shape)}")
    seed = dropout_seed(dropout_p, seed, x.device)
    return DropoutAddLayerNormFn.apply(x, residual, weight, bias, float(eps), x_bias, float(dropout_p),
                                       bool(prenorm), seed)
