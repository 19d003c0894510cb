"""Variable-length (unpadded) multi-head attention.

``q, k, v``: ``(total_tokens, heads, head_dim)`` (views of one packed QKV are fine), int32
``cu_seqlens`` ``(batch + 1,)``. Returns ``(total_tokens, heads, head_dim)``.

Top to bottom: the plain-PyTorch reference (pads per sequence internally), the Triton kernels
(flash-style forward that stores the log-sum-exp and, with dropout, the mask it drew as bits; backward
as dQ (which also computes the softmax row term delta) then dK/dV, or for sequences up to 128 tokens one
persistent kernel per length bucket whose programs loop over (sequence, head) tiles, the next tile's loads in
flight during this one's GEMMs), the host wrappers ``varlen_attention_forward`` / ``varlen_attention_backward``,
the torch custom ops that let ``torch.compile`` wrap them, the ``autograd.Function`` and
``varlen_attention``.
"""
from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F

from fastbert.ops._common import (
    INTERPRET, autocast_dtype, cdiv, check_dropout_p, check_triton_device, column_sums, drop_threshold, dropout_bits,
    dropout_seed, fast_launch, keep_from_bits, next_power_of_2, num_sms, register_op, tl, triton)
from fastbert.ops.fp8 import E5M2, FP8_MAX, HISTORY, _fp8_codes, finite_amax_of, history_scale, transpose_codes
from fastbert.padding import unpad_by_seqlens, pad, unpad


def _padded(q, k, v, cu_seqlens, max_seqlen):
    info = unpad_by_seqlens(q, cu_seqlens, max_seqlen)
    # (B, S, nh, hd) -> (B, nh, S, hd)
    qp, kp, vp = (pad(t, info).transpose(1, 2) for t in (q, k, v))
    key_mask = torch.zeros(info.batch * info.seqlen, dtype=torch.bool, device=q.device)
    key_mask[info.indices] = True
    key_mask = key_mask.view(info.batch, 1, 1, info.seqlen)
    return info, qp, kp, vp, key_mask


def attention_probs_ref(q, k, cu_seqlens, max_seqlen, softmax_scale=None):
    """Softmax attention maps ``(batch, heads, max_seqlen, max_seqlen)``; rows of padding are 0."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    info, qp, kp, _, key_mask = _padded(q, k, k, cu_seqlens, max_seqlen)
    scores = torch.matmul(qp, kp.transpose(-1, -2)) * scale  # (B, nh, S, S)
    scores = scores.masked_fill(~key_mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    query_mask = key_mask.view(info.batch, 1, info.seqlen, 1)
    return probs * query_mask


def varlen_attention_ref(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, seed=None):
    """Reference: pad per sequence, masked softmax attention, unpad. ``seed`` is ignored here."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    info, qp, kp, vp, key_mask = _padded(q, k, v, cu_seqlens, max_seqlen)
    scores = torch.matmul(qp, kp.transpose(-1, -2)) * scale  # (B, nh, S, S)
    scores = scores.masked_fill(~key_mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p, training=True)
    out = torch.matmul(probs, vp)  # (B, nh, S, hd)
    return unpad(out.transpose(1, 2), info)  # (T, nh, hd)


# ============================================================================ Triton kernels
_LOG2E = 1.4426950408889634
# Dropout (``_common.dropout_bits``): one Philox call per 8 adjacent (query, key) pairs of a sequence. The
# counter is ``row * ceil(max_seqlen / 8) + col // 8`` (local to the sequence) and the key is the seed (read
# from the seed tensor) in the low 32 bits plus the (sequence, head) stream in the high 32 bits (key blocks
# start at multiples of 8). The forward stores the mask it drew as bits, one int32 word per (query, 32 keys):
# ``(heads, T, 2 * ceil(max_seqlen / 64))`` (a 1/16 of a bf16 score matrix; key k of a word in bit k, so as
# bytes it reads as key 8j + i in bit i of byte j); the backward reads them (``_stored_keep``) instead of
# drawing again. The forward and the dQ kernel build a tile's keep-mask from its row's words with shifts in
# their own register layout (``_keep_of_words``), where unpacking bytes took shared-memory shuffles (H100,
# tenth session, B=16 H=16 S=512: the forward with dropout 183 -> 145 us, 62 us without; dQ 108 -> 94 us).
_STREAM_SHIFT = tl.constexpr(2**32)  # kernels read only constexpr globals
_E5M2_MAX = tl.constexpr(FP8_MAX[E5M2])  # the FP8 backward's gradient codes (``_backward_packed(..., fp8=...)``)
_PER_BATCH = ["stride_lse_h", "stride_mask_h"]  # follow the token count: not specialized (_common.py, "Shapes")


@triton.jit
def _load_rows(P, start64, head, stride_t, stride_h, offs, offs_d, mask):
    """Rows ``offs`` (of a sequence starting at token ``start64``) of one head of a ``(T, nh, hd)`` tensor."""
    return tl.load(P + start64 * stride_t + head * stride_h + offs[:, None] * stride_t + offs_d[None, :], mask=mask,
                   other=0.0)


@triton.jit
def _attention_bits(SEED, stream, row0, col0, ROWS: tl.constexpr, COLS: tl.constexpr, max_seqlen, threshold):
    """Keep-mask bits (``dropout_bits``) of the ``(ROWS, COLS)`` tile at (row0, col0) of one (sequence, head)
    stream."""
    key = tl.load(SEED).to(tl.int64) + stream.to(tl.int64) * _STREAM_SHIFT
    return dropout_bits(key, row0 + tl.arange(0, ROWS), col0, max_seqlen, threshold, COLS)


