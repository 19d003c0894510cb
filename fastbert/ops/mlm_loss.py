"""Sparse MLM loss: predict only the masked positions, never holding (tokens x vocab) logits in full.

``hidden``: ``(tokens, hidden)``; ``labels``: ``(tokens,)`` with ``ignore_index`` (-100) where no
prediction is wanted. The head is BERT's: dense + GELU + LayerNorm, then a decoder tied to the
word embeddings plus a bias, then cross-entropy. Returns ``(loss, num_correct, num_predicted)``;
``loss`` is the mean over predicted positions (0 when there are none).

Static shapes (``positions`` given): ``labels`` is then ``(slots,)``, the targets of the rows
``hidden[positions]``, with ``ignore_index`` in unused slots. The number of slots is fixed per
batch (the masking collator's capacity), so nothing waits on the device: no ``nonzero``, no check
of label values, the same kernel shapes every step (tuned once, capturable in a CUDA graph).

This file holds the plain-PyTorch reference first, then the Triton kernels, host wrappers
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


# ============================================================================= Triton kernels
# Everything below is the fused path. The rows to predict are gathered first (n = masked tokens),
# the transform reuses the fused linear+GELU and LayerNorm ops, and the decoder + cross-entropy is
# fused: the forward kernel computes (row-block x vocab-block) logit tiles in registers and reduces
# each tile at once to per-row partials (running max, sum of exp, label logit, argmax), so no
# logits are ever stored; the host combines the partials of the vocab tiles (online logsumexp).
# The backward walks the vocabulary in chunks: a kernel recomputes a chunk's logits and writes its
# d(logits) = (softmax - onehot) * g / n (n x chunk, the only logits-sized buffer), then two cuBLAS
# matmuls accumulate d(hidden) and write the chunk's rows of d(decoder_weight).

from fastbert.ops import weight_casts  # noqa: E402
from fastbert.ops._common import (  # noqa: E402
    INTERPRET, cdiv, check_triton_device, next_power_of_2, register_op, tl, triton)
from fastbert.ops.ffn import linear_bias_gelu  # noqa: E402
from fastbert.ops.layer_norm import dropout_add_layer_norm  # noqa: E402

# Elements of the (n x chunk) d(logits) buffer of the backward: 2^24 = 32 MiB in bf16.
_BWD_CHUNK_ELEMS = 1 << 24


def input_precision(dtype):
    """fp32 inputs follow torch's TF32 switch for matmuls; 16-bit inputs are exact products anyway."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


