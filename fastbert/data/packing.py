"""Packing tokenized documents into pretraining sequences (google-research/bert's
``create_instances_from_document``, made deterministic for a given ``random.Random``).

A document is a list of sentences, each a list of token ids. Every sequence comes from ONE document
(plus, for a random-next NSP pair, a segment B from another document). Target length: ``max_num``
tokens, or with probability ``short_seq_prob`` a uniform length in [2, max_num] so the model also
sees short inputs (as in fine-tuning).

* NSP (``nsp=True``): ``[CLS] A [SEP] B [SEP]``. Sentences are gathered until the target; a random
  split point makes A; with probability 1/2 (or always, when only one sentence was gathered, as in
  the original) B comes from a random other document and the sentences not used go back to the
  stream; otherwise B is the actual continuation. The coin leans against the running imbalance so
  that forced random pairs do not skew the labels (plain BERT gives ~56% random on Wikipedia). Pairs longer than ``max_seq_len - 3`` are trimmed
  one token at a time from the longer segment, at its front or back at random.
* MLM only (``nsp=False``): ``[CLS] A [SEP]`` with whole sentences up to the target (a sentence that
  would overflow starts the next sequence; a single sentence longer than the target is cut).

Returned sequences are ``Sequence(ids, b_start, is_random_next, doc)`` with the special tokens
already in place; ``b_start`` is the index of B's first token (0 when there is no B).
"""
from __future__ import annotations

import random
from typing import NamedTuple


class Sequence(NamedTuple):
    ids: list
    b_start: int
    is_random_next: bool
    doc: int


def _target_length(max_num: int, short_seq_prob: float, rng: random.Random) -> int:
    if rng.random() < short_seq_prob:
        return rng.randint(2, max_num)
    return max_num


def truncate_pair(a: list, b: list, max_num: int, rng: random.Random) -> None:
    """Trim the longer segment at a random end until ``len(a) + len(b) <= max_num`` (in place)."""
    while len(a) + len(b) > max_num:
        longer = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def pack_document_nsp(docs: list, index: int, max_seq_len: int, short_seq_prob: float, cls: int, sep: int,
                      rng: random.Random, balance: list | None = None) -> list[Sequence]:
    """``balance``: ``[random_next_count, actual_next_count]`` carried across the documents of a file."""
    balance = balance if balance is not None else [0, 0]
    document = docs[index]
    max_num = max_seq_len - 3
    target = _target_length(max_num, short_seq_prob, rng)
    out: list[Sequence] = []
    chunk: list = []
    length = 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        length += len(document[i])
        if i == len(document) - 1 or length >= target:
            if chunk:
                a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
                a = [t for s in chunk[:a_end] for t in s]
                b: list = []
                # One gathered sentence has no continuation to offer: random next is forced (as the
                # original). Those forced pairs would tip NSP towards "random" (~56% on Wikipedia), so
                # free choices lean the other way by the running imbalance; the labels stay 50/50.
                p_random = min(0.9, max(0.1, 0.5 - 0.1 * (balance[0] - balance[1])))
                random_next = len(docs) > 1 and (len(chunk) == 1 or rng.random() < p_random)
                if random_next:
                    target_b = target - len(a)
                    # Ten tries to draw a different document (as the original); fall back to the next one.
                    other = index
                    for _ in range(10):
                        other = rng.randint(0, len(docs) - 1)
                        if other != index:
                            break
                    if other == index:
                        other = (index + 1) % len(docs)
                    rdoc = docs[other]
                    for j in range(rng.randint(0, len(rdoc) - 1), len(rdoc)):
                        b.extend(rdoc[j])
                        if len(b) >= target_b:
                            break
                    i -= len(chunk) - a_end   # the unused sentences are not wasted
                else:
                    b = [t for s in chunk[a_end:] for t in s]
                if a and b:
                    truncate_pair(a, b, max_num, rng)
                    ids = [cls, *a, sep, *b, sep]
                    out.append(Sequence(ids, len(a) + 2, random_next, index))
                    balance[0 if random_next else 1] += 1
            chunk, length = [], 0
            target = _target_length(max_num, short_seq_prob, rng)
        i += 1
    return out


def pack_document_mlm(doc: list, index: int, max_seq_len: int, short_seq_prob: float, cls: int, sep: int,
                      rng: random.Random) -> list[Sequence]:
    max_num = max_seq_len - 2
    target = _target_length(max_num, short_seq_prob, rng)
    out: list[Sequence] = []
    cur: list = []
    for sentence in doc:
        if cur and len(cur) + len(sentence) > target:
            out.append(Sequence([cls, *cur[:max_num], sep], 0, False, index))
            cur = []
            target = _target_length(max_num, short_seq_prob, rng)
        cur.extend(sentence)
    if cur:
        out.append(Sequence([cls, *cur[:max_num], sep], 0, False, index))
    return out


def pack_documents(docs: list, max_seq_len: int, nsp: bool, short_seq_prob: float, cls: int, sep: int,
                   rng: random.Random) -> list[Sequence]:
    """All sequences of ``docs`` in document order."""
    out: list[Sequence] = []
    balance = [0, 0]
    for index, doc in enumerate(docs):
        if nsp:
            out.extend(pack_document_nsp(docs, index, max_seq_len, short_seq_prob, cls, sep, rng, balance))
        else:
            out.extend(pack_document_mlm(doc, index, max_seq_len, short_seq_prob, cls, sep, rng))
    return out