@triton.jit
def _words_of_bits(bits, COLS: tl.constexpr):
    """A ``dropout_bits`` tile ``(rows, COLS // 8)`` (COLS 32 or 64) as the int32 words the mask stores: keys
    [0, 32) of the tile in ``lo`` (key k in bit k), keys [32, 64) in ``hi`` (0 when COLS == 32). Little-endian
    words of the bytes: the same bits in the same memory order as the bytes themselves."""
    j = tl.arange(0, COLS // 8)[None, :]
    b = bits.to(tl.int32) << (8 * (j % 4))  # disjoint bit fields: their sum is their OR
    return tl.sum(tl.where(j < 4, b, 0), 1), tl.sum(tl.where(j >= 4, b, 0), 1)


@triton.jit
def _keep_of_words(w0, w1, w2, w3, shift0, COLS: tl.constexpr):
    """Keep-mask ``(rows, COLS)`` of COLS consecutive keys from the int32 words holding them, one word vector per
    32 keys (w0: keys [0, 32) of the tile, w1, w2, w3 the next; only the first max(1, COLS // 32) are read;
    ``shift0``: the tile's first bit in w0, nonzero only when COLS < 32). Shifts and selects in the caller's
    register layout: no shared-memory shuffle."""
    c = tl.arange(0, COLS)[None, :]
    if COLS == 128:
        w = tl.where(c < 64, tl.where(c < 32, w0[:, None], w1[:, None]), tl.where(c < 96, w2[:, None], w3[:, None]))
    elif COLS == 64:
        w = tl.where(c < 32, w0[:, None], w1[:, None])
    else:
        w = w0[:, None]
    return ((w >> ((shift0 + c) & 31)) & 1) != 0


@triton.jit
def _words_ok(row_mask, rows, word, limit):
    """``row_mask`` and ``word < limit`` as one tensor (the interpreter takes no scalar in a mask)."""
    return row_mask & (rows * 0 + word < limit)


@triton.jit
def _stored_keep(mask_base, rows, col0, COLS: tl.constexpr, stride_mask_t, row_mask, seqlen):
    """Keep-mask ``(len(rows), COLS)`` of keys col0 + [0, COLS) for ``rows`` of one (sequence, head), from the
    forward's words (only a row's own words below its sequence's end are read)."""
    ptr = mask_base + rows.to(tl.int64) * stride_mask_t + col0 // 32
    limit = tl.minimum(stride_mask_t, (seqlen + 31) // 32)  # the row's words, and none past its sequence
    w0 = tl.load(ptr, mask=_words_ok(row_mask, rows, col0 // 32, limit), other=0)
    w1, w2, w3 = w0, w0, w0
    if COLS > 32:
        w1 = tl.load(ptr + 1, mask=_words_ok(row_mask, rows, col0 // 32 + 1, limit), other=0)
    if COLS > 64:
        w2 = tl.load(ptr + 2, mask=_words_ok(row_mask, rows, col0 // 32 + 2, limit), other=0)
        w3 = tl.load(ptr + 3, mask=_words_ok(row_mask, rows, col0 // 32 + 3, limit), other=0)
    return _keep_of_words(w0, w1, w2, w3, col0 % 32, COLS)


@triton.jit
def _stored_keep_t(mask_base, rows, col0, COLS: tl.constexpr, stride_mask_t, row_mask, seqlen):
    """:func:`_stored_keep` transposed, ``(COLS, len(rows))`` (the key-major tile of the backward kernels): the words
    read as bytes, unpacked (``keep_from_bits``) and the tile transposed. There, at the register limit,
    shifting a word per element cost more than the shuffle (sm_90 compile reports: spills 40 -> 112 bytes)."""
    groups = col0 // 8 + tl.arange(0, COLS // 8)
    in_row = (groups * 8 < seqlen) & (groups < 4 * stride_mask_t)
    ptrs = mask_base.to(tl.pointer_type(tl.uint8)) + rows.to(tl.int64)[:, None] * (4 * stride_mask_t) + groups[None, :]
    return tl.trans(keep_from_bits(tl.load(ptrs, mask=row_mask[:, None] & in_row[None, :], other=0)))


@triton.jit
def _key_major_grads(q, k, v, do, lse, delta, dv, mask_k, mask_q, mask_base, rows, col0, stride_mask_t, seqlen,
                     qk_scale, keep_scale, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The key-major backward of one tile of keys (k, v) against queries (q, dO, their log-sum-exp and delta),
    both backward kernels' core: P^T rebuilt from the log-sum-exp (S^T = K Q^T), dV accumulated into ``dv`` from
    the dropped P^T, and dS^T = P^T * (dP^T - delta) in q's dtype. The dropout keep tile is read here
    (``_stored_keep_t`` of the query rows ``rows`` and the keys from ``col0``). Returns ``(dsT, dv)``."""
    qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
    pT = tl.math.exp2(qkT - lse[None, :])
    pT = tl.where(mask_k[:, None] & mask_q[None, :], pT, 0.0)
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (dO V^T)^T
    if HAS_DROPOUT:
        keepT = _stored_keep_t(mask_base, rows, col0, k.shape[0], stride_mask_t, mask_q, seqlen)
        dv = tl.dot(tl.where(keepT, pT * keep_scale, 0.0).to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpT = tl.where(keepT, dpT * keep_scale, 0.0)
    else:
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    return (pT * (dpT - delta[None, :])).to(q.dtype), dv


@triton.jit
def _store_grad(P, x, start64, head, stride_t, stride_h, rows, offs_d, row_mask, mask_d, scale,
                FP8_OUT: tl.constexpr, COLSUMS: tl.constexpr, HW: tl.constexpr):
    """Store the fp32 gradient tile ``x`` (rows ``rows`` of a sequence starting at token ``start64``, one head)
    of a ``(T, .., nh, hd)`` tensor P in P's dtype; with FP8_OUT as e5m2 codes of ``x * scale`` (P: bytes), the
    QKV projection's input-gradient operand (``qkv_attention``; its transpose is a pass of its own,
    ``fp8.transpose_codes``: stored from here, byte by byte at a sequence's unaligned start, it cost more than
    the whole cast it replaces). Returns the tile's finite amax with FP8_OUT (its amax-history entry), else 0,
    and with COLSUMS (FP8_OUT sets it too) the tile's fp32 column sums (its share of the bias gradient), else
    zeros."""
    ptrs = P + start64 * stride_t + head * stride_h + rows[:, None] * stride_t + offs_d[None, :]
    mask = row_mask[:, None] & mask_d[None, :]
    amax = 0.0
    sums = offs_d * 0.0
    if COLSUMS:
        x = tl.where(mask, x, 0.0)
        sums = tl.sum(x, 0)
    if FP8_OUT:
        amax = finite_amax_of(tl.abs(x))
        codes = _fp8_codes(x * scale, _E5M2_MAX, True, HW)  # saturated to e5m2's largest finite value
        tl.store(ptrs, codes.to(tl.uint8), mask=mask)
    else:
        tl.store(ptrs, x.to(P.dtype.element_ty), mask=mask)
    return amax, sums


@triton.jit
def _store_part(PARTS, part_row, stride_part, col0, sums, offs_d, mask_d):
    """Store a program's column sums of one head's gradient (columns col0 + offs_d) into its partial row."""
    tl.store(PARTS + part_row.to(tl.int64) * stride_part + col0 + offs_d, sums, mask=mask_d)


@fast_launch
@triton.jit(do_not_specialize=_PER_BATCH + ["max_seqlen", "threshold"])
def _fwd_kernel(
    Q, K, V, O, LSE, MASK, CU_SEQLENS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lse_h, stride_mask_h, stride_mask_t, nheads, qk_scale, threshold, keep_scale, SEED, max_seqlen,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program = one block of BLOCK_M queries of one (sequence, head); grid (q-block, seq, head). With
    dropout it also stores the mask's bits for the backward (MASK, whole words: BLOCK_N is 32 or 64)."""
    tl.static_assert((BLOCK_N == 32) | (BLOCK_N == 64))
    pid_m = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    start = tl.load(CU_SEQLENS + seq)
    seqlen = tl.load(CU_SEQLENS + seq + 1) - start
    if pid_m * BLOCK_M >= seqlen:  # past the end of this sequence: no work on padding
        return
    start64 = start.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seqlen
    mask_d = offs_d < HEAD_DIM

    q_ptrs = Q + start64 * stride_qt + head * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    k_base = K + start64 * stride_kt + head * stride_kh
    v_base = V + start64 * stride_vt + head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    stream = seq * nheads + head
    mask_base = MASK + head.to(tl.int64) * stride_mask_h + start64 * stride_mask_t
    for start_n in range(0, seqlen, BLOCK_N):
        cols = start_n + offs_n
        mask_n = cols < seqlen
        k = tl.load(k_base + cols[:, None] * stride_kt + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        # Key 0 is always valid, so m_new is finite from the first block on: no inf - inf.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if HAS_DROPOUT:
            bits = _attention_bits(SEED, stream, pid_m * BLOCK_M, start_n, BLOCK_M, BLOCK_N, max_seqlen, threshold)
            lo, hi = _words_of_bits(bits, BLOCK_N)
            word = mask_base + offs_m.to(tl.int64) * stride_mask_t + start_n // 32
            tl.store(word, lo, mask=_words_ok(mask_m, offs_m, start_n // 32, stride_mask_t))
            if BLOCK_N == 64:
                tl.store(word + 1, hi, mask=_words_ok(mask_m, offs_m, start_n // 32 + 1, stride_mask_t))
            p = tl.where(_keep_of_words(lo, hi, lo, lo, 0, BLOCK_N), p, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # never NaN, even for a row that saw no key
    acc = acc / l_safe[:, None]
    if HAS_DROPOUT:
        acc = acc * keep_scale
    o_ptrs = O + start64 * stride_ot + head * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    tl.store(LSE + head * stride_lse_h + start + offs_m, m_i + tl.math.log2(l_safe), mask=mask_m)


@fast_launch
@triton.jit
def _short_lists_kernel(CU_SEQLENS, LISTS, COUNTS, batch, N_BUCKETS: tl.constexpr, SMALLEST: tl.constexpr,
                        CHUNK: tl.constexpr):
    """The fused short backward's work lists, one program: for bucket j (lengths in (lo_j, hi_j], hi_j = SMALLEST
    * 2^j, lo_0 = 0, lo_j = hi_j / 2) the starts and lengths of its sequences in LISTS[j, 0, :count] and
    LISTS[j, 1, :count] (``(N_BUCKETS, 2, batch)``, batch order), count in COUNTS[j]. CHUNK sequences at a time:
    one tile of the whole batch compiled for minutes at 65,536 sequences."""
    for j in tl.static_range(N_BUCKETS):
        hi = SMALLEST << j
        lo = 0 if j == 0 else hi // 2
        count = tl.full((), 0, tl.int32)
        for first in range(0, batch, CHUNK):
            i = first + tl.arange(0, CHUNK)
            ok = i < batch
            start = tl.load(CU_SEQLENS + i, mask=ok, other=0)
            length = tl.load(CU_SEQLENS + i + 1, mask=ok, other=0) - start
            inb = ok & (length > lo) & (length <= hi)
            pos = count + tl.cumsum(inb.to(tl.int32), 0) - 1
            tl.store(LISTS + 2 * j * batch + pos, start, mask=inb)
            tl.store(LISTS + (2 * j + 1) * batch + pos, length, mask=inb)
            count += tl.sum(inb.to(tl.int32), 0)
        tl.store(COUNTS + j, count)


@fast_launch
@triton.jit(do_not_specialize=_PER_BATCH)
def _bwd_short_kernel(
    Q, K, V, O, DO, LSE, MASK, DQ, DK, DV, LIST, COUNT,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_ot, stride_oh, stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    stride_lse_h, stride_mask_h, stride_mask_t, qk_scale, softmax_scale, keep_scale, nheads, list_len, part0,
    HIST, STEP, SCALE_INV, PARTS, stride_part,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr,
    FP8_OUT: tl.constexpr, COLSUMS: tl.constexpr, HW: tl.constexpr, HISTORY_LEN: tl.constexpr,
):
    """The whole backward of sequences whose tokens all fit one BLOCK: a persistent program loops over the
    (sequence, head) tiles of one length bucket (LIST: its starts, then its lengths, ``list_len`` apart; COUNT:
    how many; ``_short_lists_kernel``), and Triton's pipeliner keeps the next tile's q, k, v, dO, O and
    log-sum-exp loads in flight (cp.async, STAGES buffers) while this tile's five GEMMs run. A tile holds every
    key and query of its sequence: delta = rowsum(O * dO), P^T and dS^T key-major (S^T = K Q^T, so they feed
    the dV and dK GEMMs from registers), dQ = dS K (dS^T through shared memory once); no atomics, each input
    read once. Row offsets are taken from the tile's start inside the loop: hoisted out of it, the eight
    tensors' offsets stayed live across the loop and spilled (sm_90 compile reports).

    FP8_OUT, COLSUMS: as ``_bwd_dkdv_kernel`` (PARTS row ``part0`` + the sequence's place in the list).
    """
    pid = tl.program_id(0)
    if FP8_OUT:
        scale, cur = history_scale(HIST, STEP, HISTORY_LEN, _E5M2_MAX)
        if pid == 0:
            tl.store(SCALE_INV, tl.math.div_rn(tl.full((), 1.0, tl.float32), scale))
    else:
        scale, cur = 1.0, 0
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    amax = tl.full((), 0.0, tl.float32)
    for tile in tl.range(pid, tl.load(COUNT) * nheads, tl.num_programs(0), num_stages=STAGES):
        entry = tile // nheads
        head = tile - entry * nheads
        seqlen = tl.load(LIST + list_len + entry)
        rows = tl.load(LIST + entry).to(tl.int64) + offs  # the sequence's tokens
        mask_t = offs < seqlen
        mask_td = mask_t[:, None] & mask_d[None, :]
        k = _load_rows(K, 0, head, stride_kt, stride_kh, rows, offs_d, mask_td)
        v = _load_rows(V, 0, head, stride_vt, stride_vh, rows, offs_d, mask_td)
        q = _load_rows(Q, 0, head, stride_qt, stride_qh, rows, offs_d, mask_td)
        do = _load_rows(DO, 0, head, stride_dot, stride_doh, rows, offs_d, mask_td)
        o = _load_rows(O, 0, head, stride_ot, stride_oh, rows, offs_d, mask_td)
        lse = tl.load(LSE + head * stride_lse_h + rows, mask=mask_t, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        dsT, dv = _key_major_grads(q, k, v, do, lse, delta, tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32), mask_t,
                                   mask_t, MASK + head.to(tl.int64) * stride_mask_h, rows, 0, stride_mask_t, seqlen,
                                   qk_scale, keep_scale, HAS_DROPOUT, DOT_PRECISION)
        dq = tl.dot(tl.trans(dsT), k, input_precision=DOT_PRECISION) * softmax_scale
        dq_amax, dq_sums = _store_grad(DQ, dq, 0, head, stride_dqt, stride_dqh, rows, offs_d, mask_t, mask_d, scale,
                                       FP8_OUT, COLSUMS, HW)
        dk = tl.dot(dsT, q, input_precision=DOT_PRECISION) * softmax_scale
        dk_amax, dk_sums = _store_grad(DK, dk, 0, head, stride_dkt, stride_dkh, rows, offs_d, mask_t, mask_d, scale,
                                       FP8_OUT, COLSUMS, HW)
        dv_amax, dv_sums = _store_grad(DV, dv, 0, head, stride_dvt, stride_dvh, rows, offs_d, mask_t, mask_d, scale,
                                       FP8_OUT, COLSUMS, HW)
        if COLSUMS:
            part_row = part0 + entry
            cols = stride_part // 3  # nh * hd: q's, k's and v's columns
            _store_part(PARTS, part_row, stride_part, head * stride_dqh, dq_sums, offs_d, mask_d)
            _store_part(PARTS, part_row, stride_part, cols + head * stride_dkh, dk_sums, offs_d, mask_d)
            _store_part(PARTS, part_row, stride_part, 2 * cols + head * stride_dvh, dv_sums, offs_d, mask_d)
        if FP8_OUT:
            amax = tl.maximum(amax, tl.maximum(dq_amax, tl.maximum(dk_amax, dv_amax)))
    if FP8_OUT:
        tl.atomic_max(HIST + cur, amax, sem="relaxed")


@fast_launch
@triton.jit(do_not_specialize=_PER_BATCH)
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, MASK, DK, DV, CU_SEQLENS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    stride_lse_h, stride_mask_h, stride_mask_t, qk_scale, softmax_scale, keep_scale,
    HIST, STEP, SCALE_INV, PARTS, stride_part,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8_OUT: tl.constexpr, COLSUMS: tl.constexpr, HW: tl.constexpr, HISTORY_LEN: tl.constexpr,
):
    """One program = one block of BLOCK_N keys of one (sequence, head), looping over its queries in blocks
    of BLOCK_M. The scores are computed key-major (S^T = K Q^T), so P^T and dS^T feed the dV and dK GEMMs
    straight from registers. DELTA comes from the dQ kernel, which ran first.

    FP8_OUT: the gradients go out as e5m2 codes scaled from the amax history row HIST, with their amax, instead
    of in Q's dtype. COLSUMS (set with FP8_OUT): also the bias gradient's partial column sums (``_store_grad``,
    PARTS row ``pid_n * batch + seq``).
    """
    pid_n = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    if FP8_OUT:
        scale, cur = history_scale(HIST, STEP, HISTORY_LEN, _E5M2_MAX)
        if (pid_n == 0) & (seq == 0) & (head == 0):
            tl.store(SCALE_INV, tl.math.div_rn(tl.full((), 1.0, tl.float32), scale))
    else:
        scale, cur = 1.0, 0
    start = tl.load(CU_SEQLENS + seq)
    seqlen = tl.load(CU_SEQLENS + seq + 1) - start
    if pid_n * BLOCK_N >= seqlen:
        return
    start64 = start.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < seqlen
    mask_d = offs_d < HEAD_DIM
    mask_nd = mask_n[:, None] & mask_d[None, :]

    k = _load_rows(K, start64, head, stride_kt, stride_kh, offs_n, offs_d, mask_nd)
    v = _load_rows(V, start64, head, stride_vt, stride_vh, offs_n, offs_d, mask_nd)
    lse_base = LSE + head * stride_lse_h + start
    delta_base = DELTA + head * stride_lse_h + start
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    mask_base = MASK + head.to(tl.int64) * stride_mask_h + start64 * stride_mask_t
    for start_m in range(0, seqlen, BLOCK_M):
        rows = start_m + offs_m
        mask_m = rows < seqlen
        mask_md = mask_m[:, None] & mask_d[None, :]
        q = _load_rows(Q, start64, head, stride_qt, stride_qh, rows, offs_d, mask_md)
        do = _load_rows(DO, start64, head, stride_dot, stride_doh, rows, offs_d, mask_md)
        lse = tl.load(lse_base + rows, mask=mask_m, other=0.0)
        delta = tl.load(delta_base + rows, mask=mask_m, other=0.0)
        dsT, dv = _key_major_grads(q, k, v, do, lse, delta, dv, mask_n, mask_m, mask_base, rows, pid_n * BLOCK_N,
                                   stride_mask_t, seqlen, qk_scale, keep_scale, HAS_DROPOUT, DOT_PRECISION)
        dk = tl.dot(dsT, q, dk, input_precision=DOT_PRECISION)

    dk = dk * softmax_scale
    dk_amax, dk_sums = _store_grad(DK, dk, start64, head, stride_dkt, stride_dkh, offs_n, offs_d,
                                   mask_n, mask_d, scale, FP8_OUT, COLSUMS, HW)
    dv_amax, dv_sums = _store_grad(DV, dv, start64, head, stride_dvt, stride_dvh, offs_n, offs_d,
                                   mask_n, mask_d, scale, FP8_OUT, COLSUMS, HW)
    if COLSUMS:
        part_row = pid_n * tl.num_programs(1) + seq
        cols = stride_part // 3  # nh * hd: q's, k's and v's columns
        _store_part(PARTS, part_row, stride_part, cols + head * stride_dkh, dk_sums, offs_d, mask_d)
        _store_part(PARTS, part_row, stride_part, 2 * cols + head * stride_dvh, dv_sums, offs_d, mask_d)
    if FP8_OUT:
        tl.atomic_max(HIST + cur, tl.maximum(dk_amax, dv_amax), sem="relaxed")


@fast_launch
@triton.jit(do_not_specialize=_PER_BATCH)
def _bwd_dq_kernel(
    Q, K, V, O, DO, LSE, DELTA, MASK, DQ, CU_SEQLENS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_ot, stride_oh, stride_dqt, stride_dqh,
    stride_lse_h, stride_mask_h, stride_mask_t, qk_scale, softmax_scale, keep_scale,
    HIST, STEP, PARTS, stride_part,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8_OUT: tl.constexpr, COLSUMS: tl.constexpr, HW: tl.constexpr, HISTORY_LEN: tl.constexpr,
):
    """One program = one block of BLOCK_M queries of one (sequence, head), looping over its keys.

    It also computes and stores ``delta = rowsum(O * dO)`` (fp32), the softmax-backward row term
    the dK/dV kernel reads, which therefore runs after this one: no separate preprocess pass.
    FP8_OUT, COLSUMS: dQ as the dK/dV kernel's write it (PARTS row ``pid_m * batch + seq``).
    """
    pid_m = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    start = tl.load(CU_SEQLENS + seq)
    seqlen = tl.load(CU_SEQLENS + seq + 1) - start
    if pid_m * BLOCK_M >= seqlen:
        return
    start64 = start.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seqlen
    mask_d = offs_d < HEAD_DIM
    mask_md = mask_m[:, None] & mask_d[None, :]

    q = tl.load(Q + start64 * stride_qt + head * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=mask_md, other=0.0)
    do = tl.load(DO + start64 * stride_dot + head * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :],
                 mask=mask_md, other=0.0)
    o = tl.load(O + start64 * stride_ot + head * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :],
                mask=mask_md, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + head * stride_lse_h + start + offs_m, delta, mask=mask_m)
    lse = tl.load(LSE + head * stride_lse_h + start + offs_m, mask=mask_m, other=0.0)
    k_base = K + start64 * stride_kt + head * stride_kh
    v_base = V + start64 * stride_vt + head * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    mask_base = MASK + head.to(tl.int64) * stride_mask_h + start64 * stride_mask_t
    for start_n in range(0, seqlen, BLOCK_N):
        cols = start_n + offs_n
        mask_n = cols < seqlen
        mask_nd = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_base + cols[:, None] * stride_kt + offs_d[None, :], mask=mask_nd, other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :], mask=mask_nd, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        p = tl.math.exp2(qk - lse[:, None])
        p = tl.where(mask_m[:, None] & mask_n[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            keep = _stored_keep(mask_base, offs_m, start_n, BLOCK_N, stride_mask_t, mask_m, seqlen)
            dp = tl.where(keep, dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)

    dq = dq * softmax_scale
    if FP8_OUT:
        scale, cur = history_scale(HIST, STEP, HISTORY_LEN, _E5M2_MAX)
    else:
        scale, cur = 1.0, 0
    amax, sums = _store_grad(DQ, dq, start64, head, stride_dqt, stride_dqh, offs_m, offs_d, mask_m,
                             mask_d, scale, FP8_OUT, COLSUMS, HW)
    if COLSUMS:
        _store_part(PARTS, pid_m * tl.num_programs(1) + seq, stride_part, head * stride_dqh, sums, offs_d, mask_d)
    if FP8_OUT:
        tl.atomic_max(HIST + cur, amax, sem="relaxed")


# ============================================================================ host wrappers
# Launch configurations as (BLOCK_M, BLOCK_N, num_warps, num_stages) per (kernel, head_dim bucket,
# max_seqlen bucket), chosen for BERT on Hopper from `benchmarks/bench_attention.py --sweep`.
# Backward of sequences up to _SHORT_BWD_MAX tokens: the fused short kernel, one (sequence, head) tile at a time
# (``_SHORT_BWD_LAUNCH``).
_GPU_CONFIGS = {
    ("fwd", 64, "short"): (64, 64, 4, 3),
    ("fwd", 64, "long"): (64, 64, 4, 3),
    # with dropout, 32-key tiles (H100, p=0.1, graph-replayed fwd+bwd): B=16 H=16 S=512 full rows 0.4328 vs 0.4407 ms;
    # B=128 H=16 S=128 at 60% fill 211.6 vs 224.5 us (eleventh session)
    ("fwd_dropout", 64, "short"): (64, 32, 4, 3),
    ("fwd_dropout", 64, "long"): (64, 32, 4, 3),
    ("dq", 64, "long"): (64, 32, 4, 3),
    ("dkdv", 64, "long"): (32, 128, 4, 2),
    ("fwd", 128, "short"): (64, 32, 4, 3),
    ("fwd", 128, "long"): (128, 64, 8, 2),
    ("dq", 128, "long"): (64, 32, 4, 2),
    ("dkdv", 128, "long"): (32, 64, 4, 2),
}
_SHORT_BWD_MAX = 128
# BLOCK -> (num_warps, programs an SM, num_stages) of the fused short backward (``_bwd_short_kernel``), with and
# without dropout. 128: 255 registers a thread at 8 warps (one program an SM) and two stages of 80 KB of tile
# buffers (three do not fit); 64: 232 registers at 4 warps, two an SM; 16 and 32 (96 and 150 registers): by
# registers, not measured. H200, twenty-first session, graph-replayed, bf16 (us): B=256 H=12 S=128 full rows
# p=0.1 262.7 -> 211.5 (one program a (sequence, head) before), p=0 219.5 -> 166.9; B=128 H=16 full 176.6 -> 145.0,
# lengths in [26, 128] 123.3 -> 111.1; S=64 60.1 -> 53.4. benchmarks/RESULTS.md.
# No 16-token tile: on an H200 (triton 3.6) its 4 warps computed wrong bf16 gradients with dropout (90% of them off,
# fp32 and no dropout right; the byte-unpacked keep tile on a tensor-core tile smaller than the warps; thirty-ninth
# session), so sequences of up to 16 tokens take the 32-token tile (``_short_bwd_blocks``).
_SHORT_BWD_LAUNCH = {32: (4, 3, 2), 64: (4, 2, 2), 128: (8, 1, 2)}
_SHORT_BWD_SMALLEST = 32
# The stages' tile buffers (q, k, v, dO, O) a program may take: two stages of 16-bit 128 x 64 tiles fit sm_90's
# 227 KB beside what the kernel itself keeps in shared memory; fp32 tiles at 128 (246 KB) do not: one stage there.
_SHORT_BWD_STAGE_BYTES = 2 * 5 * 128 * 64 * 2
_INTERPRETER_CONFIG = (32, 32, 1, 1)


def _launch_config(kind: str, head_dim: int, max_seqlen: int, device: torch.device, dropout: bool = False):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of ``kind``; a forward with dropout takes its own entry where
    ``_GPU_CONFIGS`` has one ("fwd_dropout")."""
    if device.type != "cuda":
        return _INTERPRETER_CONFIG
    key = (kind, 64 if head_dim <= 64 else 128, "short" if max_seqlen <= 128 else "long")
    if dropout and ("fwd_dropout", *key[1:]) in _GPU_CONFIGS:
        key = ("fwd_dropout", *key[1:])
    block_m, block_n, warps, stages = _GPU_CONFIGS.get(key, _GPU_CONFIGS[(kind, key[1], "long")])
    # Short sequences: shrink the query / key block so programs are not mostly masked.
    cap = max(16, next_power_of_2(max_seqlen))
    block_m, block_n = min(block_m, cap), min(block_n, cap)
    if kind == "fwd":  # the forward stores whole 32-bit words of the dropout mask: 32 or 64 keys a tile
        block_n = min(max(block_n, 32), 64)
    return block_m, block_n, warps, stages


def _short_bwd_blocks(head_dim: int, max_seqlen: int):
    """The BLOCK of each fused short-backward launch (lengths in (BLOCK/2, BLOCK], the smallest from 1),
    or None for the two-kernel path."""
    block = max(_SHORT_BWD_SMALLEST, next_power_of_2(max_seqlen))
    limit = _SHORT_BWD_MAX if head_dim <= 64 else min(_SHORT_BWD_MAX, 64)
    if block > limit:
        return None
    # Two buckets once sequences reach 128: the short half of a batch skips the 128-wide tiles.
    return [64, 128] if block == 128 else [block]


def extras_pay(head_dim: int, max_seqlen: int) -> bool:
    """Whether the backward writing what the QKV projection's backward needs besides dqkv itself (its FP8 operands,
    ``_backward_packed(..., fp8=...)``, or the bias gradient's sums, ``colsums=True``) beat the 16-bit backward + a
    pass over dqkv on an H100: on the two-kernel path, longer sequences. B=32 H=16 S=512 p=0.1: FP8 602 vs 683 us
    full rows, 351 vs 387 at 60% fill (twelfth session); sums 584.7 vs 617.5 us with the bias GEMM (eighteenth). On
    the fused short backward (then one program a (sequence, head) at the register cap, one at a time on an SM, its
    epilogue's reductions exposed) B=128 S=128 p=0.1: FP8 278 vs 292 full rows, but 192 vs 185 at 60% fill; sums
    236.1 vs 228.6 full rows, 259.9 vs 268.2 at lengths 20-128. On the persistent kernel the sums still cost more
    than the GEMM they replace: the BERT-large bf16 step 64.67 / 64.93 ms with them against 64.04 / 64.10 (H200,
    interleaved pairs, twenty-fourth session; benchmarks/RESULTS.md)."""
    return _short_bwd_blocks(head_dim, max_seqlen) is None


def _short_bwd_launch(block: int, q: torch.Tensor, block_d: int):
    """(num_warps, programs, num_stages) of the fused short backward for ``block``, ``q``'s dtype and the kernels'
    head block ``block_d`` (the interpreter: a few programs, so each loops over several tiles)."""
    if q.device.type != "cuda":
        return 1, 2, 1
    warps, per_sm, stages = _SHORT_BWD_LAUNCH[block]
    return warps, per_sm * num_sms(q.device), _short_bwd_stages(block, block_d, q.element_size(), stages)


def _short_bwd_stages(block: int, block_d: int, itemsize: int, stages: int) -> int:
    """``stages``, or 1 where that many stages' tile buffers (q, k, v, dO, O) exceed ``_SHORT_BWD_STAGE_BYTES``."""
    return stages if 5 * block * block_d * itemsize * stages <= _SHORT_BWD_STAGE_BYTES else 1


def _dropout_args(dropout_p: float):
    """The kernels' (threshold, keep_scale): drop below the 16-bit threshold, scale kept values by 1 / (1 - p)."""
    return drop_threshold(dropout_p), 1.0 / (1.0 - dropout_p)


def _kernel_constants(q: torch.Tensor, dropout_p: float) -> dict:
    head_dim = q.shape[-1]
    return dict(HEAD_DIM=head_dim, BLOCK_D=max(16, next_power_of_2(head_dim)),
                HAS_DROPOUT=dropout_p > 0.0,
                # fp32 inputs (the interpreter, or fp32 on GPU) keep full precision; 16-bit ignore it.
                DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")


def _mask_shape(total, nheads, max_seqlen, dropout_p: float):
    """The shape of the forward's dropout-mask words (int32): ``(nh, T, 2 * ceil(max_seqlen / 64))``, or ``(0,)``
    without dropout."""
    return (nheads, total, 2 * ((max_seqlen + 63) // 64)) if dropout_p > 0.0 else (0,)


def varlen_attention_forward(q, k, v, cu_seqlens, max_seqlen: int, dropout_p: float, softmax_scale: float,
                             seed):
    """Returns ``out`` ``(T, nh, hd)``, the log-sum-exp in log2 units ``(nh, T)`` fp32 and the dropout mask's
    bits (``_mask_shape``) that the backward reads."""
    total, nheads, head_dim = q.shape
    out = torch.empty((total, nheads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((nheads, total), dtype=torch.float32, device=q.device)
    # zeros: words past a short sequence's end are never written (a memset of 1/16 of a bf16 score matrix)
    mask = torch.zeros(_mask_shape(total, nheads, max_seqlen, dropout_p), dtype=torch.int32, device=q.device)
    batch = cu_seqlens.shape[0] - 1
    if total == 0 or batch == 0 or max_seqlen == 0:
        return out, lse, mask
    block_m, block_n, warps, stages = _launch_config("fwd", head_dim, max_seqlen, q.device, dropout_p > 0.0)
    grid = (cdiv(max_seqlen, block_m), batch, nheads)
    _fwd_kernel[grid](
        q, k, v, out, lse, mask, cu_seqlens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        lse.stride(0), *_mask_strides(mask), nheads, softmax_scale * _LOG2E, *_dropout_args(dropout_p), seed,
        max_seqlen,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **_kernel_constants(q, dropout_p))
    return out, lse, mask


def _mask_strides(mask):
    return (mask.stride(0), mask.stride(1)) if mask.dim() == 3 else (0, 0)


def varlen_attention_backward(dout, q, k, v, out, lse, mask, cu_seqlens, max_seqlen: int, dropout_p: float,
                              softmax_scale: float):
    """Returns ``dq, dk, dv``, each ``(T, nh, hd)``: views of one ``(T, 3, nh, hd)`` buffer. ``out``, ``lse``
    and ``mask`` are the forward's."""
    return _backward_packed(dout, q, k, v, out, lse, mask, cu_seqlens, max_seqlen, dropout_p,
                            softmax_scale).unbind(1)


def _backward_packed(dout, q, k, v, out, lse, mask, cu_seqlens, max_seqlen: int, dropout_p: float,
                     softmax_scale: float, fp8=None, colsums: bool = False):
    """The gradients as one ``(T, 3, nh, hd)`` tensor (custom ops may not return aliasing outputs).

    ``colsums``: ``(dqkv, its fp32 column sums)``, the sums (the QKV projection's bias gradient) taken by the
    kernels from their fp32 accumulators, a row of partial sums a program (``_Extras``).
    ``fp8`` = (history, row): the gradients instead as the QKV projection's FP8 backward wants them, with
    the cast ``fp8.cast_fp8`` would make of the ``(T, 3 nh hd)`` gradient written by the kernels themselves:
    ``(e5m2 codes, their transpose, scale_inv, fp32 column sums)``, the amax recorded in ``history``'s row
    ``row`` (which must be primed: ``AmaxHistory.prime``)."""
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    total, nheads, head_dim = q.shape
    dqkv = torch.empty((total, 3, nheads, head_dim), dtype=torch.uint8 if fp8 else q.dtype, device=q.device)
    dq, dk, dv = dqkv.unbind(1)  # (T, nh, hd) each
    batch = cu_seqlens.shape[0] - 1
    blocks = _short_bwd_blocks(head_dim, max_seqlen)
    extras = None
    if fp8 or colsums:  # partial-sum rows: a bucket's (short path), else a program's along the sequence
        tiles = len(blocks) if blocks is not None else cdiv(max_seqlen, min(
            _launch_config("dq", head_dim, max_seqlen, q.device)[0],
            _launch_config("dkdv", head_dim, max_seqlen, q.device)[1]))
        extras = _Extras(fp8, dqkv, tiles * batch)
    empty = total == 0 or batch == 0 or max_seqlen == 0
    if not empty:
        _launch_backward(dout, q, k, v, out, lse, mask, cu_seqlens, max_seqlen, dropout_p, softmax_scale,
                         (dq, dk, dv), blocks, extras)
    if fp8:
        codes = dqkv.view(total, 3 * nheads * head_dim).view(E5M2)  # no -1: T may be 0
        return codes, transpose_codes(codes), extras.scale_inv, extras.sums()
    return (dqkv, extras.sums()) if colsums else dqkv


class _Extras:
    """What the backward writes besides the gradient (``_backward_packed``'s ``colsums`` or ``fp8``): the column
    sums' partial rows and, with ``fp8``, scale_inv and the amax (the kernels' trailing arguments)."""

    def __init__(self, fp8, dqkv, part_rows: int):
        _, _, nheads, head_dim = dqkv.shape
        width = 3 * nheads * head_dim
        self.fp8 = fp8 is not None
        self.parts = torch.zeros((part_rows, width), dtype=torch.float32, device=dqkv.device)
        if fp8:
            history, row = fp8
            self.scale_inv = torch.ones((), dtype=torch.float32, device=dqkv.device)  # kept where no program runs
            self.kernel_args = (history.amax[row], history.step, self.scale_inv, self.parts, width)
        else:  # the FP8 pointers unused
            self.kernel_args = (self.parts, self.parts, self.parts, self.parts, width)

    def sums(self):
        return column_sums(self.parts)


_WORK_LISTS = [None]  # the last lists built outside a capture: (weakref to cu_seqlens, its _version, blocks, lists)


def _short_work_lists(cu_seqlens, blocks):
    """The fused short backward's work lists ``((N_BUCKETS, 2, batch) int32, (N_BUCKETS,) int32)``: each bucket's
    sequence starts and lengths, and counts, made on the device (no sync) by ``_short_lists_kernel``. Every layer's
    backward reads the same ``cu_seqlens``, so a backward pass builds them once: the lists of the last call are
    reused while it is the same tensor, unchanged (its version counter) and the same buckets (an eager BERT-base
    step: 12 launches and 24 allocations fewer). Not while a CUDA graph is captured: lists made before the capture
    would be replayed with the values of that moment, so a capture builds its own and keeps none."""
    capturing = cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()
    cached = _WORK_LISTS[0]
    if (not capturing and cached is not None and cached[0]() is cu_seqlens and cached[1] == cu_seqlens._version
            and cached[2] == blocks):
        return cached[3]
    batch = cu_seqlens.shape[0] - 1
    lists = torch.empty((len(blocks), 2, batch), dtype=torch.int32, device=cu_seqlens.device)
    counts = torch.empty((len(blocks),), dtype=torch.int32, device=cu_seqlens.device)
    _short_lists_kernel[(1,)](cu_seqlens, lists, counts, batch, N_BUCKETS=len(blocks), SMALLEST=blocks[0],
                              CHUNK=1024)
    if not capturing:
        _WORK_LISTS[0] = (weakref.ref(cu_seqlens), cu_seqlens._version, list(blocks), (lists, counts))
    return lists, counts


def _launch_backward(dout, q, k, v, out, lse, mask, cu_seqlens, max_seqlen, dropout_p, softmax_scale, grads,
                     blocks, extras):
    """Launch the backward kernels writing ``grads`` = (dq, dk, dv) (bytes with FP8 ``extras``) and ``extras``
    (``_Extras`` or None)."""
    dq, dk, dv = grads
    total, nheads, head_dim = q.shape
    batch = cu_seqlens.shape[0] - 1
    consts = dict(_kernel_constants(q, dropout_p), FP8_OUT=extras is not None and extras.fp8,
                  COLSUMS=extras is not None, HW=not INTERPRET, HISTORY_LEN=HISTORY)
    # hist, step, scale_inv, parts, stride_part (unused pointers and 0 without extras)
    fp8_kv = extras.kernel_args if extras is not None else (lse, lse, lse, lse, 0)
    common = (lse.stride(0), *_mask_strides(mask), softmax_scale * _LOG2E, softmax_scale,
              _dropout_args(dropout_p)[1])
    strides_in = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                  dout.stride(0), dout.stride(1), out.stride(0), out.stride(1), dq.stride(0), dq.stride(1))
    strides_kv = (dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1))
    if blocks is not None:
        lists, counts = _short_work_lists(cu_seqlens, blocks)
        for j, block in enumerate(blocks):
            warps, programs, stages = _short_bwd_launch(block, q, consts["BLOCK_D"])
            _bwd_short_kernel[(programs,)](
                q, k, v, out, dout, lse, mask, dq, dk, dv, lists[j], counts[j:], *strides_in, *strides_kv, *common,
                nheads, batch, j * batch, *fp8_kv, BLOCK=block, STAGES=stages, num_warps=warps,
                num_stages=stages, **consts)
        return
    delta = torch.empty((nheads, total), dtype=torch.float32, device=q.device)

    block_m, block_n, warps, stages = _launch_config("dq", head_dim, max_seqlen, q.device)
    _bwd_dq_kernel[(cdiv(max_seqlen, block_m), batch, nheads)](  # writes delta: runs first
        q, k, v, out, dout, lse, delta, mask, dq, cu_seqlens, *strides_in[:8], out.stride(0), out.stride(1),
        dq.stride(0), dq.stride(1), *common, *fp8_kv[:2], *fp8_kv[3:],
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **consts)

    block_m, block_n, warps, stages = _launch_config("dkdv", head_dim, max_seqlen, q.device)
    _bwd_dkdv_kernel[(cdiv(max_seqlen, block_n), batch, nheads)](
        q, k, v, dout, lse, delta, mask, dk, dv, cu_seqlens, *strides_in[:8], *strides_kv, *common,
        *fp8_kv, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **consts)


# ============================================================================ torch custom ops
def _fwd_fake(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed):
    total, nheads, head_dim = q.shape
    return (q.new_empty((total, nheads, head_dim)), q.new_empty((nheads, total), dtype=torch.float32),
            q.new_empty(_mask_shape(total, nheads, max_seqlen, dropout_p), dtype=torch.int32))


def _bwd_fake(dout, q, k, v, out, lse, mask, cu_seqlens, max_seqlen, dropout_p, softmax_scale):
    total, nheads, head_dim = q.shape
    return q.new_empty((total, 3, nheads, head_dim))


_fwd_op = register_op(
    "varlen_attention_fwd",
    "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, SymInt max_seqlen, float dropout_p, float softmax_scale, "
    "Tensor? seed) -> (Tensor, Tensor, Tensor)",
    varlen_attention_forward, _fwd_fake)
_BWD_ARGS = ("(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor mask, Tensor cu_seqlens, "
             "SymInt max_seqlen, float dropout_p, float softmax_scale)")
_bwd_op = register_op("varlen_attention_bwd", _BWD_ARGS + " -> Tensor", _backward_packed, _bwd_fake)


def _backward_colsums(dout, q, k, v, out, lse, mask, cu_seqlens, max_seqlen, dropout_p, softmax_scale):
    """``(dqkv, its fp32 column sums)``: ``_backward_packed(..., colsums=True)``."""
    return _backward_packed(dout, q, k, v, out, lse, mask, cu_seqlens, max_seqlen, dropout_p, softmax_scale,
                            colsums=True)


def _bwd_colsums_fake(dout, q, k, v, out, lse, mask, cu_seqlens, max_seqlen, dropout_p, softmax_scale):
    total, nheads, head_dim = q.shape
    return q.new_empty((total, 3, nheads, head_dim)), q.new_empty((3 * nheads * head_dim,), dtype=torch.float32)


bwd_colsums_op = register_op("varlen_attention_bwd_colsums", _BWD_ARGS + " -> (Tensor, Tensor)", _backward_colsums,
                             _bwd_colsums_fake)


# ============================================================================ autograd + entry point
class VarlenAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed):
        out, lse, mask = _fwd_op(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed)
        ctx.save_for_backward(q, k, v, out, lse, mask, cu_seqlens)
        ctx.args = (max_seqlen, dropout_p, softmax_scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = _bwd_op(dout, q, k, v, out, lse, mask, cu_seqlens, *ctx.args).unbind(1)  # (T, nh, hd) each
        return dq, dk, dv, None, None, None, None, None


class VarlenAttentionQKVPackedFunction(torch.autograd.Function):
    """Attention over one packed ``(T, 3, nh, hd)`` QKV tensor whose gradient is produced packed,
    so the model's QKV projection gets ``dqkv`` without the stack copy that ``unbind``'s backward
    would make."""

    @staticmethod
    def forward(ctx, qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed):
        q, k, v = qkv.unbind(1)  # (T, nh, hd) views
        out, lse, mask = _fwd_op(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed)
        ctx.save_for_backward(qkv, out, lse, mask, cu_seqlens)
        ctx.args = (max_seqlen, dropout_p, softmax_scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        qkv, out, lse, mask, cu_seqlens = ctx.saved_tensors
        q, k, v = qkv.unbind(1)
        return _bwd_op(dout, q, k, v, out, lse, mask, cu_seqlens, *ctx.args), None, None, None, None, None


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_cu_seqlens(cu_seqlens):
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise TypeError(f"cu_seqlens must be a 1-D int32 tensor (fastbert.padding.unpad_mask makes one); "
                        f"got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")


def _check_inputs(q, k, v, cu_seqlens, dropout_p):
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one (total_tokens, heads, head_dim) shape; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise TypeError(f"q, k, v must share one dtype among fp16/bf16/fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] > 128:
        raise ValueError(f"head_dim {q.shape[-1]} > 128 is not supported by the Triton kernel; "
                         "use kernels='torch' (varlen_attention_ref)")
    check_cu_seqlens(cu_seqlens)
    if not (q.device == k.device == v.device == cu_seqlens.device):
        raise ValueError("q, k, v and cu_seqlens must be on one device")
    check_triton_device(q)
    check_dropout_p(dropout_p)


def _scale_and_seed(head_dim: int, softmax_scale, dropout_p: float, seed, device):
    """The softmax scale (default 1/sqrt(head_dim)) and the kernels' dropout seed tensor
    (``_common.dropout_seed``: ``None`` draws a fresh one on the device)."""
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    return scale, dropout_seed(dropout_p, seed, device)


def varlen_attention(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, seed=None):
    """Fused attention over unpadded sequences; same signature and semantics as ``varlen_attention_ref``.

    ``max_seqlen`` must be at least the longest sequence in ``cu_seqlens``. ``seed`` (int or tensor)
    fixes the dropout mask; ``None`` draws one on the device, so ``torch.manual_seed`` makes runs
    repeatable. The forward keeps the mask it drew as bits (1/16 of a bf16 score matrix) for the backward.
    """
    _check_inputs(q, k, v, cu_seqlens, dropout_p)
    cast = autocast_dtype(q.device)
    if cast is not None and q.dtype == torch.float32:  # as F.scaled_dot_product_attention under autocast
        q, k, v = q.to(cast), k.to(cast), v.to(cast)
    scale, seed = _scale_and_seed(q.shape[-1], softmax_scale, dropout_p, seed, q.device)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return VarlenAttentionFunction.apply(q, k, v, cu_seqlens, max_seqlen, float(dropout_p), scale, seed)


def varlen_attention_qkvpacked(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, seed=None):
    """:func:`varlen_attention` on one packed ``qkv`` of shape ``(total_tokens, 3, heads, head_dim)``
    (the fused QKV projection's output viewed as such); the gradient comes back packed too."""
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must be (total_tokens, 3, heads, head_dim), got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(1)
    _check_inputs(q, k, v, cu_seqlens, dropout_p)
    cast = autocast_dtype(qkv.device)
    if cast is not None and qkv.dtype == torch.float32:
        qkv = qkv.to(cast)
    scale, seed = _scale_and_seed(qkv.shape[-1], softmax_scale, dropout_p, seed, qkv.device)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    return VarlenAttentionQKVPackedFunction.apply(qkv, cu_seqlens, max_seqlen, float(dropout_p), scale, seed)


def varlen_attention_qkvpacked_ref(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, seed=None):
    """Reference for :func:`varlen_attention_qkvpacked`."""
    q, k, v = qkv.unbind(1)
    return varlen_attention_ref(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed)
