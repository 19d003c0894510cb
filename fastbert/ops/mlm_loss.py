"""Sparse MLM loss: predict only the masked positions, never holding (tokens x vocab) logits in full.

``hidden``: ``(tokens, hidden)``; ``labels``: ``(tokens,)`` with ``ignore_index`` (-100) where no
prediction is wanted. The head is BERT's: dense + GELU + LayerNorm, then a decoder tied to the
word embeddings plus a bias, then cross-entropy. Returns ``(loss, num_correct, num_predicted)``;
``loss`` is the mean over predicted positions (0 when there are none).

Static shapes (``positions`` given): ``labels`` is then ``(slots,)``, the targets of the rows
``hidden[positions]``, with ``ignore_index`` in unused slots. The number of slots is fixed per
batch (the masking collator's capacity), so nothing waits on the device: no ``nonzero``, no check
of label values, the same kernel shapes every step (tuned once, capturable in a CUDA graph).

This file holds the plain-PyTorch reference first, then the Triton kernel and host wrappers
(``linear_cross_entropy_fwd`` / ``_bwd``, registered as ``torch.ops.fastbert`` custom ops), the
``autograd.Function`` and the functional entry point ``sparse_mlm_loss``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def mlm_transform_ref(h, dense_weight, dense_bias, ln_weight, ln_bias, eps, approximate="none"):
    h = F.gelu(F.linear(h, dense_weight, dense_bias), approximate=approximate)
    return F.layer_norm(h, (h.shape[-1],), ln_weight, ln_bias, eps)


def sparse_mlm_loss_ref(hidden, labels, dense_weight, dense_bias, ln_weight, ln_bias, eps,
                        decoder_weight, decoder_bias, approximate="none", ignore_index=-100, positions=None):
    """Reference: gather, transform, full logits for the gathered rows, cross-entropy."""
    if positions is not None:
        return _static_ref(hidden, labels, positions, dense_weight, dense_bias, ln_weight, ln_bias, eps,
                           decoder_weight, decoder_bias, approximate, ignore_index)
    keep = (labels != ignore_index).nonzero(as_tuple=True)[0]
    h = hidden.index_select(0, keep)
    y = labels.index_select(0, keep)
    h = mlm_transform_ref(h, dense_weight, dense_bias, ln_weight, ln_bias, eps, approximate)
    logits = F.linear(h, decoder_weight, decoder_bias).float()
    n = y.numel()
    if n == 0:
        loss = logits.sum() * 0.0 + hidden.sum() * 0.0
        zero = torch.zeros((), dtype=torch.long, device=hidden.device)
        return loss, zero, zero
    loss = F.cross_entropy(logits, y)
    correct = (logits.argmax(dim=-1) == y).sum()
    return loss, correct, torch.tensor(n, device=hidden.device)


def _static_ref(hidden, labels, positions, dense_weight, dense_bias, ln_weight, ln_bias, eps, decoder_weight,
                decoder_bias, approximate, ignore_index):
    """Fixed slots: every slot is computed, unused ones (``ignore_index``) weigh 0 in the mean."""
    valid = labels != ignore_index
    count = valid.sum()
    h = mlm_transform_ref(hidden.index_select(0, positions), dense_weight, dense_bias, ln_weight, ln_bias, eps,
                          approximate)
    logits = F.linear(h, decoder_weight, decoder_bias).float()
    y = torch.where(valid, labels, torch.zeros_like(labels))
    per_row = F.cross_entropy(logits, y, reduction="none")
    loss = (per_row * valid).sum() / count.clamp(min=1)
    correct = ((logits.argmax(dim=-1) == y) & valid).sum()
    return loss, correct, count


# ============================================================================= fused path
# Everything below is the fused path. The rows to predict are gathered first (n = masked tokens), the transform
# reuses the fused linear+GELU and LayerNorm ops, and the decoder + cross-entropy runs as cuBLAS GEMMs around one
# Triton pass: the forward GEMM writes the logits (n x vocab, in h's dtype, the decoder's bias in its epilogue, as
# HF's ``F.linear`` computes them), then ``_ce_rows_kernel`` reads each row twice, once for its log-sum-exp, argmax
# and the label's logit and once to overwrite it with d(logits) = softmax - onehot; the backward is two GEMMs on
# that buffer (d(hidden), d(decoder weight)) and the bias gradient's column sums, the mean's 1 / n and the
# incoming gradient applied to their small operands. The vocabulary is padded to a multiple of 64 columns (zero
# rows of the 16-bit decoder copy, zero d(logits)): BERT's 30,522 columns make rows of 61,044 bytes, which are
# not 16-byte aligned, and cuBLAS then runs its slow unaligned kernels. When the n x vocab buffer would exceed
# ``_KEEP_ELEMS`` elements, rows go in chunks that size and the backward recomputes each chunk's logits.
# (Until the thirty-second session the logits were Triton GEMM tiles reduced in registers and recomputed in the
# backward: ~1.9 ms of an H200's BERT-large step against ~1.0 now, benchmarks/RESULTS.md.)

from fastbert.ops import grad_accum, weight_casts  # noqa: E402
from fastbert.ops._common import (  # noqa: E402
    INTERPRET, cdiv, check_triton_device, fast_launch, next_power_of_2, register_op, tl, triton)
from fastbert.ops.ffn import linear_bias_gelu  # noqa: E402
from fastbert.ops.layer_norm import dropout_add_layer_norm  # noqa: E402
from fastbert.ops.linear import bias_grad, wgrad  # noqa: E402

# Elements of the logits buffer kept from the forward for the backward: 2^28 (512 MiB in bf16; BERT-large's
# 2,560 slots take 78 M). Beyond it, chunks of rows this size, recomputed in the backward.
_KEEP_ELEMS = 1 << 28
_VOCAB_ALIGN = 64
# (BLOCK_R rows, BLOCK_V columns, num_warps) of _ce_rows_kernel on a GPU, and in the interpreter (which costs per
# program: many rows a program)
_CE_TILE = (1, 2048, 8)
_CE_TILE_INTERPRET = (16, 256, 1)


def padded_vocab(v: int) -> int:
    """The logits' column count: ``v`` rounded up to a multiple of ``_VOCAB_ALIGN``."""
    return cdiv(v, _VOCAB_ALIGN) * _VOCAB_ALIGN


