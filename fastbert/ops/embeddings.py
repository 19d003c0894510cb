"""BERT embeddings on unpadded tokens: word + position + token-type gather, sum, LayerNorm, dropout.

All index inputs are 1-D ``(tokens,)``; the output is ``(tokens, hidden)``. This file holds the
plain-PyTorch reference first, then the Triton kernels, host wrappers (``embeddings_fwd`` /
``embeddings_bwd``, registered as ``torch.ops.fastbert`` custom ops), the ``autograd.Function`` and the
functional entry point ``bert_embeddings``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def bert_embeddings_ref(input_ids, position_ids, token_type_ids, word_weight, position_weight,
                        type_weight, ln_weight, ln_bias, eps, dropout_p=0.0, seed=None, padding_idx=None):
    """Reference. ``padding_idx``: the word-embedding row that gets no gradient (HF's pad token)."""
    x = F.embedding(input_ids, word_weight, padding_idx=padding_idx)
    x = x + F.embedding(position_ids, position_weight) + F.embedding(token_type_ids, type_weight)
    x = F.layer_norm(x, (x.shape[-1],), ln_weight, ln_bias, eps)
    if dropout_p > 0.0:
        x = F.dropout(x, dropout_p, training=True)
    return x


# ============================================================================= Triton kernels
# Everything below is the fused path: one kernel gathers the three rows of each token, sums them
# in fp32, normalizes, applies dropout and stores once. The backward recomputes the sum (cheaper
# than storing it), regenerates the dropout mask from the seed, and scatter-adds the gradient of
# the sum into fp32 word / position buffers with atomics. The token-type table has a handful of
# rows hit by every token, where atomics would serialize, so each program reduces its rows into
# per-type partial sums in registers instead.

from fastbert.ops import grad_accum  # noqa: E402
from fastbert.ops._common import (  # noqa: E402
    bwd_row_partition, cdiv, check_dropout_p, check_hidden, check_triton_device, drop_threshold, dropout_keep,
    dropout_seed, fast_launch, next_power_of_2, register_op, row_block, tl, triton)
from fastbert.ops.layer_norm import layer_norm_bwd_rows, layer_norm_stats  # noqa: E402

# Token-type tables up to this many rows are reduced in registers; larger ones use atomics.
_MAX_TYPES_IN_REGS = 8


@triton.jit
def _gather_sum(IDS_W, IDS_P, IDS_T, WORD, POS, TYPE, rows, cols, row_mask, mask,
                stride_word, stride_pos, stride_type):
    """fp32 sum of the three embedding rows of each token in the tile; also the ids."""
    wid = tl.load(IDS_W + rows, mask=row_mask, other=0).to(tl.int64)
    pid = tl.load(IDS_P + rows, mask=row_mask, other=0).to(tl.int64)
    tid = tl.load(IDS_T + rows, mask=row_mask, other=0).to(tl.int64)
    s = tl.load(WORD + wid[:, None] * stride_word + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s += tl.load(POS + pid[:, None] * stride_pos + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s += tl.load(TYPE + tid[:, None] * stride_type + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return s, wid, pid, tid


@fast_launch
@triton.jit(do_not_specialize=["M", "threshold"])
def _emb_fwd_kernel(IDS_W, IDS_P, IDS_T, WORD, POS, TYPE, LN_W, LN_B, Y, MEAN, RSTD,
                    M, N, stride_word, stride_pos, stride_type, eps, threshold, scale, SEED,
                    HAS_DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    s, _, _, _ = _gather_sum(IDS_W, IDS_P, IDS_T, WORD, POS, TYPE, rows, cols, row_mask, mask,
                             stride_word, stride_pos, stride_type)
    sc, mean, rstd = layer_norm_stats(s, mask, N, eps)
    tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    w = tl.load(LN_W + cols, mask=col_mask, other=0.0).to(tl.float32)
    b = tl.load(LN_B + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = sc * rstd[:, None] * w[None, :] + b[None, :]
    if HAS_DROPOUT:
        y = tl.where(dropout_keep(tl.load(SEED), rows, 0, N, threshold, BLOCK_N), y * scale, 0.0)
    tl.store(Y + rows.to(tl.int64)[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit(do_not_specialize=["M", "rows_per_program", "threshold"])
def _emb_bwd_kernel(DY, IDS_W, IDS_P, IDS_T, WORD, POS, TYPE, LN_W, MEAN, RSTD,
                    DWORD, DPOS, DTYPE, DTYPE_PART, DLNW_PART, DLNB_PART,
                    M, N, rows_per_program, stride_word, stride_pos, stride_type, threshold, scale, SEED, padding_idx,
                    HAS_DROPOUT: tl.constexpr, HAS_PAD: tl.constexpr, TYPES_IN_REGS: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    prog = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(LN_W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    dtype_acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    types = tl.arange(0, BLOCK_T)
    row_start = prog * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for r in range(row_start, row_end, BLOCK_M):
        rows = r + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        s, wid, pid, tid = _gather_sum(IDS_W, IDS_P, IDS_T, WORD, POS, TYPE, rows, cols, row_mask, mask,
                                       stride_word, stride_pos, stride_type)
        dy = tl.load(DY + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_DROPOUT:
            dy = tl.where(dropout_keep(tl.load(SEED), rows, 0, N, threshold, BLOCK_N), dy * scale, 0.0)
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        ds, xhat = layer_norm_bwd_rows(s, dy, w, mean, rstd, mask, N)
        dw_acc += dy * xhat
        db_acc += dy
        word_mask = mask
        if HAS_PAD:
            word_mask = mask & (wid != padding_idx)[:, None]
        tl.atomic_add(DWORD + wid[:, None] * N + cols[None, :], ds, mask=word_mask, sem="relaxed")
        tl.atomic_add(DPOS + pid[:, None] * N + cols[None, :], ds, mask=mask, sem="relaxed")
        if TYPES_IN_REGS:
            # (BLOCK_M, BLOCK_T) one-hot of each row's type, times ds, summed over rows.
            onehot = ((tid[:, None] == types[None, :]) & row_mask[:, None]).to(tl.float32)
            dtype_acc += tl.sum(onehot[:, :, None] * ds[:, None, :], axis=0)
        else:
            tl.atomic_add(DTYPE + tid[:, None] * N + cols[None, :], ds, mask=mask, sem="relaxed")
    tl.store(DLNW_PART + prog * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    tl.store(DLNB_PART + prog * N + cols, tl.sum(db_acc, axis=0), mask=col_mask)
    if TYPES_IN_REGS:
        tl.store(DTYPE_PART + (prog * BLOCK_T + types)[:, None] * N + cols[None, :], dtype_acc,
                 mask=col_mask[None, :])


# ============================================================================= host wrappers
def embeddings_fwd(input_ids, position_ids, token_type_ids, word_weight, position_weight, type_weight,
                   ln_weight, ln_bias, eps, dropout_p, seed):
    """Returns ``(out (tokens, hidden), mean, rstd)``; out has the word table's dtype."""
    m = input_ids.numel()
    n = word_weight.shape[1]
    y = torch.empty((m, n), dtype=word_weight.dtype, device=word_weight.device)
    mean = torch.empty((m,), dtype=torch.float32, device=word_weight.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=word_weight.device)
    if m > 0:
        block_m, block_n, num_warps = row_block(n)
        _emb_fwd_kernel[(cdiv(m, block_m),)](
            input_ids, position_ids, token_type_ids, word_weight, position_weight, type_weight, ln_weight,
            ln_bias, y, mean, rstd, m, n, word_weight.stride(0), position_weight.stride(0), type_weight.stride(0),
            eps, drop_threshold(dropout_p), 1.0 / (1.0 - dropout_p), seed,
            HAS_DROPOUT=dropout_p > 0.0, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return y, mean, rstd


def embeddings_bwd(dy, input_ids, position_ids, token_type_ids, word_weight, position_weight, type_weight,
                   ln_weight, mean, rstd, dropout_p, seed, padding_idx, word_acc=None, pos_acc=None):
    """Returns ``(dword, dposition, dtype, dln_weight, dln_bias)``, each like its weight.
    ``padding_idx < 0`` means none. Atomic accumulation: the word / position sums are not bitwise
    deterministic run to run (fp32 adds in varying order). ``word_acc`` / ``pos_acc``: fp32 buffers of the
    tables' shapes (``ops/grad_accum.py``) the kernel's atomics add into instead of a zeroed gradient; that
    gradient is then returned empty."""
    m = input_ids.numel()
    n = word_weight.shape[1]
    dev = word_weight.device
    n_types = type_weight.shape[0]
    types_in_regs = n_types <= _MAX_TYPES_IN_REGS
    block_t = next_power_of_2(n_types) if types_in_regs else 1
    dword = word_acc if word_acc is not None else torch.zeros(word_weight.shape, dtype=torch.float32, device=dev)
    dpos = pos_acc if pos_acc is not None else torch.zeros(position_weight.shape, dtype=torch.float32, device=dev)
    dtype_full = torch.zeros(type_weight.shape if not types_in_regs else (0,), dtype=torch.float32, device=dev)
    block_m, block_n, num_warps, programs, rows_per_program = bwd_row_partition(m, n, dev)
    dtype_part = torch.zeros((programs, block_t, n), dtype=torch.float32, device=dev)
    dlnw_part = torch.zeros((programs, n), dtype=torch.float32, device=dev)
    dlnb_part = torch.zeros((programs, n), dtype=torch.float32, device=dev)
    if m > 0:
        _emb_bwd_kernel[(programs,)](
            dy, input_ids, position_ids, token_type_ids, word_weight, position_weight, type_weight, ln_weight,
            mean, rstd, dword, dpos, dtype_full, dtype_part, dlnw_part, dlnb_part,
            m, n, rows_per_program, word_weight.stride(0), position_weight.stride(0), type_weight.stride(0),
            drop_threshold(dropout_p), 1.0 / (1.0 - dropout_p), seed, padding_idx,
            HAS_DROPOUT=dropout_p > 0.0, HAS_PAD=padding_idx >= 0, TYPES_IN_REGS=types_in_regs,
            BLOCK_T=block_t, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    dtype = dtype_part.sum(0)[:n_types] if types_in_regs else dtype_full
    dword = dword.to(word_weight.dtype) if word_acc is None else word_weight.new_empty((0,))
    dpos = dpos.to(position_weight.dtype) if pos_acc is None else position_weight.new_empty((0,))
    return (dword, dpos, dtype.to(type_weight.dtype), dlnw_part.sum(0).to(ln_weight.dtype),
            dlnb_part.sum(0).to(ln_weight.dtype))


def _fwd_fake(input_ids, position_ids, token_type_ids, word_weight, position_weight, type_weight,
              ln_weight, ln_bias, eps, dropout_p, seed):
    m = input_ids.numel()
    stats = word_weight.new_empty((m,), dtype=torch.float32)
    return word_weight.new_empty((m, word_weight.shape[1])), stats, stats.clone()


def _bwd_fake(dy, input_ids, position_ids, token_type_ids, word_weight, position_weight, type_weight,
              ln_weight, mean, rstd, dropout_p, seed, padding_idx, word_acc=None, pos_acc=None):
    return (word_weight.new_empty(word_weight.shape if word_acc is None else (0,)),
            position_weight.new_empty(position_weight.shape if pos_acc is None else (0,)),
            torch.empty_like(type_weight), torch.empty_like(ln_weight), torch.empty_like(ln_weight))


_fwd_op = register_op(
    "bert_embeddings_fwd",
    "(Tensor input_ids, Tensor position_ids, Tensor token_type_ids, Tensor word_weight, Tensor position_weight, "
    "Tensor type_weight, Tensor ln_weight, Tensor ln_bias, float eps, float dropout_p, Tensor? seed) "
    "-> (Tensor, Tensor, Tensor)",
    embeddings_fwd, _fwd_fake)
_bwd_op = register_op(
    "bert_embeddings_bwd",
    "(Tensor dy, Tensor input_ids, Tensor position_ids, Tensor token_type_ids, Tensor word_weight, "
    "Tensor position_weight, Tensor type_weight, Tensor ln_weight, Tensor mean, Tensor rstd, float dropout_p, "
    "Tensor? seed, int padding_idx, Tensor(a!)? word_acc, Tensor(b!)? pos_acc) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    embeddings_bwd, _bwd_fake)


# ============================================================================= autograd + entry point
class BertEmbeddingsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_ids, position_ids, token_type_ids, word_weight, position_weight, type_weight,
                ln_weight, ln_bias, eps, dropout_p, seed, padding_idx):
        y, mean, rstd = _fwd_op(input_ids, position_ids, token_type_ids, word_weight, position_weight,
                                type_weight, ln_weight, ln_bias, eps, dropout_p, seed)
        ctx.save_for_backward(input_ids, position_ids, token_type_ids, word_weight, position_weight, type_weight,
                              ln_weight, mean, rstd)
        ctx.dropout_p, ctx.seed, ctx.padding_idx = dropout_p, seed, padding_idx
        # With gradient accumulation (ops/grad_accum.py) the atomics add into the tables' fp32 buffers: no zeroed
        # gradient, and for a decoder tied to the word table (whose GEMM adds into the same buffer) no addition of
        # the two either.
        ctx.accs = tuple(grad_accum.buffer_for(t, torch.float32) if ctx.needs_input_grad[i] else None
                         for i, t in ((3, word_weight), (4, position_weight)))
        return y

    @staticmethod
    def backward(ctx, dy):
        ids_w, ids_p, ids_t, word, pos, typ, ln_w, mean, rstd = ctx.saved_tensors
        dword, dpos, *rest = _bwd_op(dy.contiguous(), ids_w, ids_p, ids_t, word, pos, typ, ln_w, mean, rstd,
                                     ctx.dropout_p, ctx.seed, ctx.padding_idx, *ctx.accs)
        dword, dpos = (None if acc is not None else g for acc, g in zip(ctx.accs, (dword, dpos)))
        return (None, None, None, dword, dpos, *rest, None, None, None, None)


def bert_embeddings(input_ids, position_ids, token_type_ids, word_weight, position_weight, type_weight,
                    ln_weight, ln_bias, eps, dropout_p=0.0, seed=None, padding_idx=None):
    """Fused embeddings; same signature and semantics as :func:`bert_embeddings_ref` except that
    dropout draws a Philox mask from ``seed`` (``None``: a fresh one, see ``_common.dropout_seed``)."""
    n = word_weight.shape[1]
    check_hidden(n, "bert_embeddings")
    check_dropout_p(dropout_p)
    check_triton_device(input_ids, word_weight, position_weight, type_weight, ln_weight, ln_bias)
    if not (input_ids.shape == position_ids.shape == token_type_ids.shape) or input_ids.dim() != 1:
        raise ValueError("bert_embeddings: input_ids, position_ids and token_type_ids must be 1-D (tokens,) of one "
                         f"shape, got {tuple(input_ids.shape)}, {tuple(position_ids.shape)}, "
                         f"{tuple(token_type_ids.shape)}")
    if position_weight.shape[1] != n or type_weight.shape[1] != n or ln_weight.shape != (n,) or \
            ln_bias.shape != (n,):
        raise ValueError(f"bert_embeddings: all tables need hidden size {n} and the LayerNorm params shape ({n},)")
    if padding_idx is not None and padding_idx < 0:
        padding_idx += word_weight.shape[0]  # nn.Embedding's convention for negative indices
    seed = dropout_seed(dropout_p, seed, word_weight.device)
    tables = [t if t.stride(-1) == 1 else t.contiguous() for t in (word_weight, position_weight, type_weight)]
    return BertEmbeddingsFn.apply(input_ids.contiguous(), position_ids.contiguous(), token_type_ids.contiguous(),
                                  *tables, ln_weight, ln_bias, float(eps), float(dropout_p), seed,
                                  -1 if padding_idx is None else int(padding_idx))
