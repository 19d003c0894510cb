"""A linear layer whose weight-gradient GEMM also reduces the bias gradient: ``x @ weight.T + bias``.

torch's linear backward reduces d(bias) in a pass of its own over the output gradient (``grad.sum(0)``,
~50 us for BERT-large's QKV at 16K tokens on an H100); here cuBLASLt's BGRADB epilogue (ops/cublaslt.py,
``"bgrad_a"``) reduces it inside the weight-gradient GEMM, which reads that gradient anyway. The forward
and the input gradient are torch's. Without a bias, off CUDA, or with operands cuBLASLt cannot take
(fp32, sizes off a multiple of 8), it is ``F.linear`` itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastbert.ops import cublaslt
from fastbert.ops._common import autocast_dtype, register_op


def linear_bwd(dy, x, weight):
    """``(dx, dweight, dbias)`` of ``x @ weight.T + bias`` for the output gradient ``dy``."""
    n, k = weight.shape
    d2, x2 = dy.reshape(-1, n), x.reshape(-1, k)  # (M, out), (M, in)
    dx = (d2 @ weight).view(x.shape)
    if cublaslt.eligible(d2, x2, sizes=(n,)):
        dw, db = weight.new_empty((n, k)), weight.new_empty((n,))
        if cublaslt.gemm(d2.t(), x2, "bgrad_a", bias_grad=db, out=dw) is not None:
            return dx, dw, db
    return dx, d2.t() @ x2, d2.sum(0)


def _bwd_fake(dy, x, weight):
    return torch.empty_like(x), torch.empty_like(weight), weight.new_empty((weight.shape[0],))


_bwd_op = register_op("linear_bwd", "(Tensor dy, Tensor x, Tensor weight) -> (Tensor, Tensor, Tensor)",
                      linear_bwd, _bwd_fake)


class LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        return _bwd_op(dy.contiguous(), x, weight)


def linear(x, weight, bias=None):
    """``F.linear(x, weight, bias)``, with d(bias) reduced inside the weight-gradient GEMM on CUDA."""
    if bias is None or not x.is_cuda:
        return F.linear(x, weight, bias)
    cast = autocast_dtype(x.device)
    if cast is not None:  # custom autograd functions are opaque to autocast: cast as F.linear would
        x, weight, bias = x.to(cast), weight.to(cast), bias.to(cast)
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad)):
        return F.linear(x, weight, bias)
    return LinearFn.apply(x, weight, bias)
