"""What a fine-tuning run is given, checked before anything heavy loads: the training settings (``TrainArgs``),
their bounds (``check_args``), the task name (``check_task``), its data files (``check_data``) and the checkpoint
folder (``check_checkpoint``).
No torch here, so the ``fastbert finetune`` and ``sbert-train`` commands answer bad input at once;
``run_finetune`` checks the same."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fastbert.errors import not_a_checkpoint_hint
from fastbert.tasks import TASK_NAMES, canonical_task


class FinetuneError(ValueError):
    """A fine-tuning set-up that cannot work; the message says what to change."""


@dataclass
class TrainArgs:
    epochs: float = 3.0
    lr: float = 2e-5                 # pretrained (encoder) weights
    head_lr: Optional[float] = None  # new task head; default: lr
    batch_size: int = 32             # per rank
    warmup: float = 0.1              # fraction of the optimizer steps (a value >= 1 is a step count)
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    seed: int = 42
    freeze_encoder: bool = False
    precision: str = "auto"          # fp32 | bf16 | fp16 | fp8 | auto (bf16 on CUDA, fp32 on CPU)
    zero_stage: int = 0
    ds_config: Optional[str] = None  # DeepSpeed JSON with ZeRO / offload settings
    static_batches: bool = True      # token-bucketed packed batches where the task supports them
    cuda_graphs: bool = True         # replay static-shape steps from CUDA graphs (CUDA, ZeRO-0, bf16/fp32)
    log_every: int = 10
    progress: bool = True


def check_args(args: TrainArgs, max_seq_len: int) -> None:
    """The training settings and --max-seq-len, checked before anything loads."""
    if args.batch_size < 1:
        raise FinetuneError("--batch-size must be >= 1")
    if not args.epochs > 0 or not math.isfinite(args.epochs):
        raise FinetuneError("--epochs must be > 0")
    if not args.lr > 0 or (args.head_lr is not None and not args.head_lr > 0):
        raise FinetuneError("--lr and --head-lr must be > 0")
    if args.warmup < 0:
        raise FinetuneError("--warmup must be >= 0 (a fraction of the steps, or a step count >= 1)")
    if max_seq_len < 8:
        raise FinetuneError("--max-seq-len must be >= 8")
    if args.zero_stage not in (0, 1, 2):
        raise FinetuneError("fine-tuning supports ZeRO stages 0, 1 and 2 (--zero-stage); stage 3 is for "
                            "models that do not fit one GPU, which BERT fine-tuning never needs")


def check_task(name: str) -> str:
    """The task ``name`` stands for (``canonical_task``), or a FinetuneError listing the tasks."""
    key = canonical_task(name)
    if key is None:
        raise FinetuneError(f"unknown task {name!r}; choose one of: {', '.join(TASK_NAMES)}")
    return key


def check_data(task: str, data, train_file=None, eval_file=None) -> None:
    """The task's train and dev files exist (and GLUE's first rows fit the task's layout), with the errors (DataError)
    the task's ``prepare()`` raises: it reads and checks every row, after torch has loaded."""
    key = check_task(task)
    if key == "squad":
        from fastbert.data.squad import split_file
        split_file(data, "train", train_file)
        split_file(data, "dev", eval_file)
    elif key == "ner":
        from fastbert.data.conll import find_split
        for split in ("train", "dev"):
            find_split(data, split)
    elif key == "multiple-choice":
        from fastbert.data.multiple_choice import find_split
        for split in ("train", "dev"):
            find_split(data, split)
    else:
        from fastbert.data.glue import check_layout, get_task, split_path
        glue = get_task(key)
        for split in ("train",) + glue.dev_splits:
            check_layout(glue, split_path(glue, Path(data), split))


def check_checkpoint(model_dir: Path) -> dict:
    """The checkpoint's config.json, after checking that the folder has weights and a vocabulary."""
    if not model_dir.is_dir():
        raise FinetuneError(f"model checkpoint folder not found: {model_dir} (pass an HF BERT checkpoint "
                            "directory with config.json, model.safetensors and vocab.txt)")
    for need in ("config.json", "vocab.txt"):
        if not (model_dir / need).is_file():
            raise FinetuneError(f"{model_dir} has no {need}: pass an HF BERT checkpoint directory "
                                "(config.json, model.safetensors or pytorch_model.bin, vocab.txt)"
                                + not_a_checkpoint_hint(model_dir))
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise FinetuneError(f"{model_dir / 'config.json'} is not valid JSON ({e})") from None
    with open(model_dir / "vocab.txt", encoding="utf-8", errors="replace") as f:
        vocab_lines = sum(1 for _ in f)
    vocab_size = config.get("vocab_size")
    if isinstance(vocab_size, int) and vocab_lines > vocab_size:
        raise FinetuneError(f"{model_dir / 'vocab.txt'} has {vocab_lines} tokens but the model's vocab_size is "
                            f"{vocab_size}: token ids would fall outside the vocabulary; use the model's own vocab.txt")
    return config
