"""CoNLL-2003 NER fine-tuning: token classification with first-subword labels.

A sentence's words are joined with spaces and tokenized once with character offsets; each token
belongs to the word its offsets fall in. Only a word's FIRST sub-token carries the word's label
(the others, and [CLS]/[SEP], get -100 and are ignored by the loss); at evaluation a word's tag is
the prediction at its first sub-token. Words cut off by ``max_seq_len`` are predicted ``O``.

Gold data in IOB1 (the original release) is converted to IOB2 for training, which keeps every
entity and makes "begins an entity" explicit; scoring is entity-level micro F1 with conlleval's
chunking (fastbert/tasks/ner_metrics.py) against the tags as read.
"""
from __future__ import annotations

from fastbert.data.conll import Sentence, find_split, read_conll
from fastbert.heads import BertForTokenClassification
from fastbert.tasks.base import FinetuneTask, as_list, predict
from fastbert.tasks.ner_metrics import detect_scheme, entity_scores, iob1_to_iob2


def word_token_map(words: list[str], offsets: list[tuple[int, int]]) -> list[int]:
    """For each token, the index of the word (of ``" ".join(words)``) holding its first character."""
    starts, pos = [], 0
    for w in words:
        starts.append(pos)
        pos += len(w) + 1
    out, wi = [], 0
    for s, _ in offsets:
        while wi + 1 < len(starts) and starts[wi + 1] <= s:
            wi += 1
        out.append(wi)
    return out


def encode_sentence(sentence: Sentence, tokenizer, max_seq_len: int, label_ids: dict[str, int] | None) -> dict:
    enc = tokenizer.encode(" ".join(sentence.words), add_special_tokens=False, truncation=False, return_offsets=True)
    ids = as_list(enc["input_ids"])[: max_seq_len - 2]
    word_of = word_token_map(sentence.words, [(int(s), int(e)) for s, e in enc["offsets"]])[: len(ids)]
    first_token = {}  # word -> position in the final sequence (after [CLS])
    for t, w in enumerate(word_of):
        first_token.setdefault(w, t + 1)
    row = {"input_ids": [tokenizer.cls_token_id] + ids + [tokenizer.sep_token_id],
           "token_type_ids": [0] * (len(ids) + 2), "attention_mask": [1] * (len(ids) + 2),
           "word_first_token": [first_token.get(w, -1) for w in range(len(sentence.words))]}
    if label_ids is not None:
        labels = [-100] * len(row["input_ids"])
        for w, pos in enumerate(row["word_first_token"]):
            if pos >= 0:
                labels[pos] = label_ids[sentence.tags[w]]
        row["labels"] = labels
    return row


class NerTask(FinetuneTask):
    name = "ner"
    model_cls = BertForTokenClassification

    def prepare(self) -> None:
        train = read_conll(find_split(self.data, "train"), self.max_train_samples)
        self.dev = read_conll(find_split(self.data, "dev"), self.max_eval_samples)
        self.scheme = detect_scheme(s.tags for s in train)
        train_tags = [iob1_to_iob2(s.tags) for s in train]
        dev_tags = [iob1_to_iob2(s.tags) for s in self.dev]
        # Labels of train and dev together: a small training subset may miss a rare tag.
        tags = sorted({t for seq in train_tags + dev_tags for t in seq} - {"O"}, key=lambda t: (t[2:], t[0]))
        self.labels = ["O"] + tags
        label_ids = {t: i for i, t in enumerate(self.labels)}
        self.train_features = [encode_sentence(Sentence(s.words, t), self.tokenizer, self.max_seq_len, label_ids)
                               for s, t in zip(train, train_tags)]
        self.eval_features = [encode_sentence(s, self.tokenizer, self.max_seq_len, None) for s in self.dev]

    def model_kwargs(self) -> dict:
        return {"num_labels": len(self.labels), "id2label": dict(enumerate(self.labels))}

    def collate(self, rows):
        keys = ("input_ids", "token_type_ids", "attention_mask", "labels")
        return super().collate([{k: r[k] for k in keys} for r in rows])

    def evaluate(self, model, batch_size: int) -> tuple[dict, dict[str, str]]:
        out = predict(model, self.eval_features, self.pad_values, batch_size, lambda o: (o.logits,))
        preds = []
        for (logits,), row in zip(out, self.eval_features):
            best = logits.argmax(-1).tolist()
            preds.append([self.labels[best[p]] if p >= 0 else "O" for p in row["word_first_token"]])
        gold = [s.tags for s in self.dev]
        scores = entity_scores(gold, preds)
        metrics = {"f1": scores["f1"], "precision": scores["precision"], "recall": scores["recall"],
                   "accuracy": scores["accuracy"], "eval_sentences": len(self.dev),
                   "per_type": {t: v["f1"] for t, v in scores["per_type"].items()}}
        lines = []
        for s, p in zip(self.dev, preds):
            lines += [f"{w} {g} {q}" for w, g, q in zip(s.words, s.tags, p)] + [""]
        return metrics, {"predictions.conll": "\n".join(lines)}

    def describe(self) -> dict:
        return {**super().describe(), "scheme": self.scheme, "labels": len(self.labels),
                "eval_sentences": len(self.dev)}
