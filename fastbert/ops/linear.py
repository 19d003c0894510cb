"""A linear layer that also hands its input on: ``(x @ weight.T + bias, x)``.

When x feeds both this layer and a residual connection (Post-LN BERT's layer input: the QKV projection
and the attention block's residual add), autograd adds the two gradients of x in a kernel of its own, one
more pass over a ``(tokens, hidden)`` tensor. Here the residual connection takes x from the second
output, and the backward adds the gradient arriving there inside the input-gradient GEMM
(``cublaslt.addmm``: beta = 1, the added matrix read by the GEMM). Otherwise it is ``F.linear``: the same
GEMMs, the same bias reduction.

Master weights (fp32 parameters under 16-bit autocast): the fused ops here and in ``ffn.py`` take the
parameters themselves and cast them inside, so autograd records no cast, and :func:`wgrad` writes each
weight gradient in the parameter's dtype straight from the GEMM's fp32 accumulator (``torch.mm``'s
``out_dtype`` on CUDA). Autocast's way rounds it to 16 bits and then casts it back up to fp32 in a
kernel of its own, one more pass over every weight gradient of the step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastbert.ops import cublaslt, grad_accum
from fastbert.ops._common import autocast_dtype, autocast_inputs, register_op


def linear_residual_ref(x, weight, bias=None):
    """Reference: ``(F.linear(x, weight, bias), x)``."""
    return F.linear(x, weight, bias), x


# torch >= 2.8: mm with out_dtype (CUDA, 16-bit inputs to fp32)
_MM_OUT_DTYPE = hasattr(getattr(torch.ops.aten, "mm", None), "dtype")


def _mm_writes(t, dtype) -> bool:
    """Whether ``torch.mm(..., out_dtype=dtype)`` can take ``t``: a 16-bit CUDA tensor, ``dtype`` its own or fp32
    (the GEMM's fp32 accumulator written straight out)."""
    return (t.is_cuda and _MM_OUT_DTYPE and t.dtype in (torch.float16, torch.bfloat16)
            and dtype in (t.dtype, torch.float32))


def wgrad(dy2, x2, dtype, acc=None):
    """The weight gradient ``dy2ᵀ @ x2`` ``(out, in)`` in ``dtype``, the parameter's own: a 16-bit GEMM's fp32
    accumulator written straight out as fp32 on CUDA, else rounded and cast. With ``acc`` (the weight's buffer,
    ``ops/grad_accum.py``) the gradient is added into it, inside the GEMM where cuBLASLt can, and None returned."""
    if acc is not None:
        if not cublaslt.accumulate(acc, dy2.t(), x2):
            acc.add_(wgrad(dy2, x2, acc.dtype))
        return None
    if dtype == dy2.dtype:
        return dy2.t() @ x2
    if _mm_writes(dy2, dtype):
        return torch.mm(dy2.t(), x2, out_dtype=dtype)
    return (dy2.t() @ x2).to(dtype)


def linear_grads(dy, x, weight, dres=None, wdtype=None, wacc=None):
    """``(dx, dweight)`` of ``x @ weight.T`` for the output gradient ``dy`` ``(..., out)``. ``dres``: a gradient
    of x that arrived another way (the residual's), or None; it is added to dx inside dx's GEMM. ``wdtype``:
    dweight's dtype (the master weight's; None: weight's). ``wacc``: dweight's accumulator (:func:`wgrad`);
    dweight is then None."""
    n, k = weight.shape
    d2, x2 = dy.reshape(-1, n), x.reshape(-1, k)  # (M, out), (M, in)
    dx = cublaslt.addmm(dres.reshape(-1, k), d2, weight) if dres is not None else d2 @ weight
    return dx.view(x.shape), wgrad(d2, x2, wdtype or weight.dtype, wacc)


def bias_grad(dy2, dtype):
    """The bias gradient: ``dy2``'s column sums, accumulated and returned in ``dtype`` (the bias's own). On CUDA a
    16-bit ``dy2`` goes through a GEMM with a row of ones (fp32 accumulator, written in ``dtype``): torch's column
    sum of a row-major matrix runs at 0.8-1.9 TB/s on an H100, the GEMM at 1.5-2.3 (benchmarks/RESULTS.md)."""
    if _mm_writes(dy2, dtype):
        return torch.mm(dy2.new_ones((1, dy2.shape[0])), dy2, out_dtype=dtype).view(-1)
    return dy2.sum(0, dtype=dtype) if dtype != dy2.dtype else dy2.sum(0)


def linear_residual_bwd(dy, dres, x, weight, has_bias: bool, wdtype: torch.dtype, wacc=None):
    """``(dx, dweight, dbias)`` for the output gradient ``dy`` and the residual's ``dres`` (or None); dweight
    and dbias in ``wdtype`` (the parameters'); dbias is empty without a bias. ``wacc``: dweight's accumulator
    (:func:`wgrad`), dweight then empty."""
    dx, dw = linear_grads(dy, x, weight, dres, wdtype, wacc)
    db = bias_grad(dy.reshape(-1, weight.shape[0]), wdtype) if has_bias else weight.new_empty((0,), dtype=wdtype)
    return dx, dw if dw is not None else weight.new_empty((0,), dtype=wdtype), db


def _bwd_fake(dy, dres, x, weight, has_bias, wdtype, wacc=None):
    return (torch.empty_like(x), weight.new_empty(weight.shape if wacc is None else (0,), dtype=wdtype),
            weight.new_empty((weight.shape[0] if has_bias else 0,), dtype=wdtype))


_bwd_op = register_op(
    "linear_residual_bwd",
    "(Tensor dy, Tensor? dres, Tensor x, Tensor weight, bool has_bias, ScalarType wdtype, Tensor(a!)? wacc) "
    "-> (Tensor, Tensor, Tensor)", linear_residual_bwd, _bwd_fake)


class LinearResidualFn(torch.autograd.Function):
    """Takes the parameters themselves (fp32 masters under autocast) and casts them inside (see the module's
    docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        w, b = autocast_inputs(weight, bias)
        ctx.save_for_backward(x, w)
        ctx.bias_grad, ctx.wdtype = ctx.needs_input_grad[2], weight.dtype  # no reduction for a frozen bias
        ctx.wacc = grad_accum.buffer_for(weight) if ctx.needs_input_grad[1] else None
        ctx.set_materialize_grads(False)  # an unused second output gives dres None, not a tensor of zeros
        return F.linear(x, w, b), x

    @staticmethod
    def backward(ctx, dy, dres):
        x, weight = ctx.saved_tensors
        if dy is None:
            dy = x.new_zeros((*x.shape[:-1], weight.shape[0]))
        dres = dres.contiguous() if dres is not None else None
        dx, dw, db = _bwd_op(dy.contiguous(), dres, x, weight, ctx.bias_grad, ctx.wdtype, ctx.wacc)
        return dx, dw if ctx.wacc is None else None, db if ctx.bias_grad else None


def linear_residual(x, weight, bias=None):
    """``(F.linear(x, weight, bias), x)``; a gradient reaching the second output joins the input gradient
    inside its GEMM. Under autocast x must already be in the autocast dtype for that (a cast copy cannot
    stand in for x in the residual); otherwise the two gradients meet as usual."""
    cast = autocast_dtype(x.device)
    if cast is not None and x.dtype != cast:
        return F.linear(x, weight, bias), x
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))):
        return F.linear(x, weight, bias), x
    return LinearResidualFn.apply(x, weight, bias)
