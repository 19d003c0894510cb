"""SQuAD exact match and F1 with the official answer normalization (v1.1 and v2.0 rules).

Normalization (both official scripts): lower-case, drop ASCII punctuation, drop the articles
"a", "an", "the" as whole words, collapse whitespace. Scores are the maximum over the gold
answers, averaged over questions, in percent.

The two versions differ only at the edges: v2.0 treats a question with no (non-empty) gold
answer as having the single gold answer "" and scores empty-vs-empty as a match (F1 = 1), while
v1.1's F1 is 0 whenever no token is shared, even when both sides normalize to nothing.
"""
from __future__ import annotations

import collections
import re
import string

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1(prediction: str, gold: str, v2: bool = False) -> float:
    pred_toks = normalize_answer(prediction).split()
    gold_toks = normalize_answer(gold).split()
    if v2 and (not pred_toks or not gold_toks):
        # v2.0: a no-answer question is right only when the prediction is empty too.
        return float(pred_toks == gold_toks)
    common = collections.Counter(pred_toks) & collections.Counter(gold_toks)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_toks)
    recall = num_same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def gold_answers(answers: list[str], v2: bool) -> list[str]:
    """The gold strings a prediction is compared with (v2.0: "" for unanswerable questions)."""
    if not v2:
        return list(answers)
    kept = [a for a in answers if normalize_answer(a)]
    return kept or [""]


def squad_scores(predictions: dict[str, str], references: dict[str, list[str]], v2: bool = False) -> dict:
    """EM / F1 (percent) of ``predictions`` (qid -> text) against ``references`` (qid -> gold texts).

    Every reference question is scored; a question without a prediction counts as the empty
    answer (the official v2.0 script does the same; v1.1 warns and scores it 0, which is what an
    empty prediction scores there too). For v2.0, HasAns_* / NoAns_* split the scores by whether
    the question has an answer.
    """
    if not references:
        raise ValueError("no reference questions to score")
    ems, f1s, has_ans = {}, {}, {}
    for qid, answers in references.items():
        golds = gold_answers(answers, v2)
        pred = predictions.get(qid, "")
        ems[qid] = max(exact_match(pred, g) for g in golds)
        f1s[qid] = max(f1(pred, g, v2) for g in golds)
        has_ans[qid] = bool(golds != [""]) if v2 else True
    out = {"exact_match": 100.0 * sum(ems.values()) / len(ems), "f1": 100.0 * sum(f1s.values()) / len(f1s),
           "total": len(ems)}
    if v2:
        for name, keep in (("HasAns", True), ("NoAns", False)):
            ids = [q for q in ems if has_ans[q] == keep]
            if ids:
                out[f"{name}_exact"] = 100.0 * sum(ems[q] for q in ids) / len(ids)
                out[f"{name}_f1"] = 100.0 * sum(f1s[q] for q in ids) / len(ids)
                out[f"{name}_total"] = len(ids)
    return out
