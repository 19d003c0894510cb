"""GLUE fine-tuning: sentence(-pair) classification, or regression for STS-B, on [CLS] (pooled).

Pairs are encoded ``[CLS] a [SEP] b [SEP]`` and cut to ``max_seq_len`` longest-first (HF's rule).
Metrics are GLUE's (fastbert/tasks/metrics.py); MNLI is scored on matched and mismatched dev.
Predictions are written per dev split as TSV: ``index, prediction, label``.
"""
from __future__ import annotations

import numpy as np

from fastbert.data.glue import Example, GlueTask, get_task, read_examples, split_path
from fastbert.heads import BertForSequenceClassification
from fastbert.tasks.base import FinetuneTask, batch_rows, predict
from fastbert.tasks.metrics import glue_metrics


def encode_examples(examples: list[Example], tokenizer, max_seq_len: int, regression: bool) -> list[dict]:
    a = [e.text_a for e in examples]
    pairs = [e.text_b for e in examples] if examples and examples[0].text_b is not None else None
    enc = tokenizer.encode_batch(a, pairs, max_length=max_seq_len, truncation=True)
    ids, types, mask = (batch_rows(enc, k) for k in ("input_ids", "token_type_ids", "attention_mask"))
    rows = []
    for i, e in enumerate(examples):
        row = {"input_ids": ids[i], "token_type_ids": types[i], "attention_mask": mask[i]}
        if e.label is not None:
            row["labels"] = float(e.label) if regression else int(e.label)
        rows.append(row)
    return rows


class GlueFinetuneTask(FinetuneTask):
    model_cls = BertForSequenceClassification
    static_batches = True

    def __init__(self, name: str, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.task: GlueTask = get_task(name)
        self.name = self.task.name
        self.eval_sets: dict[str, tuple[list[Example], list[dict]]] = {}

    def prepare(self) -> None:
        t = self.task
        train = read_examples(t, split_path(t, self.data, "train"), self.max_train_samples)
        self.train_features = encode_examples(train, self.tokenizer, self.max_seq_len, t.is_regression)
        for split in t.dev_splits:
            dev = read_examples(t, split_path(t, self.data, split), self.max_eval_samples)
            self.eval_sets[split] = (dev, encode_examples(dev, self.tokenizer, self.max_seq_len, t.is_regression))

    def model_kwargs(self) -> dict:
        t = self.task
        if t.is_regression:
            return {"num_labels": 1, "problem_type": "regression", "id2label": {0: "score"}}
        return {"num_labels": t.num_labels, "problem_type": "single_label_classification",
                "id2label": dict(enumerate(t.labels))}

    def predict_split(self, model, rows, batch_size) -> np.ndarray:
        out = predict(model, rows, self.pad_values, batch_size, lambda o: (o.logits,))
        logits = np.stack([r[0].numpy() for r in out])  # (N, num_labels)
        return logits[:, 0] if self.task.is_regression else logits.argmax(-1)

    def evaluate(self, model, batch_size: int) -> tuple[dict, dict[str, str]]:
        t = self.task
        metrics, files = {}, {}
        for split, (examples, rows) in self.eval_sets.items():
            preds = self.predict_split(model, rows, batch_size)
            labels = np.array([e.label for e in examples])
            scores = glue_metrics(t.name, preds, labels)
            prefix = "" if len(self.eval_sets) == 1 else split.replace("dev_", "") + "_"
            metrics.update({f"{prefix}{k}": v for k, v in scores.items()})
            metrics[f"{prefix}eval_samples"] = len(examples)
            lines = ["index\tprediction\tlabel"]
            for i, (e, p) in enumerate(zip(examples, preds)):
                shown = f"{p:.6f}" if t.is_regression else t.labels[int(p)]
                gold = f"{e.label:.6f}" if t.is_regression else t.labels[int(e.label)]
                lines.append(f"{i}\t{shown}\t{gold}")
            files[f"predictions_{split}.tsv"] = "\n".join(lines) + "\n"
        return metrics, files

    def describe(self) -> dict:
        return {**super().describe(), **{f"{s}_examples": len(v[0]) for s, v in self.eval_sets.items()}}
