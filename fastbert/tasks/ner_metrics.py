"""Entity-level precision / recall / F1 for IOB-tagged sequences (conlleval and seqeval's default).

An entity is a maximal chunk ``(type, first, last)``; a predicted entity counts only when its
type and both boundaries equal a gold entity's. Chunks are read with conlleval's rules, which
accept IOB1 (``I-`` opens an entity after ``O`` or another type; ``B-`` only separates two
adjacent entities of one type), IOB2 (every entity opens with ``B-``) and IOBES alike, so gold
data in either CoNLL-2003 variant and model output in any of them are scored the same way.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Sequence

from fastbert.data.conll import split_tag


def _chunk_ends(prev: str, prev_type: str, cur: str, cur_type: str) -> bool:
    if prev in ("E", "S"):
        return True
    if prev in ("B", "I") and (cur in ("B", "S", "O") or cur_type != prev_type):
        return True
    return False


def _chunk_starts(prev: str, prev_type: str, cur: str, cur_type: str) -> bool:
    if cur in ("B", "S"):
        return True
    if cur in ("I", "E") and (prev in ("O", "E", "S") or cur_type != prev_type):
        return True
    return False


def get_entities(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """The ``(type, first, last)`` chunks of one tag sequence (inclusive token indices)."""
    entities = []
    prev, prev_type, start = "O", "", None
    for i, tag in enumerate(list(tags) + ["O"]):  # the sentinel closes a chunk that runs to the end
        cur, cur_type = split_tag(tag)
        if start is not None and _chunk_ends(prev, prev_type, cur, cur_type):
            entities.append((prev_type, start, i - 1))
            start = None
        if _chunk_starts(prev, prev_type, cur, cur_type):
            start = i
        prev, prev_type = cur, cur_type
    return entities


def iob1_to_iob2(tags: Sequence[str]) -> list[str]:
    """Rewrite IOB1 (or mixed) tags so that every entity opens with ``B-`` (same entities)."""
    out = ["O"] * len(tags)
    for typ, first, last in get_entities(tags):
        out[first] = f"B-{typ}"
        for j in range(first + 1, last + 1):
            out[j] = f"I-{typ}"
    return out


def detect_scheme(sentences: Iterable[Sequence[str]]) -> str:
    """``"IOB1"`` if some entity opens with ``I-``, else ``"IOB2"``."""
    for tags in sentences:
        prev, prev_type = "O", ""
        for tag in tags:
            cur, cur_type = split_tag(tag)
            if cur == "I" and (prev == "O" or cur_type != prev_type):
                return "IOB1"
            prev, prev_type = cur, cur_type
    return "IOB2"


def entity_scores(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]) -> dict:
    """Micro P/R/F1 over all entities, plus per-type scores under ``"per_type"``."""
    if len(gold) != len(pred):
        raise ValueError(f"{len(gold)} gold sentences but {len(pred)} predicted ones")
    tp, n_gold, n_pred = defaultdict(int), defaultdict(int), defaultdict(int)
    correct_tokens = total_tokens = 0
    for i, (g, p) in enumerate(zip(gold, pred)):
        if len(g) != len(p):
            raise ValueError(f"sentence {i}: {len(g)} gold tags but {len(p)} predicted tags")
        ge, pe = set(get_entities(g)), set(get_entities(p))
        for typ, *_ in ge:
            n_gold[typ] += 1
        for typ, *_ in pe:
            n_pred[typ] += 1
        for typ, *_ in ge & pe:
            tp[typ] += 1
        correct_tokens += sum(a == b for a, b in zip(g, p))
        total_tokens += len(g)

    def prf(t, np_, ng):
        precision = t / np_ if np_ else 0.0
        recall = t / ng if ng else 0.0
        f = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        return {"precision": precision, "recall": recall, "f1": f, "support": ng}

    types = sorted(set(n_gold) | set(n_pred))
    out = prf(sum(tp.values()), sum(n_pred.values()), sum(n_gold.values()))
    out["accuracy"] = correct_tokens / total_tokens if total_tokens else 0.0
    out["per_type"] = {t: prf(tp[t], n_pred[t], n_gold[t]) for t in types}
    return out
