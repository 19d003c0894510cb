"""The QKV projection and attention as one op: the attention backward writes what the projection's backward
needs besides its GEMMs.

``qkv_attention(x, weight, bias, num_heads, cu_seqlens, max_seqlen, ..., fp8=None)`` is
``varlen_attention_qkvpacked(linear(x, weight, bias).view(T, 3, nh, hd), ...)`` with x handed back for the
residual connection (as ``linear_residual``), ``linear`` being ``F.linear`` or, with ``fp8 = (history, rows)``,
``fp8_linear(x, weight, bias, history, rows)``.

16/32-bit: apart, the projection's backward sums its bias gradient over ``dqkv`` in a pass of its own (a GEMM with a
row of ones: 100 MB read, ~40 us a layer at BERT-large's 16,384 x 3,072 on an H100); here, on sequences over 128
tokens (``attention.extras_pay``), the attention backward kernels sum each tile they store from their fp32
accumulators (a row of partial sums a program, then one small reduction: ``attention._backward_packed(...,
colsums=True)``), 33 us a layer less at 32 x 512 tokens. On shorter ones the fused short kernel's sums cost
more than the GEMM (+7.5 us a layer on full 128-token rows, measured before that kernel became persistent), so
the GEMM stays. The input and weight gradients are ``linear_residual``'s GEMMs.

FP8: apart, the attention backward writes ``dqkv`` in 16 bits and the projection's backward casts it to e5m2 in a
pass of its own (scale, codes, transposed codes, amax, the bias gradient's column sums): ~100 us a layer at
BERT-large's sizes. Together, the backward kernels store the codes, the amax and the column sums from their fp32
accumulators (``attention._backward_packed(..., fp8=...)``), and a pass that only transposes the codes
(``fp8.transpose_codes``, half the bytes of the cast) replaces the cast. The values cast are the same gradients,
rounded once to fp8 instead of first to 16 bits. The FP8 backward takes the two-pass way where that measured faster
(``attention.extras_pay``: sequences up to 128 tokens, whose fused short kernel exposes the statistics'
reductions) and at the first backward of a history row (no amax recorded yet, ``AmaxHistory.primed``), which
measures the gradient before casting it (just-in-time scaling, as ``fp8.cast_fp8``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastbert.ops import attention, grad_accum, linear
from fastbert.ops._common import INTERPRET, autocast_dtype, autocast_inputs, check_dropout_p
from fastbert.ops.fp8 import E5M2, _aligned, cast_fp8, fp8_linear, linear_backward, linear_forward


def _keep(ctx, weight, num_heads: int, args: tuple):
    """What both forwards keep besides their tensors: the head count, the attention's (max_seqlen, dropout_p,
    softmax_scale), the weight's accumulation buffer; an unused second output gives the backward dres None, not
    a tensor of zeros."""
    ctx.num_heads, ctx.args = num_heads, args
    ctx.wacc = grad_accum.buffer_for(weight) if ctx.needs_input_grad[1] else None
    ctx.set_materialize_grads(False)


def _heads(qkv, num_heads: int):
    """q, k, v: ``(T, nh, hd)`` views of the projection's ``(T, 3 nh hd)`` output."""
    return qkv.view(qkv.shape[0], 3, num_heads, qkv.shape[1] // (3 * num_heads)).unbind(1)  # no -1: T may be 0


class _QkvAttention(torch.autograd.Function):
    """16/32-bit ``(attention(x2 @ W^T + b), x2)`` on ``(T, hidden)`` rows; the context comes out ``(T, nh, hd)``.
    Takes the parameters themselves and casts them inside, as ``linear.LinearResidualFn``."""

    @staticmethod
    def forward(ctx, x2, weight, bias, num_heads, cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed):
        w, b = autocast_inputs(weight, bias)
        qkv = F.linear(x2, w, b)
        q, k, v = _heads(qkv, num_heads)
        out, lse, mask = attention._fwd_op(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed)
        ctx.save_for_backward(x2, w, qkv, out, lse, mask, cu_seqlens)
        _keep(ctx, weight, num_heads, (max_seqlen, dropout_p, softmax_scale))
        ctx.wdtype = weight.dtype  # the gradients' dtype, the bias's too (as linear_residual's)
        ctx.bias_grad = bias is not None and ctx.needs_input_grad[2]  # no sums for a frozen bias
        return out, x2

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dres):
        if dout is None:  # only the residual's gradient arrived
            return (dres,) + (None,) * 8
        x2, w, qkv, out, lse, mask, cu_seqlens = ctx.saved_tensors
        q, k, v = _heads(qkv, ctx.num_heads)
        args = (dout, q, k, v, out, lse, mask, cu_seqlens, *ctx.args)
        dres = dres.contiguous() if dres is not None else None
        if ctx.bias_grad and attention.extras_pay(q.shape[-1], ctx.args[0]):  # the kernels sum the bias gradient
            dqkv, db = attention.bwd_colsums_op(*args)
            dx, dw, _ = linear._bwd_op(dqkv.view(qkv.shape), dres, x2, w, False, ctx.wdtype, ctx.wacc)
            db = db.to(ctx.wdtype)
        else:  # linear_residual's backward, its bias gradient included
            dqkv = attention._bwd_op(*args)
            dx, dw, db = linear._bwd_op(dqkv.view(qkv.shape), dres, x2, w, ctx.bias_grad, ctx.wdtype, ctx.wacc)
        return dx, dw if ctx.wacc is None else None, db if ctx.bias_grad else None, *(None,) * 6


