"""The Triton kernels of variable-length attention (``attention.py`` holds the reference, the launches and the
autograd around them): a flash-style forward that stores the log-sum-exp and, with dropout, the mask it drew as
bits; the backward as dQ (which also computes the softmax row term delta) then dK/dV, or for sequences up to 128
tokens one persistent kernel per length bucket whose programs loop over (sequence, head) tiles, the next tile's
loads in flight during this one's GEMMs, with the work lists it loops over (``_short_lists_kernel``).
"""
from __future__ import annotations

from fastbert.ops._common import dropout_bits, fast_launch, keep_from_bits, tl, triton
from fastbert.ops.fp8 import E5M2, FP8_MAX, _fp8_codes, finite_amax_of, history_scale

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

    q = _load_rows(Q, start64, head, stride_qt, stride_qh, offs_m, offs_d, mask_md)
    do = _load_rows(DO, start64, head, stride_dot, stride_doh, offs_m, offs_d, mask_md)
    o = _load_rows(O, start64, head, stride_ot, stride_oh, offs_m, offs_d, mask_md)
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