@triton.jit
def mm_tile(A, B, pid_m, pid_n, M, N, K, stride_am, stride_ak, stride_bn, stride_bk,
            EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 tile ``A[pid_m rows] @ B[pid_n rows].T`` of A ``(M, K)`` and B ``(N, K)`` (B is a
    weight in nn.Linear layout). Rows past M / N wrap around (modulo) so the loads need no row
    masks; the caller masks the store."""
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


_LCE_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
]
_INTERPRET_BLOCK_M = 32


def _interpret_block_n(v: int) -> int:
    """The interpreter's vocab tile: about 8 tiles whatever the vocabulary (at least 32 columns). The interpreter
    costs per program, not per element: 32-column tiles made BERT's 30,522 words 954 programs a row block (minutes
    a step of a tiny model), while several tiles still exercise the cross-tile combine."""
    return max(32, next_power_of_2(cdiv(v, 8)))


def _lce_tiles(restore_value):
    """The kernels' tile sizes: autotuned on a GPU; in the interpreter (the CPU tests) one config whose vocab tile
    follows the vocabulary (still an autotuner, which benchmarks/e2e_train_step.py's probe lists)."""
    key = ["N_BUCKET", "V", "K"]
    if not INTERPRET:
        return triton.autotune(configs=_LCE_CONFIGS, key=key, restore_value=restore_value)
    tune = triton.autotune(configs=[triton.Config({"BLOCK_M": _INTERPRET_BLOCK_M, "BLOCK_K": 32})], key=key,
                           restore_value=restore_value)
    vocab = triton.heuristics({"BLOCK_N": lambda a: _interpret_block_n(a["V"])})
    return lambda fn: tune(vocab(fn))


def _narrowest_tiles(v: int) -> tuple:
    """(BLOCK_M, BLOCK_N): the smallest row and vocab tiles the kernels may run with at vocabulary ``v``, which
    size the partial buffers."""
    if INTERPRET:
        return _INTERPRET_BLOCK_M, _interpret_block_n(v)
    return min(c.kwargs["BLOCK_M"] for c in _LCE_CONFIGS), min(c.kwargs["BLOCK_N"] for c in _LCE_CONFIGS)


@triton.jit
def _logits_tile(H, W, B, Y, pid_m, pid_n, n, V, K, v_start, stride_h, stride_w,
                 EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 logits of rows pid_m and vocab columns v_start + pid_n tile (-inf past V), the
    columns' vocab ids, the rows, their labels and row mask."""
    acc = mm_tile(H, W + v_start * stride_w, pid_m, pid_n, n, V - v_start, K, stride_h, 1, stride_w, 1,
                  EVEN_K, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = v_start + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < V
    acc += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    acc = tl.where(col_mask[None, :], acc, float("-inf"))
    row_mask = rows < n
    labels = tl.load(Y + rows, mask=row_mask, other=-1).to(tl.int32)
    return acc, rows, cols, row_mask, labels


# restore_value: configs of different tile sizes write different partial slots while autotuning;
# every timed run must start from the same initial buffers.
@_lce_tiles(restore_value=["MAX_P", "SUM_P", "LABEL_P", "ARGMAX_P"])
@triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})
@triton.jit(do_not_specialize=["n"])
def _lce_fwd_kernel(H, W, B, Y, MAX_P, SUM_P, LABEL_P, ARGMAX_P, n, V, K, N_BUCKET, stride_h, stride_w,
                    stride_p, INPUT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per (row, vocab tile) partials at [row, pid_n]: max logit, sum exp(logit - max), the label's
    logit (0 where the label is elsewhere), and the argmax (first index of the max)."""
    # Vocab tiles vary fastest so concurrently running programs share the same hidden rows.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    logits, rows, cols, row_mask, labels = _logits_tile(
        H, W, B, Y, pid_m, pid_n, n, V, K, 0, stride_h, stride_w, EVEN_K, INPUT_PRECISION,
        BLOCK_M, BLOCK_N, BLOCK_K)
    m = tl.max(logits, axis=1)
    s = tl.sum(tl.exp(logits - m[:, None]), axis=1)
    is_max = logits == m[:, None]
    arg = tl.min(tl.where(is_max, cols[None, :], 2147483647), axis=1)
    lab = tl.sum(tl.where(cols[None, :] == labels[:, None], logits, 0.0), axis=1)
    offs = rows.to(tl.int64) * stride_p + pid_n
    tl.store(MAX_P + offs, m, mask=row_mask)
    tl.store(SUM_P + offs, s, mask=row_mask)
    tl.store(LABEL_P + offs, lab, mask=row_mask)
    tl.store(ARGMAX_P + offs, arg, mask=row_mask)


@_lce_tiles(restore_value=["DB_PART"])
@triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})
@triton.jit(do_not_specialize=["n", "chunk"])
def _lce_bwd_kernel(H, W, B, Y, LSE, G, DL, DB_PART, n, V, K, N_BUCKET, v_start, chunk, stride_h, stride_w,
                    stride_dl, inv_n, INPUT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """d(logits) of vocab columns [v_start, v_start + chunk) into DL (n, chunk) and the column sums
    of this row block (partial d(bias)) into DB_PART[pid_m, col]."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    logits, rows, cols, row_mask, labels = _logits_tile(
        H, W, B, Y, pid_m, pid_n, n, V, K, v_start, stride_h, stride_w, EVEN_K, INPUT_PRECISION,
        BLOCK_M, BLOCK_N, BLOCK_K)
    lse = tl.load(LSE + rows, mask=row_mask, other=0.0)
    g = tl.load(G).to(tl.float32) * inv_n
    prob = tl.exp(logits - lse[:, None])  # exp(-inf) = 0 past V
    dl = (prob - (cols[None, :] == labels[:, None]).to(tl.float32)) * g
    local = cols - v_start
    # Rows with a negative label (unused slots of a static-shape batch) get no gradient.
    keep = (row_mask & (labels >= 0))[:, None] & (local < chunk)[None, :] & (cols < V)[None, :]
    dl = tl.where(keep, dl, 0.0)
    store = row_mask[:, None] & (local < chunk)[None, :] & (cols < V)[None, :]
    tl.store(DL + rows.to(tl.int64)[:, None] * stride_dl + local[None, :], dl.to(DL.dtype.element_ty), mask=store)
    tl.store(DB_PART + pid_m * V + cols, tl.sum(dl, axis=0), mask=(local < chunk) & (cols < V))


# ============================================================================= host wrappers
def linear_cross_entropy_fwd(h, weight, bias, labels):
    """Mean cross-entropy of ``h @ weight.T + bias`` against ``labels`` without storing logits; rows
    with a negative label are left out of the mean (0 when none is left). Returns ``(loss fp32
    scalar, lse fp32 (n,), num_correct int64 scalar)``."""
    n, k = h.shape
    v = weight.shape[0]
    dev = h.device
    if n == 0:
        return (torch.zeros((), dtype=torch.float32, device=dev), torch.empty((0,), dtype=torch.float32, device=dev),
                torch.zeros((), dtype=torch.int64, device=dev))
    # Partials are sized for the narrowest vocab tile of the autotune space; wider tiles fill a prefix.
    tiles = cdiv(v, _narrowest_tiles(v)[1])
    max_p = torch.full((n, tiles), float("-inf"), dtype=torch.float32, device=dev)
    sum_p = torch.zeros((n, tiles), dtype=torch.float32, device=dev)
    label_p = torch.zeros((n, tiles), dtype=torch.float32, device=dev)
    arg_p = torch.full((n, tiles), v, dtype=torch.int32, device=dev)

    def grid(meta):
        return (cdiv(v, meta["BLOCK_N"]), cdiv(n, meta["BLOCK_M"]))
    _lce_fwd_kernel[grid](h, weight, bias, labels, max_p, sum_p, label_p, arg_p, n, v, k,
                          next_power_of_2(n), h.stride(0), weight.stride(0), tiles,
                          INPUT_PRECISION=input_precision(h.dtype))
    # Online-softmax combine over vocab tiles; unused tiles hold (-inf, 0) and drop out.
    row_max = max_p.max(dim=1).values  # (n,)
    lse = row_max + torch.log((sum_p * torch.exp(max_p - row_max[:, None])).sum(dim=1))
    valid = labels >= 0
    loss = ((lse - label_p.sum(dim=1)) * valid).sum() / valid.sum().clamp(min=1)
    # argmax: the smallest index among tiles that reach the row max (torch's first-max rule).
    pred = torch.where(max_p == row_max[:, None], arg_p, v).min(dim=1).values
    correct = (pred.long() == labels).sum()
    return loss, lse, correct


def linear_cross_entropy_bwd(grad, h, weight, bias, labels, lse):
    """Gradients ``(dh, dweight, dbias)`` of the mean loss scaled by ``grad`` (a scalar tensor)."""
    n, k = h.shape
    v = weight.shape[0]
    dev = h.device
    dh = torch.zeros((n, k), dtype=torch.float32, device=dev)
    dw = torch.empty_like(weight)
    if n == 0:
        return dh.to(h.dtype), dw.zero_(), torch.zeros_like(bias)
    chunk = max(128, min(v, (_BWD_CHUNK_ELEMS // n) // 128 * 128))
    max_block_m_rows = cdiv(n, _narrowest_tiles(v)[0])
    db_part = torch.zeros((max_block_m_rows, v), dtype=torch.float32, device=dev)
    dl = torch.empty((n, min(chunk, v)), dtype=h.dtype, device=dev)
    # d(mean)/d(row) = 1 / (rows with a label): folded into g on the device, so no count is read back.
    g = (grad.reshape(1).to(torch.float32) / (labels >= 0).sum().clamp(min=1)).contiguous()
    for v0 in range(0, v, chunk):
        c = min(chunk, v - v0)

        def grid(meta):
            return (cdiv(c, meta["BLOCK_N"]), cdiv(n, meta["BLOCK_M"]))
        _lce_bwd_kernel[grid](h, weight, bias, labels, lse, g, dl, db_part, n, v, k, next_power_of_2(n),
                              v0, c, h.stride(0), weight.stride(0), dl.stride(0), 1.0,
                              INPUT_PRECISION=input_precision(h.dtype))
        dlc = dl[:, :c]  # (n, c)
        dh.addmm_(dlc, weight[v0:v0 + c]) if h.dtype == torch.float32 else dh.add_(dlc @ weight[v0:v0 + c])
        torch.mm(dlc.t(), h, out=dw[v0:v0 + c])  # (c, n) @ (n, K)
    return dh.to(h.dtype), dw, db_part.sum(0).to(bias.dtype)


def _fwd_fake(h, weight, bias, labels):
    return (h.new_empty((), dtype=torch.float32), h.new_empty((h.shape[0],), dtype=torch.float32),
            h.new_empty((), dtype=torch.int64))


def _bwd_fake(grad, h, weight, bias, labels, lse):
    return torch.empty_like(h), torch.empty_like(weight), torch.empty_like(bias)


_fwd_op = register_op(
    "linear_cross_entropy_fwd",
    "(Tensor h, Tensor weight, Tensor bias, Tensor labels) -> (Tensor, Tensor, Tensor)",
    linear_cross_entropy_fwd, _fwd_fake)
_bwd_op = register_op(
    "linear_cross_entropy_bwd",
    "(Tensor grad, Tensor h, Tensor weight, Tensor bias, Tensor labels, Tensor lse) -> (Tensor, Tensor, Tensor)",
    linear_cross_entropy_bwd, _bwd_fake)


# ============================================================================= autograd + entry point
class LinearCrossEntropyFn(torch.autograd.Function):
    """Mean cross-entropy of ``h @ weight.T + bias`` (the decoder) fused with the loss. The decoder runs in h's dtype
    (the autocast dtype under torch.autocast): the parameters are cast inside (``weight_casts``), their gradients
    returned in their own dtype."""

    @staticmethod
    def forward(ctx, h, weight, bias, labels):
        w, b = weight_casts.cast(weight, h.dtype), weight_casts.cast(bias, h.dtype)
        loss, lse, correct = _fwd_op(h, w, b, labels)
        ctx.save_for_backward(h, w, b, labels, lse)
        ctx.dtypes = weight.dtype, bias.dtype
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, dloss, _dcorrect):
        h, weight, bias, labels, lse = ctx.saved_tensors
        dh, dw, db = _bwd_op(dloss, h, weight, bias, labels, lse)
        return dh, dw.to(ctx.dtypes[0]), db.to(ctx.dtypes[1]), None


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
