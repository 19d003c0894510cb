"""The encoder's linear layers, ``x @ weight.T + bias``, on cuBLASLt (ops/cublaslt.py): its fastest
algorithm for each of the three GEMMs (timed once per shape), and d(bias) from the weight-gradient GEMM's
BGRADB epilogue instead of torch's separate ``grad.sum(0)``. Off CUDA it is ``F.linear`` itself; operands
cuBLASLt cannot take (fp32, sizes off a multiple of 8) get torch's GEMMs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastbert.ops import cublaslt
from fastbert.ops._common import autocast_dtype, register_op


def linear_fwd(x, weight, bias):
    return cublaslt.linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


def linear_bwd(dy, x, weight, has_bias: bool):
    """``(dx, dweight, dbias)`` of ``x @ weight.T + bias`` for the output gradient ``dy``; dbias is empty
    without a bias."""
    n, k = weight.shape
    d2, x2 = dy.reshape(-1, n), x.reshape(-1, k)  # (M, out), (M, in)
    dx = cublaslt.matmul(d2, weight).view(x.shape)
    if not has_bias:
        return dx, cublaslt.matmul(d2.t(), x2), weight.new_empty((0,))
    if cublaslt.eligible(d2.t(), x2, sizes=(n,)):
        dw, db = weight.new_empty((n, k)), weight.new_empty((n,))
        if cublaslt.gemm(d2.t(), x2, "bgrad_a", bias_grad=db, out=dw) is not None:
            return dx, dw, db
    return dx, d2.t() @ x2, d2.sum(0)


def _fwd_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _bwd_fake(dy, x, weight, has_bias):
    return torch.empty_like(x), torch.empty_like(weight), weight.new_empty((weight.shape[0] if has_bias else 0,))


_fwd_op = register_op("linear_fwd", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor", linear_fwd, _fwd_fake)
_bwd_op = register_op("linear_bwd", "(Tensor dy, Tensor x, Tensor weight, bool has_bias) -> (Tensor, Tensor, Tensor)",
                      linear_bwd, _bwd_fake)


class LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _fwd_op(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, dw, db = _bwd_op(dy.contiguous(), x, weight, ctx.has_bias)
        return dx, dw, db if ctx.has_bias else None


def linear(x, weight, bias=None):
    """``F.linear(x, weight, bias)`` on cuBLASLt's fastest algorithms (CUDA; else F.linear itself)."""
    if not x.is_cuda:
        return F.linear(x, weight, bias)
    cast = autocast_dtype(x.device)
    if cast is not None:  # custom autograd functions are opaque to autocast: cast as F.linear would
        x, weight = x.to(cast), weight.to(cast)
        bias = bias.to(cast) if bias is not None else None
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))):
        return _fwd_op(x, weight, bias)
    return LinearFn.apply(x, weight, bias)
