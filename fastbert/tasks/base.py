"""What every fine-tuning task provides to the shared driver (fastbert/tasks/finetune.py), and batched
inference over features.

A task reads and validates ALL of its data in ``prepare()`` (so bad input fails before any output
is written), turns examples into feature dicts (lists of token ids etc.), says which head it
trains (``model_cls`` + ``model_kwargs()``), and evaluates a model on its dev split(s), returning
metrics and the prediction files to write.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from fastbert.tasks.trainer import pad_batch


class FinetuneTask:
    name: str = ""
    model_cls: type = None
    label_key = "labels"

    def __init__(self, data, tokenizer, max_seq_len: int = 128, max_train_samples: Optional[int] = None,
                 max_eval_samples: Optional[int] = None):
        self.data = data
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.max_train_samples = max_train_samples
        self.max_eval_samples = max_eval_samples
        self.train_features: list[dict] = []

    # -- to override --------------------------------------------------------------------------
    def prepare(self) -> None:
        """Read, validate and featurize train and dev data."""
        raise NotImplementedError

    def model_kwargs(self) -> dict:
        """Config overrides for the head (num_labels, id2label)."""
        return {}

    def evaluate(self, model, batch_size: int) -> tuple[dict, dict[str, str]]:
        """(metrics, {file name: contents}) on the dev split(s)."""
        raise NotImplementedError

    # -- shared ---------------------------------------------------------------------------------
    @property
    def pad_values(self) -> dict:
        pad = self.tokenizer.pad_token_id
        return {"input_ids": pad, "labels": -100, "start_positions": 0, "end_positions": 0}

    def collate(self, rows: Sequence[dict]) -> dict[str, torch.Tensor]:
        return pad_batch(rows, self.pad_values)

    static_batches = False  # the head takes packed=... (data/static_batch.pack_examples)

    def collate_static(self, rows: Sequence[dict]) -> dict:
        """The static-shape batch (``model(packed=...)``) of these rows, as numpy arrays."""
        from fastbert.data.static_batch import pack_examples
        packed = pack_examples(rows, self.max_seq_len, self.tokenizer.pad_token_id or 0)
        packed["max_seqlen"] = self.max_seq_len
        return {"packed": packed}

    def describe(self) -> dict:
        return {"train_features": len(self.train_features)}


def as_list(x) -> list:
    """A tokenizer output row as a list of ints (the C++ tokenizer's batch API returns NumPy arrays)."""
    return x.tolist() if hasattr(x, "tolist") else list(x)


def batch_rows(enc: dict, key: str) -> list[list[int]]:
    return [as_list(r) for r in enc[key]]


def model_inputs(row: dict) -> dict:
    """The fields of a feature row that the model takes (drops labels and bookkeeping)."""
    return {k: row[k] for k in ("input_ids", "token_type_ids", "attention_mask") if k in row}


def feature_length(row: dict) -> int:
    ids = row["input_ids"]
    return max(len(s) for s in ids) if ids and isinstance(ids[0], (list, tuple)) else len(ids)


@torch.no_grad()
def predict(model, rows: Sequence[dict], pad_values: dict, batch_size: int,
            outputs: Callable[[object], Sequence[torch.Tensor]]) -> list[tuple]:
    """Run ``model`` on ``rows`` (sorted by length so batches carry little padding) and return, in
    the original order, one tuple per row of the tensors ``outputs(model_output)`` yields (each
    indexed by row, moved to the CPU as fp32)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    order = sorted(range(len(rows)), key=lambda i: feature_length(rows[i]))
    results: list[Optional[tuple]] = [None] * len(rows)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        batch = pad_batch([model_inputs(rows[i]) for i in idx], pad_values, device=device)
        outs = [t.float().cpu() for t in outputs(model(**batch))]
        for j, i in enumerate(idx):
            results[i] = tuple(t[j] for t in outs)
    model.train(was_training)
    return results
