"""Static-shape batches: pretraining micro-batches with the same tensor shapes whatever their text,
and fine-tuning batches whose shapes come from a short list of token buckets.

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

Fine-tuning (``pack_examples``): a batch's examples lie back to back, one ``cu_seqlens`` segment
each, followed by padding tokens up to a token bucket (``token_bucket``: 64 x 1, 2, 3, 4, 6, 8,
12, ...; above 128 tokens at most 1.5x the real count) in ``ceil(bucket / max_seqlen)`` segments
of at most ``max_seqlen`` tokens (empty ones have length 0). So a batch's shapes depend only on
(bucket, examples), a few values repeat all run long, and the loss is HF's per-example loss:
padding is never pooled.
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


# ----------------------------------------------------------------------------------------- fine-tuning
def token_bucket(n: int, granularity: int = 64) -> int:
    """The smallest of ``granularity`` x (1, 2, 3, 4, 6, 8, 12, 16, ...) that holds ``n`` tokens."""
    units = max(1, -(-n // granularity))
    size = 1 << (units - 1).bit_length()           # the power of two >= units
    if size >= 4 and units <= size * 3 // 4:
        size = size * 3 // 4
    return size * granularity


def pack_examples(rows: Sequence[dict], max_seqlen: int, pad_id: int = 0, granularity: int = 64) -> dict:
    """Fine-tuning rows (``input_ids``, ``token_type_ids`` lists, ``labels``) as one static-shape
    batch (see the module docstring): ``input_ids`` / ``token_type_ids`` / ``position_ids``
    ``(bucket,)``, ``cu_seqlens`` int32 ``(len(rows) + ceil(bucket / max_seqlen) + 1,)``,
    ``cls_positions`` ``(len(rows),)`` and ``labels`` when the rows carry them; numpy arrays."""
    lengths = [len(r["input_ids"]) for r in rows]
    for i, n in enumerate(lengths):
        if n > max_seqlen:
            raise ValueError(f"example {i} has {n} tokens, more than max_seqlen={max_seqlen}")
    total = sum(lengths)
    bucket = token_bucket(total, granularity)
    fill = -(-bucket // max_seqlen)
    ids = np.full(bucket, pad_id, dtype=np.int64)
    types = np.zeros(bucket, dtype=np.int64)
    positions = np.zeros(bucket, dtype=np.int64)
    seg = np.zeros(len(rows) + fill, dtype=np.int64)
    at = 0
    for k, (r, n) in enumerate(zip(rows, lengths)):
        ids[at:at + n] = r["input_ids"]
        if "token_type_ids" in r:
            types[at:at + n] = r["token_type_ids"]
        positions[at:at + n] = np.arange(n)
        seg[k] = n
        at += n
    left = bucket - total
    for k in range(fill):                              # the padding tail, in pieces of <= max_seqlen
        n = min(left, max_seqlen)
        positions[at:at + n] = np.arange(n)
        seg[len(rows) + k] = n
        at, left = at + n, left - n
    cu = np.zeros(len(seg) + 1, dtype=np.int32)
    np.cumsum(seg, out=cu[1:])
    out = {"input_ids": ids, "token_type_ids": types, "position_ids": positions, "cu_seqlens": cu,
           "cls_positions": cu[:len(rows)].astype(np.int64)}
    if rows and "labels" in rows[0]:
        labels = np.asarray([r["labels"] for r in rows])
        out["labels"] = labels.astype(np.float32) if labels.dtype.kind == "f" else labels  # as pad_batch gives
    return out
