"""Sentence-BERT (Reimers & Gurevych 2019): a siamese BERT with mean pooling, trained so that
sentence embeddings compare well.

* ``classification`` (NLI-style labels): ``softmax(W [u; v; |u - v|])`` with cross-entropy, ``u``
  and ``v`` the mean-pooled embeddings of the two sentences (one shared encoder).
* ``regression`` (STS-style scores): MSE between ``cos(u, v)`` and the gold score scaled to
  ``[0, 1]`` (divided by ``score_max``: STS-B's 0..5 become 0..1).

Both sentences of a batch run through the encoder in ONE forward (stacked on the batch axis).
Training uses the fine-tuning loop and DeepSpeed path of fastbert/tasks/trainer.py. The saved
output is the encoder alone, as an HF ``BertModel`` checkpoint with its tokenizer files and
sentence-transformers metadata (mean pooling), which ``fastbert embed`` loads directly.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from fastbert.data.sentence_pairs import SentencePair, read_pairs
from fastbert.errors import DataError
from fastbert.model import BertModel, ModelOutput, mean_pool
from fastbert.ops import resolve_kernels
from fastbert.tasks.base import batch_rows
from fastbert.tasks.metrics import accuracy, pearson, spearman
from fastbert.tasks.settings import TrainArgs
from fastbert.tasks.trainer import build_finetune_engine, pad_batch, param_groups, train

OBJECTIVES = ("classification", "regression")


class SentenceBert(nn.Module):
    """Shared encoder ``bert`` + (classification only) ``classifier`` on ``[u; v; |u - v|]``."""

    def __init__(self, bert: BertModel, objective: str, num_labels: int = 0):
        super().__init__()
        if objective not in OBJECTIVES:
            raise ValueError(f"objective {objective!r} is not known; use one of {OBJECTIVES}")
        self.bert = bert
        self.objective = objective
        self.config = bert.config
        if objective == "classification":
            self.classifier = nn.Linear(3 * bert.config.hidden_size, num_labels)
            # Sentence-BERT's head starts like any new head: N(0, initializer_range), zero bias.
            nn.init.normal_(self.classifier.weight, std=bert.config.initializer_range)
            nn.init.zeros_(self.classifier.bias)

    def embed(self, input_ids, attention_mask):
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return mean_pool(hidden, attention_mask)

    def forward(self, a_input_ids, a_attention_mask, b_input_ids, b_attention_mask, labels=None):
        # One encoder pass over both sides: pad to a common width, stack on the batch axis.
        width = max(a_input_ids.shape[1], b_input_ids.shape[1])

        def widen(t):
            return F.pad(t, (0, width - t.shape[1]))

        ids = torch.cat([widen(a_input_ids), widen(b_input_ids)])           # (2B, S)
        mask = torch.cat([widen(a_attention_mask), widen(b_attention_mask)])
        u, v = self.embed(ids, mask).float().chunk(2)                         # (B, H) each
        if self.objective == "classification":
            logits = self.classifier(torch.cat([u, v, (u - v).abs()], dim=-1).to(self.classifier.weight.dtype))
            loss = F.cross_entropy(logits.float(), labels) if labels is not None else None
            return ModelOutput(loss=loss, logits=logits)
        cos = F.cosine_similarity(u, v, dim=-1)
        loss = F.mse_loss(cos, labels.float()) if labels is not None else None
        return ModelOutput(loss=loss, logits=cos)


def encode_pairs(pairs: list[SentencePair], tokenizer, max_seq_len: int, targets: list) -> list[dict]:
    a = tokenizer.encode_batch([p.a for p in pairs], max_length=max_seq_len, truncation=True)
    b = tokenizer.encode_batch([p.b for p in pairs], max_length=max_seq_len, truncation=True)
    a_ids, a_mask, b_ids, b_mask = (batch_rows(e, k) for e in (a, b) for k in ("input_ids", "attention_mask"))
    return [{"a_input_ids": a_ids[i], "a_attention_mask": a_mask[i], "b_input_ids": b_ids[i],
             "b_attention_mask": b_mask[i], "labels": targets[i]} for i in range(len(pairs))]


def prepare_targets(train: list[SentencePair], dev: list[SentencePair], objective: str, kind: str,
                    score_max: Optional[float]):
    """Targets for both splits plus the label names (classification) or the score scale (regression)."""
    if objective == "classification":
        if kind == "score":
            raise DataError("--objective classification needs class labels, but this file has similarity scores "
                            "(STS layout); use --objective regression")
        labels = sorted({p.target for p in train})
        if len(labels) < 2:
            raise DataError(f"--objective classification needs at least 2 labels in the training data, found {labels}")
        index = {lab: i for i, lab in enumerate(labels)}
        unknown = sorted({p.target for p in dev} - set(labels))
        if unknown:
            raise DataError(f"dev labels {unknown} do not occur in the training data (labels: {labels})")
        return [index[p.target] for p in train], [index[p.target] for p in dev], labels, None
    try:
        tr = [float(p.target) for p in train]
        dv = [float(p.target) for p in dev]
    except ValueError:
        raise DataError("--objective regression needs numeric scores (or 0/1 labels); this file has class names "
                        "(NLI layout): use --objective classification") from None
    scale = score_max if score_max else max(1.0, max(abs(x) for x in tr))
    return [x / scale for x in tr], [x / scale for x in dv], None, scale


def write_sentence_transformers_files(out: Path, hidden: int, max_seq_len: int) -> None:
    """modules.json + 1_Pooling/config.json: sentence-transformers loads the folder as mean pooling."""
    from fastbert.io import atomic_write_text
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    atomic_write_text(out / "modules.json", json.dumps(modules, indent=2) + "\n")
    atomic_write_text(out / "sentence_bert_config.json",
                      json.dumps({"max_seq_length": max_seq_len, "do_lower_case": False}, indent=2) + "\n")
    pooling = {"word_embedding_dimension": hidden, "pooling_mode_cls_token": False,
               "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False}
    atomic_write_text(out / "1_Pooling" / "config.json", json.dumps(pooling, indent=2) + "\n")


@torch.no_grad()
def evaluate_pairs(model: SentenceBert, tokenizer, pairs: list[SentencePair], targets: list, max_seq_len: int,
                   batch_size: int) -> tuple[dict, np.ndarray]:
    """Dev metrics: accuracy of the classifier, or Pearson/Spearman of cos(u, v) with the scores (the
    usual STS evaluation). Embeddings come from ``fastbert.sentence_embeddings.encode_sentences``."""
    from fastbert.sentence_embeddings import encode_sentences

    device = next(model.parameters()).device
    kw = dict(batch_size=batch_size, max_length=max_seq_len, normalize=False, device=device)
    u = encode_sentences(model.bert, tokenizer, [p.a for p in pairs], **kw).float()
    v = encode_sentences(model.bert, tokenizer, [p.b for p in pairs], **kw).float()
    cos = F.cosine_similarity(u, v, dim=-1).numpy()
    if model.objective == "classification":
        w = model.classifier.weight.float().cpu()
        b = model.classifier.bias.float().cpu()
        logits = torch.cat([u, v, (u - v).abs()], dim=-1) @ w.T + b
        preds = logits.argmax(-1).numpy()
        return {"accuracy": accuracy(preds, np.array(targets)), "eval_pairs": len(pairs)}, preds
    return {"spearman": spearman(cos, targets), "pearson": pearson(cos, targets), "eval_pairs": len(pairs)}, cos


def run_sbert(model_dir, data, objective: str, output=None, eval_data=None, args: Optional[TrainArgs] = None,
              max_seq_len: int = 128, max_train_samples: Optional[int] = None,
              max_eval_samples: Optional[int] = None, score_max: Optional[float] = None,
              kernels: Optional[str] = None) -> dict:
    """Train Sentence-BERT on ``data`` (a pair TSV); evaluate on ``eval_data`` if given. Returns metrics.json."""
    from fastbert.io import atomic_write_text
    from fastbert.tasks.finetune import copy_tokenizer_files
    from fastbert.tasks.settings import check_args, check_checkpoint
    from fastbert.tokenization import load_tokenizer
    from fastbert.training.engine import barrier
    from fastbert.training.logging import MetricsLogger

    if objective not in OBJECTIVES:
        raise DataError(f"--objective {objective!r} is not known; use one of {', '.join(OBJECTIVES)}")
    args = args or TrainArgs()
    model_dir = Path(model_dir)
    check_checkpoint(model_dir)
    check_args(args, max_seq_len)
    train_pairs, layout, kind = read_pairs(data, max_train_samples)
    dev_pairs = read_pairs(eval_data, max_eval_samples)[0] if eval_data else []
    tr_t, dv_t, labels, scale = prepare_targets(train_pairs, dev_pairs, objective, kind, score_max)
    tokenizer = load_tokenizer(model_dir)
    features = encode_pairs(train_pairs, tokenizer, max_seq_len, tr_t)
    kernels = resolve_kernels(kernels)

    torch.manual_seed(args.seed)
    model = SentenceBert(BertModel.from_pretrained(model_dir, kernels=kernels), objective,
                         len(labels) if labels else 0)
    for p in model.bert.pooler.parameters():  # mean pooling does not use the pooler: keep it as loaded
        p.requires_grad_(False)
    groups = param_groups(model, args.lr, args.head_lr, args.weight_decay, args.freeze_encoder)
    engine = build_finetune_engine(model, groups, args)
    out_dir = Path(output) if output else Path("runs") / f"sbert-{objective}"
    logger = MetricsLogger(out_dir, console=None) if engine.dist.is_main else None
    if logger:
        logger.log("start", 0, objective=objective, layout=layout, train_pairs=len(features),
                   eval_pairs=len(dev_pairs), kernels=kernels, precision=engine.precision)
    pad = tokenizer.pad_token_id

    def collate(rows):
        return pad_batch(rows, {"a_input_ids": pad, "b_input_ids": pad})

    eval_bs = max(args.batch_size, 64)

    def dev_score(epoch):
        return evaluate_pairs(engine.module, tokenizer, dev_pairs, dv_t, max_seq_len, eval_bs)[0]

    t0 = time.perf_counter()
    result = train(engine, features, collate, args, logger=logger, evaluate=dev_score if dev_pairs else None)
    summary = {"objective": objective, "layout": layout, "model": str(model_dir),
               "metrics": {k: v for k, v in (result.epoch_metrics[-1] if result.epoch_metrics else {}).items()
                           if k not in ("epoch", "step")},
               "epochs": result.epoch_metrics,
               "labels": labels, "score_scale": scale,
               "train": {"steps": result.steps, "train_seconds": result.train_seconds,
                         "wall_seconds": time.perf_counter() - t0, "pairs": len(features),
                         "final_loss": result.losses[-1][1] if result.losses else None},
               "args": {**asdict(args), "max_seq_len": max_seq_len}}
    if engine.dist.is_main:
        engine.module.bert.save_pretrained(out_dir)
        copy_tokenizer_files(model_dir, out_dir)
        write_sentence_transformers_files(out_dir, model.config.hidden_size, max_seq_len)
        atomic_write_text(out_dir / "metrics.json", json.dumps(summary, indent=2) + "\n")
        logger.log("end", result.steps, **{k: v for k, v in summary["metrics"].items() if isinstance(v, (int, float))})
        logger.close()
    barrier()
    summary["output"] = str(out_dir)
    summary["losses"] = result.losses
    return summary
