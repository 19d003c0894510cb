"""The fine-tuning driver behind ``fastbert finetune``: validate everything, build the head from a
checkpoint, train through DeepSpeed, evaluate, and write the output folder.

Output folder (rank 0 only): the fine-tuned model as an HF checkpoint (``config.json``,
``model.safetensors``) with the tokenizer files copied from the input checkpoint, ``metrics.json``
(final dev metrics, per-epoch metrics, timing, the arguments), the task's prediction files and
``metrics.jsonl`` (+ ``tensorboard/``) written during training as in pretraining.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch

from fastbert.config import BertConfig
from fastbert.data.glue import TASKS as GLUE_TASKS
from fastbert.errors import DataError
from fastbert.io import atomic_path, atomic_write_text
from fastbert.ops import resolve_kernels
from fastbert.tasks import TASK_NAMES
from fastbert.tasks.settings import FinetuneError, TrainArgs, check_args, check_checkpoint, check_task
from fastbert.tasks.trainer import build_finetune_engine, param_groups, train

log = logging.getLogger("fastbert")

TOKENIZER_FILES = ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.json")


def make_task(name: str, data, tokenizer, max_seq_len: int, max_train_samples=None, max_eval_samples=None,
              **options):
    """The FinetuneTask for ``name`` (see TASK_NAMES); ``options`` are task-specific settings."""
    key = check_task(name)
    common = dict(data=Path(data), tokenizer=tokenizer, max_seq_len=max_seq_len,
                  max_train_samples=max_train_samples, max_eval_samples=max_eval_samples)
    if key in GLUE_TASKS:
        from fastbert.tasks.glue import GlueFinetuneTask
        return GlueFinetuneTask(key, **common)
    if key == "squad":
        from fastbert.tasks.squad import SquadTask
        return SquadTask(**common, **options)
    if key == "ner":
        from fastbert.tasks.ner import NerTask
        return NerTask(**common)
    from fastbert.tasks.multiple_choice import MultipleChoiceTask
    return MultipleChoiceTask(**common)


def check_label_count(config: dict, model_cls: type, wanted: int, task: str) -> None:
    """A checkpoint that already carries this head with another label count cannot be reused as is."""
    archs = config.get("architectures") or []
    have = config.get("num_labels") or len(config.get("id2label") or {}) or None
    if model_cls.__name__ in archs and have is not None and have != wanted:
        raise FinetuneError(
            f"label count mismatch: the checkpoint is a {model_cls.__name__} with {have} labels but task "
            f"{task} has {wanted}; fine-tune from the base encoder checkpoint instead (or one trained on this task)")


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    """The checkpoint's tokenizer files next to the fine-tuned weights (so the output folder loads alone)."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            with atomic_path(dst / name) as tmp:
                shutil.copyfile(src / name, tmp)


def run_finetune(task_name: str, data, model_dir, output: Optional[str] = None, args: Optional[TrainArgs] = None,
                 max_seq_len: int = 128, max_train_samples: Optional[int] = None,
                 max_eval_samples: Optional[int] = None, kernels: Optional[str] = None,
                 eval_batch_size: Optional[int] = None, save_model: bool = True, task_options: Optional[dict] = None,
                 tokenizer=None, model_overrides: Optional[dict] = None) -> dict:
    """Fine-tune and evaluate; returns the metrics.json content (also written under ``output``).

    ``model_overrides``: extra BertConfig fields for the model (e.g. dropout probabilities)."""
    from fastbert.tokenization import load_tokenizer

    args = args or TrainArgs()
    model_dir = Path(model_dir)
    config = check_checkpoint(model_dir)
    if max_seq_len > int(config.get("max_position_embeddings", 512)):
        raise FinetuneError(f"--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings "
                            f"{config.get('max_position_embeddings')}; use a smaller --max-seq-len")
    check_args(args, max_seq_len)
    kernels = resolve_kernels(kernels)
    tokenizer = tokenizer or load_tokenizer(model_dir)
    task = make_task(task_name, data, tokenizer, max_seq_len, max_train_samples, max_eval_samples,
                     **(task_options or {}))
    task.prepare()
    kwargs = task.model_kwargs()
    check_label_count(config, task.model_cls, kwargs.get("num_labels", 2), task.name)

    torch.manual_seed(args.seed)  # the new head's initialization
    # The kernels flag's whole path: resolved above, into the config here, get_ops(config.kernels) in the model.
    model_config = BertConfig.from_pretrained(model_dir, kernels=kernels, **kwargs, **(model_overrides or {}))
    model = task.model_cls.from_pretrained(model_dir, config=model_config)
    groups = param_groups(model, args.lr, args.head_lr, args.weight_decay, args.freeze_encoder)
    engine = build_finetune_engine(model, groups, args)
    is_main = engine.dist.is_main
    out_dir = Path(output) if output else Path("runs") / f"finetune-{task.name}"
    logger = None
    if is_main:
        from fastbert.training.logging import MetricsLogger
        logger = MetricsLogger(out_dir, enabled=True, tensorboard=True, console=None)
        logger.log("start", 0, task=task.name, model=str(model_dir), kernels=kernels, precision=engine.precision,
                   world_size=engine.dist.world_size, **task.describe())
    eval_bs = eval_batch_size or max(args.batch_size, 64)
    last: dict = {}

    def evaluate(epoch: int) -> dict:
        metrics, files = task.evaluate(engine.module, eval_bs)
        last.update(metrics=metrics, files=files)
        return metrics

    t0 = time.perf_counter()
    collate = task.collate_static if (args.static_batches and task.static_batches) else task.collate
    result = train(engine, task.train_features, collate, args, logger=logger, evaluate=evaluate)
    wall = time.perf_counter() - t0
    metrics = last.get("metrics", {})
    summary = {
        "task": task.name, "model": str(model_dir), "metrics": metrics, "epochs": result.epoch_metrics,
        "train": {"steps": result.steps, "train_seconds": result.train_seconds, "wall_seconds": wall,
                  "examples": len(task.train_features), "final_loss": result.losses[-1][1] if result.losses else None,
                  "world_size": engine.dist.world_size, "precision": engine.precision, "kernels": kernels},
        "args": {**asdict(args), "max_seq_len": max_seq_len, "max_train_samples": max_train_samples,
                 "max_eval_samples": max_eval_samples, **(task_options or {})},
    }
    if is_main:
        for name, text in last.get("files", {}).items():
            atomic_write_text(out_dir / name, text)
        if save_model:
            module = engine.module
            module.save_pretrained(out_dir)
            copy_tokenizer_files(model_dir, out_dir)
        atomic_write_text(out_dir / "metrics.json", json.dumps(summary, indent=2, default=str) + "\n")
        logger.log("end", result.steps, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        logger.close()
    from fastbert.training.engine import barrier
    barrier()
    summary["output"] = str(out_dir)
    summary["losses"] = result.losses
    return summary


__all__ = ["run_finetune", "make_task", "TASK_NAMES", "FinetuneError", "DataError"]
