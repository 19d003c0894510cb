"""``fastbert finetune``: fine-tune a BERT checkpoint on GLUE, SQuAD, CoNLL-2003 NER or multiple choice."""
from __future__ import annotations

import json
import os
import sys

from fastbert.commands import add_kernels_argument

EPILOG = """\
tasks and --data:
  cola sst2 mrpc stsb qqp mnli qnli rte wnli
                   GLUE TSV layout: the GLUE root or the task folder (train.tsv, dev.tsv;
                   MNLI: dev_matched.tsv + dev_mismatched.tsv)
  squad            a folder with train-v1.1.json / dev-v1.1.json (or -v2.0), or with
                   --train-file / --eval-file; v2.0 files enable no-answer prediction
  ner              a CoNLL-2003 folder: train.txt/valid.txt (IOB2) or eng.train/eng.testa (IOB1), .xz ok
  multiple-choice  a folder with train.jsonl and dev.jsonl, one object per line:
                   {"context": "...", "question": "...", "choices": ["...", ...], "label": 0}
                   (context or question may be omitted; every line needs the same number of choices)

Runs in one process, or under a launcher: deepspeed --num_gpus N --module fastbert.cli finetune ...
(or torchrun --nproc_per_node N -m fastbert.cli finetune ...); --batch-size is per GPU.
"""


def add_parser(sub):
    from fastbert.tasks import TASK_NAMES

    p = sub.add_parser("finetune", help="fine-tune on GLUE, SQuAD, NER or multiple choice",
                       description="Fine-tune a BERT checkpoint on a downstream task and evaluate it on the dev set. "
                                   "Writes the fine-tuned model (HF format), metrics.json, predictions and "
                                   "metrics.jsonl to --output.",
                       epilog=EPILOG, formatter_class=_formatter())
    p.add_argument("--task", required=True, metavar="TASK", help=f"one of: {', '.join(TASK_NAMES)}")
    p.add_argument("--data", required=True, help="task data (see below)")
    p.add_argument("--model", required=True, help="HF BERT checkpoint directory (config.json, weights, vocab.txt)")
    p.add_argument("--output", default=None, help="output folder (default runs/finetune-TASK)")
    p.add_argument("--epochs", type=float, default=3.0, help="training epochs (fractions allowed; default 3)")
    p.add_argument("--lr", type=float, default=2e-5, help="peak learning rate of the pretrained weights (default 2e-5)")
    p.add_argument("--head-lr", type=float, default=None,
                   help="peak learning rate of the new task head (default: --lr)")
    p.add_argument("--batch-size", type=int, default=32, help="examples per step and GPU (default 32)")
    p.add_argument("--eval-batch-size", type=int, default=None, help="examples per evaluation batch")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="tokens per input (default 128; 384 for squad)")
    p.add_argument("--warmup", type=float, default=0.1,
                   help="linear warmup: a fraction of the steps (< 1) or a step count (>= 1); then linear decay to 0")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0 = off)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--seeds", type=int, default=1, metavar="N",
                   help="run seeds --seed .. --seed+N-1 into OUTPUT/seed-S/ and report the median and spread "
                        "of every dev metric in OUTPUT/seeds.json (finished seeds are reused; default 1)")
    p.add_argument("--max-train-samples", type=int, default=None, help="use only the first N training examples")
    p.add_argument("--max-eval-samples", type=int, default=None, help="use only the first N dev examples")
    p.add_argument("--freeze-encoder", action="store_true",
                   help="feature-based: train only the task head on frozen BERT features")
    add_kernels_argument(p)
    p.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16", "fp8"), default="auto",
                   help="auto = bf16 on CUDA, fp32 on the CPU; fp8 = bf16 with the encoder's GEMMs in FP8 (Ada/Hopper)")
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2), help="DeepSpeed ZeRO stage (default 0)")
    p.add_argument("--deepspeed-config", default=None, help="DeepSpeed JSON with extra ZeRO/offload settings")
    p.add_argument("--no-save-model", action="store_true", help="do not write the fine-tuned weights")
    p.add_argument("--no-static-batches", action="store_true",
                   help="padded batches instead of token-bucketed packed ones (GLUE tasks; the losses are the same)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run every step eagerly instead of replaying CUDA graphs of the static-shape step")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse_suppress())
    g = p.add_argument_group("squad")
    g.add_argument("--doc-stride", type=int, default=128, help="overlap between context windows in tokens (default 128)")
    g.add_argument("--max-query-len", type=int, default=64, help="question tokens kept (default 64)")
    g.add_argument("--max-answer-len", type=int, default=30, help="longest answer span in tokens (default 30)")
    g.add_argument("--n-best", type=int, default=20, help="start/end candidates per window (default 20)")
    g.add_argument("--null-threshold", type=float, default=0.0,
                   help="v2.0: predict no answer when null score - best span score > this (default 0)")
    g.add_argument("--train-file", default=None, help="SQuAD training JSON (instead of --data/train-*.json)")
    g.add_argument("--eval-file", default=None, help="SQuAD dev JSON (instead of --data/dev-*.json)")


