"""A linear layer that also hands its input on: ``(x @ weight.T + bias, x)``.

When x feeds both this layer and a residual connection (Post-LN BERT's layer input: the QKV projection
and the attention block's residual add), autograd adds the two gradients of x in a kernel of its own, one
more pass over a ``(tokens, hidden)`` tensor. Here the residual connection takes x from the second
output, and the backward adds the gradient arriving there inside the input-gradient GEMM
(``cublaslt.addmm``: beta = 1, the added matrix read by the GEMM). Otherwise it is ``F.linear``: the same
GEMMs, the same bias reduction.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastbert.ops import cublaslt
from fastbert.ops._common import autocast_dtype, autocast_inputs, register_op


def linear_residual_ref(x, weight, bias=None):
    """Reference: ``(F.linear(x, weight, bias), x)``."""
    return F.linear(x, weight, bias), x


def linear_grads(dy, x, weight, dres=None):
    """``(dx, dweight)`` of ``x @ weight.T`` for the output gradient ``dy`` ``(..., out)``. ``dres``: a gradient
    of x that arrived another way (the residual's), or None; it is added to dx inside dx's GEMM."""
    n, k = weight.shape
    d2, x2 = dy.reshape(-1, n), x.reshape(-1, k)  # (M, out), (M, in)
    dx = cublaslt.addmm(dres.reshape(-1, k), d2, weight) if dres is not None else d2 @ weight
    return dx.view(x.shape), d2.t() @ x2


def linear_residual_bwd(dy, dres, x, weight, has_bias: bool):
    """``(dx, dweight, dbias)`` for the output gradient ``dy`` and the residual's ``dres`` (or None);
    dbias is empty without a bias."""
    dx, dw = linear_grads(dy, x, weight, dres)
    return dx, dw, dy.reshape(-1, weight.shape[0]).sum(0) if has_bias else weight.new_empty((0,))


def _bwd_fake(dy, dres, x, weight, has_bias):
    return torch.empty_like(x), torch.empty_like(weight), weight.new_empty((weight.shape[0] if has_bias else 0,))


_bwd_op = register_op(
    "linear_residual_bwd",
    "(Tensor dy, Tensor? dres, Tensor x, Tensor weight, bool has_bias) -> (Tensor, Tensor, Tensor)",
    linear_residual_bwd, _bwd_fake)


class LinearResidualFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias), x

    @staticmethod
    def backward(ctx, dy, dres):
        x, weight = ctx.saved_tensors
        dres = dres.contiguous() if dres is not None else None
        dx, dw, db = _bwd_op(dy.contiguous(), dres, x, weight, ctx.has_bias)
        return dx, dw, db if ctx.has_bias else None


def linear_residual(x, weight, bias=None):
    """``(F.linear(x, weight, bias), x)``; a gradient reaching the second output joins the input gradient
    inside its GEMM. Under autocast x must already be in the autocast dtype for that (a cast copy cannot
    stand in for x in the residual); otherwise the two gradients meet as usual."""
    cast = autocast_dtype(x.device)
    if cast is not None and x.dtype != cast:
        return F.linear(x, weight, bias), x
    weight, bias = autocast_inputs(weight, bias)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))):
        return F.linear(x, weight, bias), x
    return LinearResidualFn.apply(x, weight, bias)