@fast_launch
@triton.jit(do_not_specialize=["n"])
def _ce_rows_kernel(L, Y, LSE, LAB, ARG, n, V, VP, stride_l, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """Rows [pid * BLOCK_R, +BLOCK_R) of the logits L ``(n, VP)`` (columns from V on are padding): their
    log-sum-exp, the label's logit (0 without a label: Y < 0) and the argmax (first index of the max) into LSE,
    LAB, ARG; then each row is overwritten with d(logits) = softmax - onehot (0 in rows without a label and in
    the padding). The first pass keeps a running max, sum and argmax per lane (one exp an element, no
    cross-thread reduction until the row's end); the second re-reads the row, mostly from L2."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n
    base = L + rows.to(tl.int64)[:, None] * stride_l
    label = tl.load(Y + rows, mask=row_ok, other=-1)
    cols = tl.arange(0, BLOCK_V)
    # a finite floor, not -inf: no (-inf) - (-inf) for lanes that have seen only masked columns
    m = tl.full((BLOCK_R, BLOCK_V), -3.0e38, tl.float32)
    s = tl.zeros((BLOCK_R, BLOCK_V), tl.float32)
    arg = tl.zeros((BLOCK_R, BLOCK_V), tl.int32)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        x = tl.load(base + c[None, :], mask=row_ok[:, None] & (c < V)[None, :], other=float("-inf")).to(tl.float32)
        up = x > m
        e = tl.exp(-tl.abs(x - m))  # exp(smaller - larger)
        s = tl.where(up, s * e + 1.0, s + e)
        arg = tl.where(up, c[None, :], arg)
        m = tl.where(up, x, m)
    row_max = tl.max(m, 1)
    lse = row_max + tl.log(tl.where(row_ok, tl.sum(s * tl.exp(m - row_max[:, None]), 1), 1.0))
    first = tl.min(tl.where(m == row_max[:, None], arg, 2147483647), 1)
    has = row_ok & (label >= 0)
    lab = tl.load(L + rows.to(tl.int64) * stride_l + label, mask=has, other=0.0).to(tl.float32)
    tl.store(LSE + rows, lse, mask=row_ok)
    tl.store(LAB + rows, lab, mask=row_ok)
    tl.store(ARG + rows, first, mask=row_ok)
    for v0 in range(0, VP, BLOCK_V):
        c = v0 + cols
        x = tl.load(base + c[None, :], mask=row_ok[:, None] & (c < V)[None, :], other=float("-inf")).to(tl.float32)
        d = tl.exp(x - lse[:, None]) - (c[None, :] == label[:, None]).to(tl.float32)
        d = tl.where(has[:, None] & (c < V)[None, :], d, 0.0)
        tl.store(base + c[None, :], d.to(L.dtype.element_ty), mask=row_ok[:, None] & (c < VP)[None, :])


def _logit_grads(h, weight, bias, labels, v, out=None):
    """d(logits) of rows ``h`` ``(r, K)`` against ``labels`` into ``out`` (a new ``(r, VP)`` buffer when None), and
    the rows' ``(lse, label logit, argmax)``: the decoder GEMM (``weight``, ``bias``: padded to VP rows), then
    ``_ce_rows_kernel`` in place."""
    r = h.shape[0]
    dl = torch.addmm(bias, h, weight.t()) if out is None else torch.addmm(bias, h, weight.t(), out=out)
    lse = torch.empty((r,), dtype=torch.float32, device=h.device)
    lab, arg = torch.empty_like(lse), torch.empty((r,), dtype=torch.int32, device=h.device)
    block_r, block_v, warps = _CE_TILE_INTERPRET if INTERPRET else _CE_TILE
    block_v = min(block_v, next_power_of_2(weight.shape[0]))
    if r:
        _ce_rows_kernel[(cdiv(r, block_r),)](dl, labels, lse, lab, arg, r, v, weight.shape[0], dl.stride(0),
                                             BLOCK_R=block_r, BLOCK_V=block_v, num_warps=warps)
    return dl, lse, lab, arg


def _chunk_rows(n: int, vp: int) -> int:
    """Rows a chunk: all n when the (n x VP) buffer fits ``_KEEP_ELEMS`` (then it is kept), else the most that fit."""
    return n if n * vp <= _KEEP_ELEMS else max(1, _KEEP_ELEMS // vp)


def _row_chunks(h, weight, bias, labels, vocab: int, chunk: int):
    """``(r0, r1, d(logits), lse, label logit, argmax)`` of rows [r0, r1) of ``h``, ``chunk`` rows at a time
    (:func:`_logit_grads` into one buffer, reused: each chunk's d(logits) is gone once the next is made)."""
    buf = torch.empty((chunk, weight.shape[0]), dtype=h.dtype, device=h.device)
    for r0 in range(0, h.shape[0], chunk):
        r1 = min(h.shape[0], r0 + chunk)
        yield (r0, r1, *_logit_grads(h[r0:r1], weight, bias, labels[r0:r1], vocab, buf[:r1 - r0]))


def linear_cross_entropy_fwd(h, weight, bias, labels, vocab: int):
    """Mean cross-entropy of ``h @ weight.T + bias`` (``weight`` ``(VP, K)`` and ``bias`` ``(VP,)`` padded with
    zeros past ``vocab``) against ``labels``; rows with a negative label are left out of the mean (0 when none is
    left). Returns ``(loss fp32 scalar, num_correct int64 scalar, d(logits))``: d(logits) ``(n, VP)`` in h's dtype
    (softmax - onehot, unscaled) when kept for the backward, else ``(0, VP)`` (see :func:`_chunk_rows`)."""
    n = h.shape[0]
    vp = weight.shape[0]
    chunk = _chunk_rows(n, vp)
    if chunk == n:
        dl, lse, lab, arg = _logit_grads(h, weight, bias, labels, vocab)
    else:
        parts = [rest for _, _, _, *rest in _row_chunks(h, weight, bias, labels, vocab, chunk)]
        lse, lab, arg = (torch.cat(t) for t in zip(*parts))
        dl = h.new_empty((0, vp))
    valid = labels >= 0
    loss = ((lse - lab) * valid).sum() / valid.sum().clamp(min=1)
    correct = ((arg.long() == labels) & valid).sum()
    return loss, correct, dl


def linear_cross_entropy_bwd(grad, h, weight, bias, labels, dl, vocab: int, wdtype: torch.dtype,
                             bdtype: torch.dtype, wacc=None):
    """Gradients ``(dh, dweight, dbias)`` of the mean loss scaled by ``grad`` (a scalar tensor), dweight and dbias
    ``vocab`` rows long in ``wdtype`` / ``bdtype``; ``dl``: the forward's d(logits), or empty to recompute them.
    ``wacc``: dweight's fp32 accumulator (``linear.wgrad``; ops/grad_accum.py), dweight then empty."""
    n, k = h.shape
    vp = weight.shape[0]
    # d(mean)/d(row) = 1 / (rows with a label), times the incoming gradient: on the device, no count read back.
    g = grad.reshape(()).to(torch.float32) / (labels >= 0).sum().clamp(min=1)
    # g goes onto the small operands: dh after its GEMM, h before dweight's (in fp16, whose range g * h may leave,
    # onto dweight after its GEMM instead).
    hg = h if h.dtype == torch.float16 else (h * g).to(h.dtype)
    # With an accumulator the GEMMs add the vocabulary's rows (not the padding's) into it; fp16's g comes after.
    acc = wacc if wacc is not None and h.dtype != torch.float16 else None
    if dl.shape[0] == n:  # kept from the forward
        dh, db = wgrad(dl.t(), weight, torch.float32), bias_grad(dl, torch.float32)
        dw = wgrad(dl, hg, torch.float32) if acc is None else _add_rows(acc, dl, hg)
    else:
        dh = torch.empty((n, k), dtype=torch.float32, device=h.device)
        dw, db = acc, None
        for r0, r1, d, *_ in _row_chunks(h, weight, bias, labels, vocab, _chunk_rows(n, vp)):
            dh[r0:r1] = wgrad(d.t(), weight, torch.float32)
            if dw is None:
                dw, db = wgrad(d, hg[r0:r1], torch.float32), bias_grad(d, torch.float32)
            else:
                _add_rows(dw, d, hg[r0:r1])
                db = bias_grad(d, torch.float32) if db is None else db + bias_grad(d, torch.float32)
    dh = (dh * g).to(h.dtype)
    db = (db[:vocab] * g).to(bdtype)
    if acc is not None:
        return dh, weight.new_empty((0,), dtype=wdtype), db
    if h.dtype == torch.float16:
        dw = dw * g
    if wacc is not None:  # fp16: the scaled gradient added after its GEMM
        wacc.add_(dw[:vocab])
        return dh, weight.new_empty((0,), dtype=wdtype), db
    return dh, dw[:vocab].to(wdtype), db


def _add_rows(acc, dl, h):
    """``acc += dl[:, :rows]ᵀ @ h`` for ``acc``'s rows (``linear.wgrad`` with an accumulator), in two GEMMs when
    ``acc`` has a row count that is not a multiple of ``_VOCAB_ALIGN`` (BERT's 30,522): for 30,522 rows cuBLASLt runs an
    Ampere kernel (402 us a BERT-large micro-batch on an H200) where 30,592 take its Hopper one (235 us)."""
    rows = acc.shape[0]
    head = rows - rows % _VOCAB_ALIGN
    for r0, r1 in ((0, head), (head, rows)):
        if r1 > r0:
            wgrad(dl[:, r0:r1], h, torch.float32, acc=acc[r0:r1])
    return acc


def _fwd_fake(h, weight, bias, labels, vocab):
    kept = _chunk_rows(h.shape[0], weight.shape[0]) == h.shape[0]
    return (h.new_empty((), dtype=torch.float32), h.new_empty((), dtype=torch.int64),
            h.new_empty((h.shape[0] if kept else 0, weight.shape[0])))


def _bwd_fake(grad, h, weight, bias, labels, dl, vocab, wdtype, bdtype, wacc=None):
    return (torch.empty_like(h), weight.new_empty((vocab, weight.shape[1]) if wacc is None else (0,), dtype=wdtype),
            bias.new_empty((vocab,), dtype=bdtype))


_fwd_op = register_op(
    "linear_cross_entropy_fwd",
    "(Tensor h, Tensor weight, Tensor bias, Tensor labels, int vocab) -> (Tensor, Tensor, Tensor)",
    linear_cross_entropy_fwd, _fwd_fake)
_bwd_op = register_op(
    "linear_cross_entropy_bwd",
    "(Tensor grad, Tensor h, Tensor weight, Tensor bias, Tensor labels, Tensor dl, int vocab, ScalarType wdtype, "
    "ScalarType bdtype, Tensor(a!)? wacc) -> (Tensor, Tensor, Tensor)",
    linear_cross_entropy_bwd, _bwd_fake)


# ============================================================================= autograd + entry point
class LinearCrossEntropyFn(torch.autograd.Function):
    """Mean cross-entropy of ``h @ weight.T + bias`` (the decoder) fused with the loss. The decoder runs in h's dtype
    (the autocast dtype under torch.autocast): the parameters are cast inside, padded to ``padded_vocab`` rows
    (``weight_casts``), their gradients returned in their own dtype."""

    @staticmethod
    def forward(ctx, h, weight, bias, labels):
        vp = padded_vocab(weight.shape[0])
        w, b = weight_casts.cast(weight, h.dtype, rows=vp), weight_casts.cast(bias, h.dtype, rows=vp)
        loss, correct, dl = _fwd_op(h, w, b, labels, weight.shape[0])
        ctx.save_for_backward(h, w, b, labels, dl)
        ctx.vocab, ctx.dtypes = weight.shape[0], (weight.dtype, bias.dtype)
        ctx.wacc = grad_accum.buffer_for(weight, torch.float32) if ctx.needs_input_grad[1] else None
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, dloss, _dcorrect):
        h, weight, bias, labels, dl = ctx.saved_tensors
        dh, dw, db = _bwd_op(dloss, h, weight, bias, labels, dl, ctx.vocab, *ctx.dtypes, ctx.wacc)
        return dh, dw if ctx.wacc is None else None, db, None


def sparse_mlm_loss(hidden, labels, dense_weight, dense_bias, ln_weight, ln_bias, eps,
                    decoder_weight, decoder_bias, approximate="none", ignore_index=-100, positions=None):
    """Fused sparse MLM head + loss; same signature and semantics as :func:`sparse_mlm_loss_ref`."""
    check_triton_device(hidden, dense_weight, decoder_weight)
    v = decoder_weight.shape[0]
    if positions is not None:   # static shapes: fixed slots, no device -> host transfer
        if hidden.dim() != 2 or labels.shape != positions.shape or positions.dim() != 1:
            raise ValueError(f"sparse_mlm_loss: hidden must be (tokens, hidden), positions and labels (slots,), got "
                             f"{tuple(hidden.shape)}, {tuple(positions.shape)} and {tuple(labels.shape)}")
        y = torch.where(labels == ignore_index, torch.full_like(labels, -1), labels)
        count = (y >= 0).sum()
        h = hidden.index_select(0, positions)  # (slots, hidden)
        return _fused_head(h, y, dense_weight, dense_bias, ln_weight, ln_bias, eps, decoder_weight, decoder_bias,
                           approximate) + (count,)
    if labels.shape != hidden.shape[:1] or hidden.dim() != 2:
        raise ValueError(f"sparse_mlm_loss: hidden must be (tokens, hidden) and labels (tokens,), got "
                         f"{tuple(hidden.shape)} and {tuple(labels.shape)}")
    keep = (labels != ignore_index).nonzero(as_tuple=True)[0]  # host sync, as in the reference
    n = keep.numel()
    if n == 0:
        loss = hidden.sum() * 0.0 + decoder_weight.sum() * 0.0
        zero = torch.zeros((), dtype=torch.long, device=hidden.device)
        return loss.float(), zero, zero
    y = labels.index_select(0, keep)
    bad = ((y < 0) | (y >= v)).any()
    if bool(bad):
        raise ValueError(f"sparse_mlm_loss: labels must be in [0, {v}) or ignore_index={ignore_index}")
    h = hidden.index_select(0, keep)  # (n, hidden)
    return _fused_head(h, y, dense_weight, dense_bias, ln_weight, ln_bias, eps, decoder_weight, decoder_bias,
                       approximate) + (torch.tensor(n, device=hidden.device),)


def _fused_head(h, y, dense_weight, dense_bias, ln_weight, ln_bias, eps, decoder_weight, decoder_bias, approximate):
    """Transform + decoder + cross-entropy of the gathered rows ``h`` against ``y`` (-1: no target)."""
    v = decoder_weight.shape[0]
    h = linear_bias_gelu(h, dense_weight, dense_bias, approximate)
    h = dropout_add_layer_norm(h, None, ln_weight, ln_bias, eps)
    if decoder_bias is None:
        decoder_bias = torch.zeros(v, dtype=decoder_weight.dtype, device=decoder_weight.device)
    loss, correct = LinearCrossEntropyFn.apply(h.contiguous(), decoder_weight, decoder_bias, y.contiguous())
    return loss, correct
