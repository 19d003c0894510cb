"""Weight gradients added into their accumulators by the GEMMs that compute them.

With gradient accumulation, every micro-batch's weight gradient is added into ``.grad``. Through
autograd that is one more pass per parameter: the GEMM writes the gradient, then an addition reads it
and ``.grad`` and writes ``.grad`` again (for BERT-large, 1.3 GB of fp32 gradients read twice and written
twice a micro-batch, in ~400 small kernels). Inside :func:`accumulating` the fused ops whose backward
computes a weight gradient with a GEMM (``linear.py``, ``ffn.py``, ``fp8.py``) look up that weight's
buffer here when their forward runs; their backward then has the GEMM add its product into the buffer
(beta = 1: the buffer is read and written in the GEMM's epilogue, hidden behind its tensor-core work)
and hands autograd no gradient for that weight. So do the MLM decoder (``mlm_loss.py``) and the embedding
backward (``embeddings.py``: its atomics add into the word and position tables' fp32 buffers): for the
word table, which is the decoder's weight, both halves of the gradient then land in one buffer, with no
table-sized zeroed gradient, no addition of the two halves and no pass adding their sum into ``.grad``.

``training/cuda_graphs.py`` uses it while capturing a training step whose ``.grad`` it owns (gradient
accumulation with CUDA graphs): the buffers are the ``.grad`` tensors themselves, so a replay leaves
the micro-batch's gradients added in place. Nothing else enters the context, so every other caller
gets gradients from autograd as before.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

_BUFFERS: dict = {}  # id(parameter) -> (parameter, buffer), only inside accumulating()


@contextlib.contextmanager
def accumulating(buffers: dict):
    """Inside: a fused op's forward that takes a parameter in ``buffers`` (``{parameter: buffer}``; the
    buffer a contiguous tensor of the parameter's shape, fp32 or the parameter's dtype) makes its backward
    add that weight's gradient into the buffer and return no gradient for it."""
    if _BUFFERS:
        raise RuntimeError("grad_accum.accumulating() does not nest")
    for p, buf in buffers.items():
        if buf.shape != p.shape or not buf.is_contiguous() or buf.device != p.device:
            raise ValueError(f"grad_accum: the buffer of a {tuple(p.shape)} parameter must be a contiguous tensor "
                             f"of that shape on {p.device}, got {tuple(buf.shape)} on {buf.device}")
    _BUFFERS.update({id(p): (p, buf) for p, buf in buffers.items()})
    try:
        yield
    finally:
        _BUFFERS.clear()


def buffer_for(param: Optional[torch.Tensor], dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
    """The buffer ``param``'s weight gradient is to be added into, or None (outside :func:`accumulating`, a
    tensor that is not one of its parameters, or with ``dtype`` a buffer of another dtype: for an op that can
    add only in that dtype, which then returns its gradient to autograd)."""
    if not _BUFFERS or param is None:
        return None
    hit = _BUFFERS.get(id(param))
    buf = hit[1] if hit is not None and hit[0] is param else None
    return buf if buf is None or dtype is None or buf.dtype == dtype else None
