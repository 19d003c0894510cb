"""The QKV projection and attention as one FP8 op: the attention backward writes the projection's FP8
gradient operands itself.

``fp8_qkv_attention(x, weight, bias, history, rows, num_heads, cu_seqlens, max_seqlen, ...)`` is
``varlen_attention_qkvpacked(fp8_linear(x, weight, bias, history, rows).view(T, 3, nh, hd), ...)`` with x
handed back for the residual connection (as ``fp8_linear(..., residual=True)``). Apart, the attention
backward writes ``dqkv`` in 16 bits and the projection's backward casts it to e5m2 in a pass of its own
(scale, codes, transposed codes, amax, the bias gradient's column sums): ~100 us a layer at BERT-large's
16,384 x 3,072 on an H100. Together, the backward kernels store the codes, the amax and the column sums from
their fp32 accumulators (``attention._backward_packed(..., fp8=...)``), and a pass that only transposes the
codes (``fp8.transpose_codes``, half the bytes of the cast) replaces the cast. The values cast are the same
gradients, rounded once to fp8 instead of first to 16 bits.

The backward takes the two-pass way where that measured faster (``attention.fp8_output_pays``: sequences up to
128 tokens, whose fused short kernel exposes the statistics' reductions) and at the first backward of a history
row (no amax recorded yet, ``AmaxHistory.primed``), which measures the gradient before casting it (just-in-time
scaling, as ``fp8.cast_fp8``).
"""
from __future__ import annotations

import torch

from fastbert.ops import attention, grad_accum
from fastbert.ops._common import INTERPRET, autocast_dtype, check_dropout_p
from fastbert.ops.fp8 import E5M2, AmaxHistory, _aligned, cast_fp8, fp8_linear, linear_backward, linear_forward


class _Fp8QkvAttention(torch.autograd.Function):
    """``(attention(x2 @ W^T + b), x2)`` on ``(T, hidden)`` rows; the context comes out ``(T, nh, hd)``."""

    @staticmethod
    def forward(ctx, x2, weight, bias, history, rows, num_heads, cu_seqlens, max_seqlen, dropout_p, softmax_scale,
                seed, out_dtype):
        qkv, saved = linear_forward(x2, weight, bias, history, rows, out_dtype)
        q, k, v = qkv.view(qkv.shape[0], 3, num_heads, -1).unbind(1)
        out, lse, mask = attention._fwd_op(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed)
        ctx.save_for_backward(*saved, qkv, out, lse, mask, cu_seqlens)
        ctx.history, ctx.rows, ctx.num_heads = history, rows, num_heads
        ctx.args = (max_seqlen, dropout_p, softmax_scale)
        ctx.dtypes = (x2.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.wacc = grad_accum.buffer_for(weight) if ctx.needs_input_grad[1] else None
        ctx.set_materialize_grads(False)
        return out, x2

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dres):
        if dout is None:  # only the residual's gradient arrived
            return (dres,) + (None,) * 11
        *saved, qkv, out, lse, mask, cu_seqlens = ctx.saved_tensors
        q, k, v = qkv.view(qkv.shape[0], 3, ctx.num_heads, -1).unbind(1)
        row = ctx.rows + 2  # the output gradient's history row
        if row in ctx.history.primed and attention.fp8_output_pays(q.shape[-1], ctx.args[0]):
            cast = attention._backward_packed(dout, q, k, v, out, lse, mask, cu_seqlens, *ctx.args,
                                              fp8=(ctx.history, row))
        else:  # 16-bit gradients, then the cast (the row's first backward: measured first, ``cast_fp8`` primes it)
            dqkv = attention._bwd_op(dout, q, k, v, out, lse, mask, cu_seqlens, *ctx.args)
            cast = cast_fp8(dqkv.view(qkv.shape), ctx.history, row, E5M2, colsum=ctx.dtypes[2] is not None)
        return (*linear_backward(saved, ctx.dtypes, *cast, dres, ctx.wacc), *(None,) * 9)


def fp8_qkv_attention(x: torch.Tensor, weight: torch.Tensor, bias, history: AmaxHistory, rows: int, num_heads: int,
                      cu_seqlens: torch.Tensor, max_seqlen: int, dropout_p: float = 0.0, softmax_scale=None,
                      seed=None):
    """``(context (T, nh, hd), x)``: the fused attention of the FP8 QKV projection ``fp8_linear(x, weight, bias,
    history, rows)`` of ``x`` ``(T, hidden)`` (``weight``: ``cat(query, key, value)``; ``rows``: the projection's
    first history row), and x for the residual connection. Shapes ``_scaled_mm`` cannot take (or a head_dim
    the kernels cannot) go through ``fp8_linear`` and ``varlen_attention_qkvpacked``, as does a CPU tensor
    outside Triton's interpreter."""
    tokens, hidden = x.shape
    head_dim = weight.shape[0] // (3 * num_heads)
    if not (_aligned(tokens, *weight.shape) and head_dim <= 128 and (x.is_cuda or INTERPRET)):
        qkv, x = fp8_linear(x, weight, bias, history, rows, residual=True)
        return attention.varlen_attention_qkvpacked(qkv.view(tokens, 3, num_heads, head_dim), cu_seqlens, max_seqlen,
                                                    dropout_p, softmax_scale, seed), x
    attention.check_cu_seqlens(cu_seqlens)
    check_dropout_p(dropout_p)
    scale, seed = attention._scale_and_seed(head_dim, softmax_scale, dropout_p, seed, x.device)
    out_dtype = autocast_dtype(x.device) or x.dtype
    with torch.autocast(x.device.type, enabled=False):
        return _Fp8QkvAttention.apply(x, weight, bias, history, rows, num_heads, cu_seqlens, max_seqlen,
                                      float(dropout_p), scale, seed, out_dtype)
