"""Variable-length (unpadded) multi-head attention.

``q, k, v``: ``(total_tokens, heads, head_dim)`` (views of one packed QKV are fine), int32
``cu_seqlens`` ``(batch + 1,)``. Returns ``(total_tokens, heads, head_dim)``.

Top to bottom: the plain-PyTorch reference (pads per sequence internally), the host wrappers
``varlen_attention_forward`` / ``varlen_attention_backward`` with the kernels' launch configurations, the torch
custom ops that let ``torch.compile`` wrap them, the ``autograd.Function`` and ``varlen_attention``. The Triton
kernels they launch are in ``attention_kernels.py``.
"""
from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F

from fastbert.ops._common import (
    INTERPRET, autocast_dtype, cdiv, check_dropout_p, check_triton_device, column_sums, drop_threshold, dropout_seed,
    next_power_of_2, num_sms, register_op)
from fastbert.ops.attention_kernels import (
    _LOG2E, _bwd_dkdv_kernel, _bwd_dq_kernel, _bwd_short_kernel, _fwd_kernel, _short_lists_kernel)
from fastbert.ops.fp8 import E5M2, HISTORY, transpose_codes
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
