"""``fastbert sbert-train``: train Sentence-BERT sentence embeddings on sentence-pair data."""
from __future__ import annotations

import json
import os
import sys

from fastbert.commands import add_kernels_argument


def add_parser(sub):
    p = sub.add_parser("sbert-train", help="train Sentence-BERT embeddings (siamese BERT, mean pooling)",
                       description="Siamese BERT with mean pooling (Reimers & Gurevych 2019). "
                                   "--objective classification: softmax classifier on (u, v, |u-v|) for NLI-style "
                                   "labels; regression: MSE of cos(u, v) against scores scaled to [0, 1]. "
                                   "Data: a TSV with a header in MRPC (#1 String, #2 String, Quality), STS-B "
                                   "(sentence1, sentence2, score), NLI (sentence1, sentence2, gold_label) or "
                                   "generic (sentence1, sentence2, label) layout. The output folder is an HF "
                                   "BertModel checkpoint that `fastbert embed --model OUT` uses.")
    p.add_argument("--model", required=True, help="HF BERT checkpoint directory (config.json, weights, vocab.txt)")
    p.add_argument("--data", required=True, help="training pairs (TSV, see above)")
    p.add_argument("--eval-data", default=None, help="dev pairs in the same layout (accuracy / Spearman)")
    p.add_argument("--objective", required=True, choices=("classification", "regression"))
    p.add_argument("--output", default=None, help="output folder (default runs/sbert-OBJECTIVE)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--head-lr", type=float, default=None, help="classifier learning rate (default: --lr)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--warmup", type=float, default=0.1, help="warmup fraction (< 1) or steps (>= 1)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--score-max", type=float, default=None,
                   help="regression: divide scores by this (default: the largest training score if > 1, e.g. 5 for STS-B)")
    p.add_argument("--max-train-samples", type=int, default=None)
    p.add_argument("--max-eval-samples", type=int, default=None)
    add_kernels_argument(p)
    p.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=_suppress())


def _suppress():
    import argparse
    return argparse.SUPPRESS


def run(args) -> int:
    from pathlib import Path

    from fastbert.errors import UsageError
    from fastbert.tasks.settings import FinetuneError, TrainArgs, check_args, check_checkpoint

    for flag in ("max_train_samples", "max_eval_samples"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.score_max is not None and not args.score_max > 0:
        raise UsageError("--score-max must be > 0")
    train_args = TrainArgs(epochs=args.epochs, lr=args.lr, head_lr=args.head_lr, batch_size=args.batch_size,
                           warmup=args.warmup, seed=args.seed, precision=args.precision)
    try:  # before torch loads: bad input answered at once (run_sbert checks the same)
        check_args(train_args, args.max_seq_len)
        check_checkpoint(Path(args.model))
    except FinetuneError as e:
        raise UsageError(str(e)) from None
    from fastbert.data.sentence_pairs import check_pairs_file
    for path in (args.data, args.eval_data):  # DataError: exit 1, as reading them would give later
        if path is not None:
            check_pairs_file(path)
    from fastbert.tasks.sbert import run_sbert
    try:
        summary = run_sbert(args.model, args.data, args.objective, args.output, args.eval_data, train_args,
                            args.max_seq_len, args.max_train_samples, args.max_eval_samples, args.score_max,
                            args.kernels)
    except FinetuneError as e:
        raise UsageError(str(e)) from None
    if os.environ.get("RANK", "0") != "0":  # under a launcher, rank 0 reports
        return 0
    print(json.dumps({"objective": summary["objective"], "metrics": summary["metrics"], "output": summary["output"]},
                     indent=2), file=sys.stdout)
    return 0
