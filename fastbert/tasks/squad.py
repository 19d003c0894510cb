"""SQuAD fine-tuning: span prediction over sliding windows of long contexts.

Features: ``[CLS] question [SEP] context window [SEP]``. The question is cut to ``max_query_len``
tokens; the context is tokenized once with character offsets and covered by windows of
``max_seq_len - len(question) - 3`` tokens that overlap by ``doc_stride`` tokens (HF's meaning of
doc_stride). A training window whose span does not hold the whole answer (and every v2.0
no-answer question) is labelled with the [CLS] position, as in BERT's reference code.

Decoding (``postprocess``): for every window take the ``n_best`` highest start and end logits,
keep pairs inside the context with ``start <= end`` and at most ``max_answer_len`` tokens, score
``start + end`` and map the best span back to the original text through the token offsets. For
v2.0 the null score is the smallest ``[CLS]`` start + end over the windows; the answer is empty
when ``null - best_span > null_threshold``.
"""
from __future__ import annotations

import json
from typing import Optional

import numpy as np

from fastbert.data.squad import SquadExample, read_squad, split_file
from fastbert.errors import DataError
from fastbert.heads import BertForQuestionAnswering
from fastbert.tasks.base import FinetuneTask, as_list, predict
from fastbert.tasks.squad_metrics import squad_scores


def window_starts(n_tokens: int, window: int, doc_stride: int) -> list[int]:
    """Start offsets of windows of ``window`` tokens overlapping by ``doc_stride`` that cover ``n_tokens``."""
    if n_tokens <= window:
        return [0]
    step = window - doc_stride
    # Every regular start is < n_tokens - window, so the final window (flush with the end) is new.
    return list(range(0, n_tokens - window, step)) + [n_tokens - window]


def char_span_to_tokens(offsets: list[tuple[int, int]], start_char: int, end_char: int) -> Optional[tuple[int, int]]:
    """First and last token (indices into ``offsets``) overlapping ``[start_char, end_char)``."""
    first = last = None
    for i, (s, e) in enumerate(offsets):
        if e > start_char and s < end_char:
            if first is None:
                first = i
            last = i
    return None if first is None else (first, last)


def make_features(examples: list[SquadExample], tokenizer, max_seq_len: int, doc_stride: int,
                  max_query_len: int, training: bool) -> list[dict]:
    """One feature per (question, window); see the module docstring."""
    cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
    features = []
    contexts: dict[str, tuple[list[int], list[tuple[int, int]]]] = {}
    for ex_index, ex in enumerate(examples):
        q_ids = as_list(tokenizer.encode(ex.question, add_special_tokens=False, truncation=False)["input_ids"])
        q_ids = q_ids[:max_query_len]
        if ex.context not in contexts:  # questions share contexts; tokenize each once
            enc = tokenizer.encode(ex.context, add_special_tokens=False, truncation=False, return_offsets=True)
            contexts[ex.context] = (as_list(enc["input_ids"]), [(int(o[0]), int(o[1])) for o in enc["offsets"]])
        c_ids, c_off = contexts[ex.context]
        window = max_seq_len - len(q_ids) - 3
        if window <= doc_stride:
            raise DataError(f"--max-seq-len {max_seq_len} leaves {window} context tokens per window after the "
                            f"question, not more than --doc-stride {doc_stride}; raise --max-seq-len or lower "
                            "--doc-stride / --max-query-len")
        answer = None
        if training and ex.answers and not ex.is_impossible:
            s = ex.answer_starts[0]
            answer = char_span_to_tokens(c_off, s, s + len(ex.answers[0]))
        for start in window_starts(len(c_ids), window, doc_stride):
            span_ids = c_ids[start:start + window]
            ids = [cls_id] + q_ids + [sep_id] + span_ids + [sep_id]
            n_first = len(q_ids) + 2
            types = [0] * n_first + [1] * (len(span_ids) + 1)
            # Offsets of context tokens in this window; None marks question / special tokens.
            offsets = [None] * n_first + [c_off[start + i] for i in range(len(span_ids))] + [None]
            row = {"input_ids": ids, "token_type_ids": types, "attention_mask": [1] * len(ids),
                   "example_index": ex_index, "offsets": offsets}
            if training:
                sp = ep = 0
                if answer is not None and start <= answer[0] and answer[1] < start + len(span_ids):
                    sp, ep = answer[0] - start + n_first, answer[1] - start + n_first
                row["start_positions"], row["end_positions"] = sp, ep
            features.append(row)
    return features


