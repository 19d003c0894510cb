"""Fused ops, one file each (reference + Triton kernels), and the dispatch the model uses.

``get_ops("torch")`` returns the plain-PyTorch references; ``get_ops("triton")`` the fused kernels;
``resolve_kernels`` is the one rule for ``"auto"`` / unset. Triton is optional: every op file and its
reference import without it (``_common.py`` guards the one import), and ``get_ops("triton")`` without
it raises an error that says to ``pip install triton`` or use ``kernels="torch"``.
"""
from __future__ import annotations

import os
from typing import Callable, NamedTuple, Optional

import torch

KERNELS = ("torch", "triton")


def resolve_kernels(spec: Optional[str], device=None) -> str:
    """``"torch"`` or ``"triton"`` for a kernels setting: ``None`` / ``"auto"`` mean the fused Triton
    kernels on a CUDA device (when Triton is installed) and the torch references elsewhere.
    ``device``: the device the model runs on (a ``torch.device``, a string, or None for "CUDA when
    there is one")."""
    if spec in (None, "auto"):
        from fastbert.ops._common import HAS_TRITON
        cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
        return "triton" if cuda and HAS_TRITON else "torch"
    if spec not in KERNELS:
        raise ValueError(f"unknown kernels={spec!r}; use 'auto', 'torch' or 'triton'")
    return spec


class Ops(NamedTuple):
    embeddings: Callable
    dropout_add_layer_norm: Callable
    ffn: Callable  # the FFN without its output bias: gelu(x @ w1.T + b1) @ w2.T
    attention: Callable
    mlm_loss: Callable
    attention_qkvpacked: Callable  # attention on one (T, 3, nh, hd) tensor, gradient packed too
    linear_residual: Callable  # (F.linear(x, w, b), x): the residual's gradient joins dx inside its GEMM
    # the QKV projection + attention_qkvpacked as one op (its backward writes the bias gradient, or with FP8 the
    # gradient's FP8 operands), or None: the model composes linear_residual and attention_qkvpacked
    qkv_attention: Optional[Callable] = None


def get_ops(kernels: str) -> Ops:
    if kernels == "torch":
        from fastbert.ops.attention import varlen_attention_qkvpacked_ref, varlen_attention_ref
        from fastbert.ops.embeddings import bert_embeddings_ref
        from fastbert.ops.ffn import ffn_ref
        from fastbert.ops.layer_norm import dropout_add_layer_norm_ref
        from fastbert.ops.linear import linear_residual_ref
        from fastbert.ops.mlm_loss import sparse_mlm_loss_ref
        return Ops(bert_embeddings_ref, dropout_add_layer_norm_ref, ffn_ref,
                   varlen_attention_ref, sparse_mlm_loss_ref, varlen_attention_qkvpacked_ref, linear_residual_ref)
    if kernels == "triton":
        from fastbert.ops._common import require_triton
        require_triton()  # the one error naming the fix, before any kernel is asked for
        from fastbert.ops.attention import varlen_attention, varlen_attention_qkvpacked
        from fastbert.ops.embeddings import bert_embeddings, bert_embeddings_ref
        from fastbert.ops.ffn import ffn
        from fastbert.ops.layer_norm import dropout_add_layer_norm
        from fastbert.ops.linear import linear_residual
        from fastbert.ops.mlm_loss import sparse_mlm_loss
        from fastbert.ops.qkv_attention import qkv_attention
        # The fused embedding backward accumulates with atomics (not bitwise run to run): deterministic mode
        # (torch.use_deterministic_algorithms) takes the reference, whose index_add is deterministic there.
        embeddings = bert_embeddings_ref if torch.are_deterministic_algorithms_enabled() else bert_embeddings
        # FASTBERT_QKV_ATTENTION=0: the model composes the QKV projection and attention (benchmarks compare both)
        fused_qkv = qkv_attention if os.environ.get("FASTBERT_QKV_ATTENTION", "") != "0" else None
        return Ops(embeddings, dropout_add_layer_norm, ffn, varlen_attention, sparse_mlm_loss,
                   varlen_attention_qkvpacked, linear_residual, fused_qkv)
    raise ValueError(f"unknown kernels={kernels!r}; use 'torch' or 'triton'")
