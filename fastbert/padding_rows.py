"""Positions where ``attention_mask`` is 0, computed the way HF computes them, only when read.

HF runs every position of a padded ``(batch, seq)`` batch through the encoder. A position whose
mask is 0 is a query like any other: it attends to its row's real tokens (its own key is masked
out, so no token attends to it) and goes through every layer, so its hidden state is a real value,
not 0. HF's pooler reads position 0 whatever its mask, and HF's losses count labels wherever they
are (masked-LM / token-classification labels on padding, a question-answering span softmax over
every position).

fastbert unpads to the real tokens (``fastbert.padding``) and adds, after them, one *padding row*
per masked position that a result reads: position 0 for a pooler, positions holding a label, every
position for a question-answering loss. Row-wise work (embeddings, projections, FFN, LayerNorm) runs
on real tokens and padding rows together; attention runs the varlen kernel on the real tokens and
:func:`attend` for the padding rows (queries over their row's real keys, HF's masked softmax).
So a padding row's value is HF's, and a masked position no result reads costs nothing.

A row whose mask is all 0 has no key to attend to: its padding rows get a zero attention context
(HF's eager attention spreads such a row uniformly over its padding, SDPA differs again).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from fastbert.ops.attention import attention_probs_ref
from fastbert.padding import Unpadded, pad, unpad_mask


class Rows(NamedTuple):
    """The rows the encoder computes for a ``(batch, seq)`` batch: ``real`` tokens, then padding rows."""

    real: Unpadded             # the real tokens: the keys of attention, first in every (rows, ...) tensor
    extra: torch.Tensor        # (E,) int64 flat positions (batch * seq grid) of the padding rows, ascending
    extra_batch: torch.Tensor  # (E,) int64 batch row of each padding row
    extra_slot: torch.Tensor   # (E,) int64 rank of each padding row among its batch row's padding rows
    max_extra: int             # most padding rows in one batch row (0 when E == 0)

    @property
    def num_extra(self) -> int:
        return self.extra.numel()

    @property
    def placed(self) -> Unpadded:
        """``real`` with the padding rows' positions appended to ``indices``: ``pad(x, rows.placed)`` puts
        every computed row of ``x`` at its position (``cu_seqlens`` / ``max_seqlen`` still describe
        the real tokens only)."""
        if not self.num_extra:
            return self.real
        return self.real._replace(indices=torch.cat([self.real.indices, self.extra]))


def padding_need_counts(attention_mask: torch.Tensor, need: torch.Tensor | None) -> torch.Tensor | None:
    """``(batch,)`` number of masked positions that ``need`` (``(batch, seq)`` bool) asks for, or None."""
    if need is None:
        return None
    return (need & ~attention_mask.bool()).sum(dim=1)


def select_rows(info: Unpadded, attention_mask: torch.Tensor, need: torch.Tensor | None,
                max_extra: int | None = None) -> Rows:
    """The Rows of a batch: ``info``'s real tokens plus a padding row for every masked position in
    ``need``. ``max_extra`` (the max of :func:`padding_need_counts`) saves a device sync when the
    caller fetched it already; 0 means no padding row."""
    empty = info.indices.new_zeros(0)
    counts = padding_need_counts(attention_mask, need)
    if counts is not None and max_extra is None:
        max_extra = int(counts.max().item()) if counts.numel() else 0
    if counts is None or not max_extra:
        return Rows(info, empty, empty, empty, 0)
    want = (need & ~attention_mask.bool()).flatten()
    extra = torch.nonzero(want, as_tuple=False).flatten()
    batch = torch.div(extra, info.seqlen, rounding_mode="floor")
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(extra.numel(), device=extra.device) - starts[batch]
    return Rows(info, extra, batch, slot, int(max_extra))


def unpad_rows(attention_mask: torch.Tensor, need: torch.Tensor | None) -> Rows:
    """:func:`select_rows` from a mask alone, the longest length and the padding-row count fetched
    from the device in one transfer."""
    info = unpad_mask(attention_mask, max_seqlen=0)
    if not attention_mask.numel():
        return select_rows(info, attention_mask, None)
    counts = padding_need_counts(attention_mask, need)
    longest = info.cu_seqlens.diff().max().long()
    longest, max_extra = torch.stack([longest, counts.max().long() if counts is not None else longest * 0]).tolist()
    return select_rows(info._replace(max_seqlen=int(longest)), attention_mask, need, max_extra=int(max_extra))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Rows, softmax_scale: float,
           dropout_p: float = 0.0) -> torch.Tensor:
    """Attention context ``(E, nh, hd)`` of the padding rows' queries ``q`` ``(E, nh, hd)`` over the
    real tokens' keys and values ``k``, ``v`` ``(T, nh, hd)`` of their own batch row (HF's masked
    softmax; plain PyTorch, on a ``(batch, max_extra)`` grid of queries)."""
    real = rows.real
    B = real.batch
    E, nh, hd = q.shape
    kp, vp = pad(k, real), pad(v, real)                               # (B, S, nh, hd), 0 at padding
    qp = q.new_zeros(B, rows.max_extra, nh, hd)
    qp = qp.index_put((rows.extra_batch, rows.extra_slot), q)         # (B, Emax, nh, hd)
    scores = torch.einsum("bqhd,bkhd->bhqk", qp, kp) * softmax_scale  # (B, nh, Emax, S)
    scores = scores.masked_fill(~key_mask(real)[:, None, None, :], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p, training=True)
    ctx = torch.einsum("bhqk,bkhd->bqhd", probs, vp)                  # (B, Emax, nh, hd)
    return ctx[rows.extra_batch, rows.extra_slot]                      # (E, nh, hd)


def with_padding_rows(real_attention, qkv: torch.Tensor, rows: Rows | None, softmax_scale: float,
                      dropout_p: float = 0.0) -> torch.Tensor:
    """Attention context ``(T + E, nh, hd)`` of ``qkv`` ``(T + E, 3, nh, hd)`` (real tokens, then padding
    rows): ``real_attention(qkv[:T])`` (the varlen kernel) for the real tokens, :func:`attend` for the rest."""
    if rows is None or not rows.num_extra:
        return real_attention(qkv)
    T = qkv.shape[0] - rows.num_extra
    ctx = real_attention(qkv[:T])
    q, k, v = qkv[T:, 0], qkv[:T, 1], qkv[:T, 2]
    return torch.cat([ctx, attend(q, k, v, rows, softmax_scale, dropout_p)])


def attention_maps_or_packed(qkv: torch.Tensor, rows: Rows | None, cu_seqlens, max_seqlen: int,
                             softmax_scale: float) -> torch.Tensor:
    """Attention maps of ``qkv`` ``(rows, 3, nh, hd)``: HF's ``(batch, nh, seq, seq)`` with ``rows``
    (:func:`attention_maps`), else per packed sequence ``(sequences, nh, max_seqlen, max_seqlen)``."""
    if rows is None:
        return attention_probs_ref(qkv[:, 0], qkv[:, 1], cu_seqlens, max_seqlen, softmax_scale)
    T = qkv.shape[0] - rows.num_extra
    return attention_maps(qkv[:, 0], qkv[:T, 1], rows, softmax_scale)


def key_mask(real: Unpadded) -> torch.Tensor:
    """``(batch, seq)`` bool: True at the real tokens."""
    mask = torch.zeros(real.batch * real.seqlen, dtype=torch.bool, device=real.indices.device)
    mask[real.indices] = True
    return mask.view(real.batch, real.seqlen)


def attention_maps(q: torch.Tensor, k: torch.Tensor, rows: Rows, softmax_scale: float) -> torch.Tensor:
    """HF's ``(batch, nh, seq, seq)`` attention maps (before dropout) at the tokens' own positions:
    row i is the query at position i (0 where no row was computed), column j the key at position j
    (0 at padding). ``q``: every computed row ``(T + E, nh, hd)``; ``k``: the real tokens ``(T, nh, hd)``."""
    placed = rows.placed
    qp = pad(q, placed)                                               # (B, S, nh, hd)
    kp = pad(k, rows.real)
    scores = torch.einsum("bqhd,bkhd->bhqk", qp, kp) * softmax_scale  # (B, nh, S, S)
    scores = scores.masked_fill(~key_mask(rows.real)[:, None, None, :], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    computed = key_mask(placed)                                       # (B, S): rows that exist
    return probs * computed[:, None, :, None].to(probs.dtype)


def position_rows(rows: Rows, position: int = 0) -> torch.Tensor:
    """``(batch,)`` int64: where each batch row's computed row at ``position`` lies among the computed rows (the
    real tokens, then the padding rows), or the number of computed rows where none was."""
    placed = rows.placed
    n = placed.indices.numel()
    where = torch.full((placed.batch * placed.seqlen,), n, dtype=torch.long, device=placed.indices.device)
    where[placed.indices] = torch.arange(n, device=placed.indices.device)
    return where.view(placed.batch, placed.seqlen)[:, position]


def at_position(x: torch.Tensor, rows: Rows, position: int = 0) -> torch.Tensor:
    """``(batch, *rest)``: each batch row's computed row at ``position`` (0 where none was computed)."""
    padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return padded.index_select(0, position_rows(rows, position))


def pooled_position(ids: torch.Tensor | None) -> torch.Tensor | None:
    """``(batch, seq)`` bool, True at position 0 (what HF's pooler reads) for ``(batch, seq, ...)`` ids
    or embeddings, or None."""
    if ids is None or ids.dim() < 2:
        return None
    need = torch.zeros(ids.shape[:2], dtype=torch.bool, device=ids.device)
    need[:, 0] = True
    return need


def label_positions(labels: torch.Tensor | None, ignore_index: int = -100) -> torch.Tensor | None:
    """``(batch, seq)`` bool of the positions holding a label (what a token-level loss reads), or None."""
    return None if labels is None else labels != ignore_index


def union(*needs: torch.Tensor | None) -> torch.Tensor | None:
    """Positions any of ``needs`` reads (None entries are skipped; None when all are)."""
    present = [n for n in needs if n is not None]
    if not present:
        return None
    out = present[0]
    for n in present[1:]:
        out = out | n
    return out