def postprocess(examples: list[SquadExample], features: list[dict], start_logits: list[np.ndarray],
                end_logits: list[np.ndarray], n_best: int = 20, max_answer_len: int = 30, v2: bool = False,
                null_threshold: float = 0.0) -> tuple[dict[str, str], dict[str, float]]:
    """Answer text per question id, and (v2.0) the null-minus-best score per question."""
    by_example: dict[int, list[int]] = {}
    for i, f in enumerate(features):
        by_example.setdefault(f["example_index"], []).append(i)
    answers, null_odds = {}, {}
    for ex_index, ex in enumerate(examples):
        best_score, best_text = -np.inf, ""
        null_score = np.inf
        for fi in by_example.get(ex_index, []):
            offsets = features[fi]["offsets"]
            s_log, e_log = start_logits[fi][: len(offsets)], end_logits[fi][: len(offsets)]
            null_score = min(null_score, float(s_log[0] + e_log[0]))
            starts = np.argsort(-s_log)[:n_best]
            ends = np.argsort(-e_log)[:n_best]
            for s in starts:
                if offsets[s] is None:
                    continue
                for e in ends:
                    if offsets[e] is None or e < s or e - s + 1 > max_answer_len:
                        continue
                    score = float(s_log[s] + e_log[e])
                    if score > best_score:
                        best_score = score
                        best_text = ex.context[offsets[s][0]:offsets[e][1]]
        if v2:
            diff = null_score - best_score if np.isfinite(best_score) else np.inf
            null_odds[ex.qid] = float(diff) if np.isfinite(diff) else 1e9
            answers[ex.qid] = "" if diff > null_threshold else best_text
        else:
            answers[ex.qid] = best_text
    return answers, null_odds


class SquadTask(FinetuneTask):
    name = "squad"
    model_cls = BertForQuestionAnswering

    def __init__(self, *args, doc_stride: int = 128, max_query_len: int = 64, max_answer_len: int = 30,
                 n_best: int = 20, null_threshold: float = 0.0, train_file=None, eval_file=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.doc_stride, self.max_query_len = doc_stride, max_query_len
        self.max_answer_len, self.n_best, self.null_threshold = max_answer_len, n_best, null_threshold
        self.train_file, self.eval_file = train_file, eval_file
        self.v2 = False

    def prepare(self) -> None:
        if self.doc_stride < 1 or self.max_query_len < 1 or self.max_answer_len < 1 or self.n_best < 1:
            raise DataError("--doc-stride, --max-query-len, --max-answer-len and --n-best must be >= 1")
        train, v2_train = read_squad(split_file(self.data, "train", self.train_file), self.max_train_samples)
        self.eval_examples, v2_eval = read_squad(split_file(self.data, "dev", self.eval_file), self.max_eval_samples)
        self.v2 = v2_train or v2_eval
        args = (self.tokenizer, self.max_seq_len, self.doc_stride, self.max_query_len)
        self.train_features = make_features(train, *args, training=True)
        self.eval_features = make_features(self.eval_examples, *args, training=False)
        self.train_questions = len(train)

    def model_kwargs(self) -> dict:
        return {"num_labels": 2}

    def collate(self, rows):
        keys = ("input_ids", "token_type_ids", "attention_mask", "start_positions", "end_positions")
        return super().collate([{k: r[k] for k in keys} for r in rows])

    def evaluate(self, model, batch_size: int) -> tuple[dict, dict[str, str]]:
        out = predict(model, self.eval_features, self.pad_values, batch_size, lambda o: (o.start_logits, o.end_logits))
        starts = [r[0].numpy() for r in out]
        ends = [r[1].numpy() for r in out]
        answers, null_odds = postprocess(self.eval_examples, self.eval_features, starts, ends, self.n_best,
                                         self.max_answer_len, self.v2, self.null_threshold)
        refs = {ex.qid: ex.answers for ex in self.eval_examples}
        metrics = squad_scores(answers, refs, v2=self.v2)
        files = {"predictions.json": json.dumps(answers, indent=1, ensure_ascii=False) + "\n"}
        if self.v2:
            files["null_odds.json"] = json.dumps(null_odds, indent=1) + "\n"
        return metrics, files

    def describe(self) -> dict:
        return {**super().describe(), "train_questions": self.train_questions,
                "eval_questions": len(self.eval_examples), "eval_features": len(self.eval_features),
                "squad_v2": self.v2}
