"""Static-shape batches: pretraining micro-batches with the same tensor shapes whatever their text,
and fine-tuning batches whose shapes come from a short list of token buckets.

A micro-batch is ``rows`` rows of ``seq_len`` tokens. Each row holds up to ``per_row`` prepared
sequences back to back (``[CLS] A [SEP] B [SEP]`` each), then padding. The encoder sees all
``rows * seq_len`` tokens as one ``(tokens,)`` batch split into segments by ``cu_seqlens``: per row,
one segment per sequence slot (empty slots have length 0) and one for the padding tail, so
attention never crosses a sequence boundary and the padding only attends to itself (it is never
predicted and never pooled). Position ids restart at 0 for every sequence; token types come from the
prepared data; NSP reads each sequence's first token.

Spans (``span`` > 1): ``span`` consecutive rows form one packing bin of ``span * seq_len`` tokens and
``span * per_row`` sequences, so a sequence may continue from one row into the next: the rows are only
the batch's shape, the encoder sees one token stream. Sequences of 90-125 tokens fill 128-token rows
to ~90% one bin a row, ~97% four rows a bin (``benchmarks/RESULTS.md``). A bin's ``span * (per_row + 1)``
segments are its sequences, then empty slots, then its padding as the fewest segments of at most
``seq_len`` tokens in its last slots (so the first ``span * per_row`` slots hold only sequences); with
``span`` 1 that is the row layout above.

Every array has a size fixed by ``(rows, seq_len, per_row)``: ``cu_seqlens`` is
``rows * (per_row + 1) + 1`` long, NSP slots are ``rows * per_row`` (label -100 where empty), and
``max_seqlen`` is ``seq_len`` (no segment is longer). So Triton tunes each kernel once, nothing in a step needs a length
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
               nsp: bool, span: int = 1) -> dict:
    """``rows``: for each bin of ``span`` rows, its sequences as ``(ids, b_start, is_random_next)`` (``b_start`` 0:
    no segment B). Returns numpy arrays of ``len(rows) * span`` rows (see the module docstring)."""
    n_bins, width, slots = len(rows), span * seq_len, span * per_row
    ids = np.full((n_bins, width), pad_id, dtype=np.int64)
    mask = np.zeros((n_bins, width), dtype=np.int64)
    types = np.zeros((n_bins, width), dtype=np.int64)
    positions = np.zeros((n_bins, width), dtype=np.int64)
    seg = np.zeros((n_bins, slots + span), dtype=np.int64)        # segment lengths, padding in the last slots
    cls = np.zeros((n_bins, slots), dtype=np.int64)
    nsp_label = np.full((n_bins, slots), IGNORE_INDEX, dtype=np.int64)
    for r, row in enumerate(rows):
        if len(row) > slots:
            raise ValueError(f"row {r} holds {len(row)} sequences, more than per_row={per_row}"
                             + (f" x span {span}" if span > 1 else ""))
        at = 0
        for k, (s, b_start, random_next) in enumerate(row):
            n = len(s)
            if at + n > width:
                raise ValueError(f"row {r}: sequences of {at + n} tokens do not fit "
                                 + (f"{span} rows of seq_len={seq_len}" if span > 1 else f"seq_len={seq_len}"))
            ids[r, at:at + n] = s
            mask[r, at:at + n] = 1
            if b_start:
                types[r, at + b_start:at + n] = 1
            positions[r, at:at + n] = np.arange(n)
            seg[r, k] = n
            cls[r, k] = r * width + at
            nsp_label[r, k] = int(random_next)
            at += n
        pad = width - at                                   # at most span segments of seq_len, ending the bin
        chunks = max(1, -(-pad // seq_len))
        seg[r, slots + span - chunks:] = [min(seq_len, pad - i * seq_len) for i in range(chunks)]
        cls[r, len(row):] = r * width                      # empty slots: any valid row, never counted
    cu = np.zeros(n_bins * (slots + span) + 1, dtype=np.int32)
    np.cumsum(seg.reshape(-1), out=cu[1:])
    out = {"input_ids": ids.reshape(-1, seq_len), "attention_mask": mask.reshape(-1, seq_len),
           "token_type_ids": types.reshape(-1, seq_len), "position_ids": positions.reshape(-1, seq_len),
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
