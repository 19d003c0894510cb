"""Unpad / pad between HF's ``(batch, seq, ...)`` layout and the encoder's ``(total_tokens, ...)``.

The encoder unpads once on entry: ``indices`` are the flat positions of real tokens in the
``(batch * seq)`` grid, ``cu_seqlens`` (int32, ``(batch + 1,)``) the prefix sum of the lengths.
Any 0/1 mask works (right or left padding, holes): a sequence's tokens are its real positions in
order, and callers take position ids from the padded row, as HF does (``fastbert.padding_rows``
adds the masked positions a result reads).
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Unpadded(NamedTuple):
    indices: torch.Tensor     # (total_tokens,) int64 positions in the flattened (batch * seq) grid
    cu_seqlens: torch.Tensor  # (batch + 1,) int32
    max_seqlen: int
    batch: int
    seqlen: int


def unpad_mask(attention_mask: torch.Tensor, max_seqlen: int | None = None) -> Unpadded:
    """Describe the real tokens of a ``(batch, seq)`` 0/1 mask.

    ``max_seqlen=None`` computes the longest length (a device sync); a caller that fetches it
    together with other values passes a placeholder and replaces it (``info._replace``).
    """
    batch, seqlen = attention_mask.shape
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    if max_seqlen is None:
        max_seqlen = int(lengths.max().item()) if batch else 0
    return Unpadded(indices, cu_seqlens, max_seqlen, batch, seqlen)


def unpad(x: torch.Tensor, info: Unpadded) -> torch.Tensor:
    """``(batch, seq, *rest) -> (total_tokens, *rest)``."""
    return x.reshape(info.batch * info.seqlen, *x.shape[2:]).index_select(0, info.indices)


def pad(x: torch.Tensor, info: Unpadded, value: float = 0.0) -> torch.Tensor:
    """``(total_tokens, *rest) -> (batch, seq, *rest)``, filling padding with ``value``."""
    out = x.new_full((info.batch * info.seqlen, *x.shape[1:]), value)
    out = out.index_copy(0, info.indices, x)
    return out.view(info.batch, info.seqlen, *x.shape[1:])


def seqlens_to_mask(cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """The ``(batch, max_seqlen)`` bool mask of the real tokens described by ``cu_seqlens``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.arange(max_seqlen, device=cu_seqlens.device)[None, :] < lengths[:, None]


def unpad_by_seqlens(x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> Unpadded:
    """The Unpadded description of a batch padded to ``max_seqlen`` with lengths from ``cu_seqlens``."""
    mask = seqlens_to_mask(cu_seqlens, max_seqlen)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    return Unpadded(indices, cu_seqlens, max_seqlen, cu_seqlens.numel() - 1, max_seqlen)
