"""Multiple-choice fine-tuning (SWAG-style): each choice is encoded as a sentence pair, scored from
its pooled [CLS], and a softmax over the choices picks the answer (``BertForMultipleChoice``).
Data format: fastbert/data/multiple_choice.py. Metric: accuracy."""
from __future__ import annotations

import json

import numpy as np

from fastbert.data.multiple_choice import ChoiceExample, find_split, read_jsonl
from fastbert.errors import DataError
from fastbert.heads import BertForMultipleChoice
from fastbert.tasks.base import FinetuneTask, batch_rows, predict
from fastbert.tasks.metrics import accuracy


def encode_choices(examples: list[ChoiceExample], tokenizer, max_seq_len: int) -> list[dict]:
    rows = []
    for ex in examples:
        enc = tokenizer.encode_batch([ex.first] * len(ex.seconds), ex.seconds, max_length=max_seq_len,
                                     truncation=True)
        row = {k: batch_rows(enc, k) for k in ("input_ids", "token_type_ids", "attention_mask")}  # (choices, seq)
        if ex.label is not None:
            row["labels"] = ex.label
        rows.append(row)
    return rows


class MultipleChoiceTask(FinetuneTask):
    name = "multiple-choice"
    model_cls = BertForMultipleChoice

    def prepare(self) -> None:
        train = read_jsonl(find_split(self.data, "train"), self.max_train_samples)
        self.dev = read_jsonl(find_split(self.data, "dev"), self.max_eval_samples)
        if len(train[0].seconds) != len(self.dev[0].seconds):
            raise DataError(f"train has {len(train[0].seconds)} choices per question but dev has "
                            f"{len(self.dev[0].seconds)}; use the same number in both files")
        self.num_choices = len(train[0].seconds)
        self.train_features = encode_choices(train, self.tokenizer, self.max_seq_len)
        self.eval_features = encode_choices(self.dev, self.tokenizer, self.max_seq_len)

    def model_kwargs(self) -> dict:
        return {"num_labels": 1}

    def evaluate(self, model, batch_size: int) -> tuple[dict, dict[str, str]]:
        # batch_size counts questions; each carries num_choices sequences.
        bs = max(1, batch_size // self.num_choices)
        out = predict(model, self.eval_features, self.pad_values, bs, lambda o: (o.logits,))
        scores = np.stack([r[0].numpy() for r in out])  # (N, choices)
        preds = scores.argmax(-1)
        labels = np.array([ex.label for ex in self.dev])
        metrics = {"accuracy": accuracy(preds, labels), "eval_samples": len(self.dev)}
        lines = [json.dumps({"index": i, "prediction": int(p), "label": int(g), "scores": [round(float(s), 5) for s in sc]})
                 for i, (p, g, sc) in enumerate(zip(preds, labels, scores))]
        return metrics, {"predictions.jsonl": "\n".join(lines) + "\n"}

    def describe(self) -> dict:
        return {**super().describe(), "choices": self.num_choices, "eval_examples": len(self.dev)}