def argparse_suppress():
    import argparse
    return argparse.SUPPRESS


def _formatter():
    import argparse
    return argparse.RawDescriptionHelpFormatter


def run(args) -> int:
    from pathlib import Path

    from fastbert.errors import UsageError
    from fastbert.tasks.settings import FinetuneError, TrainArgs, check_args, check_checkpoint, check_data, check_task

    task = args.task.lower()
    max_seq_len = args.max_seq_len or (384 if task == "squad" else 128)
    for flag in ("max_train_samples", "max_eval_samples", "eval_batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1")
    train_args = TrainArgs(epochs=args.epochs, lr=args.lr, head_lr=args.head_lr, batch_size=args.batch_size,
                           warmup=args.warmup, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
                           seed=args.seed, freeze_encoder=args.freeze_encoder, precision=args.precision,
                           zero_stage=args.zero_stage, ds_config=args.deepspeed_config,
                           static_batches=not args.no_static_batches, cuda_graphs=not args.no_cuda_graphs)
    options = {}
    if task == "squad":
        options = dict(doc_stride=args.doc_stride, max_query_len=args.max_query_len,
                       max_answer_len=args.max_answer_len, n_best=args.n_best, null_threshold=args.null_threshold,
                       train_file=args.train_file, eval_file=args.eval_file)
    elif args.train_file or args.eval_file:
        raise UsageError("--train-file / --eval-file are for --task squad; other tasks read --data")
    if args.seeds < 1:
        raise UsageError("--seeds must be >= 1")
    try:  # before torch loads: bad input answered at once (run_finetune checks the same)
        check_task(args.task)
        check_args(train_args, max_seq_len)
        check_checkpoint(Path(args.model))
    except FinetuneError as e:
        raise UsageError(str(e)) from None
    check_data(task, args.data, args.train_file, args.eval_file)  # DataError: exit 1, as the task would give later
    from fastbert.tasks.finetune import run_finetune

    def finetune_one(targs, output):
        try:
            return run_finetune(task, args.data, args.model, output, targs, max_seq_len=max_seq_len,
                                max_train_samples=args.max_train_samples, max_eval_samples=args.max_eval_samples,
                                kernels=args.kernels, eval_batch_size=args.eval_batch_size,
                                save_model=not args.no_save_model, task_options=options)
        except FinetuneError as e:
            raise UsageError(str(e)) from None

    if args.seeds > 1:
        import dataclasses

        from fastbert.training.seeds import run_seeds
        out = Path(args.output or f"runs/finetune-{task}")
        report = run_seeds(lambda seed, seed_out: finetune_one(dataclasses.replace(train_args, seed=seed),
                                                               str(seed_out))["metrics"],
                           range(args.seed, args.seed + args.seeds), out,
                           config={k: v for k, v in vars(args).items() if k != "run"},
                           log=lambda m: print(m, file=sys.stderr))
        if os.environ.get("RANK", "0") == "0":
            print(json.dumps({"task": task, "seeds": report["seeds"], "summary": report["summary"],
                              "output": str(out)}, indent=2, default=str))
        return 0
    summary = finetune_one(train_args, args.output)
    if os.environ.get("RANK", "0") != "0":  # under a launcher, rank 0 reports
        return 0
    print(json.dumps({"task": summary["task"], "metrics": summary["metrics"], "output": summary["output"],
                      "train_seconds": round(summary["train"]["train_seconds"], 2)}, indent=2), file=sys.stdout)
    return 0