class _Fp8QkvAttention(torch.autograd.Function):
    """``(attention(x2 @ W^T + b), x2)`` on ``(T, hidden)`` rows; the context comes out ``(T, nh, hd)``."""

    @staticmethod
    def forward(ctx, x2, weight, bias, history, rows, num_heads, cu_seqlens, max_seqlen, dropout_p, softmax_scale,
                seed, out_dtype):
        qkv, saved = linear_forward(x2, weight, bias, history, rows, out_dtype)
        q, k, v = _heads(qkv, num_heads)
        out, lse, mask = attention._fwd_op(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed)
        ctx.save_for_backward(*saved, qkv, out, lse, mask, cu_seqlens)
        _keep(ctx, weight, num_heads, (max_seqlen, dropout_p, softmax_scale))
        ctx.history, ctx.rows = history, rows
        ctx.dtypes = (x2.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return out, x2

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dres):
        if dout is None:  # only the residual's gradient arrived
            return (dres,) + (None,) * 11
        *saved, qkv, out, lse, mask, cu_seqlens = ctx.saved_tensors
        q, k, v = _heads(qkv, ctx.num_heads)
        row = ctx.rows + 2  # the output gradient's history row
        if row in ctx.history.primed and attention.extras_pay(q.shape[-1], ctx.args[0]):
            cast = attention._backward_packed(dout, q, k, v, out, lse, mask, cu_seqlens, *ctx.args,
                                              fp8=(ctx.history, row))
        else:  # 16-bit gradients, then the cast (the row's first backward: measured first, ``cast_fp8`` primes it)
            dqkv = attention._bwd_op(dout, q, k, v, out, lse, mask, cu_seqlens, *ctx.args)
            cast = cast_fp8(dqkv.view(qkv.shape), ctx.history, row, E5M2, colsum=ctx.dtypes[2] is not None)
        return (*linear_backward(saved, ctx.dtypes, *cast, dres, ctx.wacc), *(None,) * 9)


def qkv_attention(x: torch.Tensor, weight: torch.Tensor, bias, num_heads: int, cu_seqlens: torch.Tensor,
                  max_seqlen: int, dropout_p: float = 0.0, softmax_scale=None, seed=None, fp8=None):
    """``(context (T, nh, hd), x)``: the fused attention of the QKV projection ``F.linear(x, weight, bias)`` of x
    ``(T, hidden)`` (``weight``: ``cat(query, key, value)``), and x for the residual connection. ``fp8`` =
    ``(history, rows)``: the projection is ``fp8_linear(x, weight, bias, history, rows)`` (``rows``: its first
    history row). Where the fused op cannot run, the composition does (``linear_residual`` or ``fp8_linear``, then
    ``varlen_attention_qkvpacked``): shapes ``_scaled_mm`` cannot take (FP8), x outside autocast's dtype under
    autocast (16-bit: a cast copy could not stand in for x in the residual), a head_dim the kernels cannot take,
    or a CPU tensor outside Triton's interpreter."""
    tokens, hidden = x.shape
    head_dim = weight.shape[0] // (3 * num_heads)
    out_dtype = autocast_dtype(x.device)
    fits = _aligned(tokens, *weight.shape) if fp8 is not None else out_dtype in (None, x.dtype)
    if not (fits and head_dim <= 128 and (x.is_cuda or INTERPRET)):
        if fp8 is not None:
            qkv, x = fp8_linear(x, weight, bias, *fp8, residual=True)
        else:
            qkv, x = linear.linear_residual(x, weight, bias)
        return attention.varlen_attention_qkvpacked(qkv.view(tokens, 3, num_heads, head_dim), cu_seqlens, max_seqlen,
                                                    dropout_p, softmax_scale, seed), x
    attention.check_cu_seqlens(cu_seqlens)
    check_dropout_p(dropout_p)
    scale, seed = attention._scale_and_seed(head_dim, softmax_scale, dropout_p, seed, x.device)
    if fp8 is None:
        return _QkvAttention.apply(x, weight, bias, num_heads, cu_seqlens, max_seqlen, float(dropout_p), scale, seed)
    with torch.autocast(x.device.type, enabled=False):
        return _Fp8QkvAttention.apply(x, weight, bias, *fp8, num_heads, cu_seqlens, max_seqlen, float(dropout_p),
                                      scale, seed, out_dtype or x.dtype)
