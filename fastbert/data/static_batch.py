"""Static-shape pretraining batches: every micro-batch has the same tensor shapes, whatever its text.

A micro-batch is ``rows`` rows of ``seq_len`` tokens. Each row holds up to ``per_row`` prepared
sequences back to back (``[CLS] A [SEP] B [SEP]`` each), then padding. The encoder sees all
``rows * seq_len`` tokens as one ``(tokens,)`` batch split into segments by ``cu_seqlens``: per row,
one segment per sequence slot (empty slots have length 0) and one for the padding tail, so
attention never crosses a sequence boundary and the padding only attends to itself (it is never
predicted and never pooled). Position ids restart at 0 for every sequence; token types come from the
prepared data; NSP reads each sequence's first token.

Every array has a size fixed by ``(rows, seq_len, per_row)``: ``cu_seqlens`` is
``rows * (per_row + 1) + 1`` long, NSP slots are ``rows * per_row`` (label -100 where empty), and
``max_seqlen`` is ``seq_len``. So Triton tunes each kernel once, nothing in a step needs a length
from the device, and the step could be captured as a CUDA graph. Built on the host (numpy) in the
loader thread; the model's static entry point is ``BertForPreTraining(..., packed=batch)``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from fastbert.data.masking import IGNORE_INDEX


def build_rows(rows: Sequence[Sequence[tuple]], seq_len: int, per_row: int, pad_id: int,
               nsp: bool) -> dict:
    """``rows``: for each row, its sequences as ``(ids, b_start, is_random_next)`` (``b_start`` 0:
    no segment B). Returns numpy arrays (see the module docstring)."""
    n_rows = len(rows)
    ids = np.full((n_rows, seq_len), pad_id, dtype=np.int64)
    mask = np.zeros((n_rows, seq_len), dtype=np.int64)
    types = np.zeros((n_rows, seq_len), dtype=np.int64)
    positions = np.zeros((n_rows, seq_len), dtype=np.int64)
    seg = np.zeros((n_rows, per_row + 1), dtype=np.int64)         # segment lengths, padding tail last
    cls = np.zeros((n_rows, per_row), dtype=np.int64)
    nsp_label = np.full((n_rows, per_row), IGNORE_INDEX, dtype=np.int64)
    for r, row in enumerate(rows):
        if len(row) > per_row:
            raise ValueError(f"row {r} holds {len(row)} sequences, more than per_row={per_row}")
        at = 0
        for k, (s, b_start, random_next) in enumerate(row):
            n = len(s)
            if at + n > seq_len:
                raise ValueError(f"row {r}: sequences of {at + n} tokens do not fit seq_len={seq_len}")
            ids[r, at:at + n] = s
            mask[r, at:at + n] = 1
            if b_start:
                types[r, at + b_start:at + n] = 1
            positions[r, at:at + n] = np.arange(n)
            seg[r, k] = n
            cls[r, k] = r * seq_len + at
            nsp_label[r, k] = int(random_next)
            at += n
        seg[r, per_row] = seq_len - at
        cls[r, len(row):] = r * seq_len                      # empty slots: any valid row, never counted
    cu = np.zeros(n_rows * (per_row + 1) + 1, dtype=np.int32)
    np.cumsum(seg.reshape(-1), out=cu[1:])
    out = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "position_ids": positions,
           "cu_seqlens": cu, "cls_positions": cls.reshape(-1)}
    if nsp:
        out["next_sentence_label"] = nsp_label.reshape(-1)
    return out


def pack_rows(lengths: Sequence[int], seq_len: int, per_row: int) -> list[list[int]]:
    """Group sequences (by their index in ``lengths``, kept in order within a row) into rows of at
    most ``seq_len`` tokens and ``per_row`` sequences: first fit over the rows opened so far, so short
    sequences fill the gaps that long ones leave. Deterministic for given lengths."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        if n > seq_len:
            raise ValueError(f"sequence {i} has {n} tokens, more than seq_len={seq_len}")
        for r, free in enumerate(room):
            if n <= free and len(rows[r]) < per_row:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(seq_len - n)
    return rows
