"""The baseline fastbert's fine-tuning is compared with: a plain HF transformers loop.

Same data, features, batches and order (``epoch_batches``), same parameter groups and learning
rates, same warmup/decay schedule, AdamW and global-norm clipping as fastbert's DeepSpeed path,
and the same initial head weights (copied from a fastbert model built with the same seed). Used by
tests/tasks/test_finetune_parity.py on the CPU and by scripts/gpu_finetune_check.py on a GPU (where
HF runs under bf16 autocast, its usual mixed-precision mode). Needs ``transformers``.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from fastbert.tasks.trainer import (ADAM_BETAS, ADAM_EPS, TrainArgs, epoch_batches, lr_multiplier, param_groups,
                                    set_group_lrs, total_steps)


def load_hf_model(task, model_dir, seed: int, attn_implementation: str = "sdpa", **config_overrides):
    """The HF head for ``task`` (a prepared FinetuneTask) with the new head initialized exactly as
    ``run_finetune`` initializes fastbert's (same seed, weights copied)."""
    import transformers

    kwargs = task.model_kwargs()
    torch.manual_seed(seed)
    fb = task.model_cls.from_pretrained(model_dir, **kwargs, **config_overrides)
    hf_cls = getattr(transformers, task.model_cls.__name__)
    hf_kwargs = {k: v for k, v in kwargs.items() if k in ("num_labels", "problem_type", "id2label")}
    # fp32 weights whatever the checkpoint's dtype (the GPU run carries a bf16 copy): HF trains with
    # fp32 master weights under autocast, fastbert with DeepSpeed's fp32 master copy.
    hf = hf_cls.from_pretrained(str(model_dir), attn_implementation=attn_implementation, dtype=torch.float32,
                                **hf_kwargs, **config_overrides)
    fb_state = fb.state_dict()
    with torch.no_grad():
        for prefix in task.model_cls.head_prefixes:
            for name, p in hf.named_parameters():
                if name.startswith(prefix):
                    p.copy_(fb_state[name])
    return hf


def hf_finetune(task, hf_model, args: TrainArgs, device: Optional[torch.device] = None,
                autocast_dtype: Optional[torch.dtype] = None) -> dict:
    """Train ``hf_model`` on ``task.train_features`` as fastbert's trainer does, then evaluate.

    Returns ``{"losses": [(step, loss)], "metrics": ..., "train_seconds": ...}``.
    """
    device = device or torch.device("cpu")
    model = hf_model.to(device)
    groups = param_groups(model, args.lr, args.head_lr, args.weight_decay, args.freeze_encoder)
    opt_groups = [{k: v for k, v in g.items() if k != "name"} for g in groups]
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    optimizer = torch.optim.AdamW(opt_groups, lr=args.lr, betas=ADAM_BETAS, eps=ADAM_EPS,
                                  weight_decay=args.weight_decay, **fused)
    params = [p for g in groups for p in g["params"]]
    n = len(task.train_features)
    n_total = total_steps(n, args.batch_size, args.epochs)
    losses = []
    torch.manual_seed(args.seed)
    model.train()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    step, epoch = 0, 0
    while step < n_total:
        for idx in epoch_batches(n, args.batch_size, args.seed, epoch):
            if step >= n_total:
                break
            set_group_lrs(optimizer, lr_multiplier(step, n_total, args.warmup))
            batch = {k: v.to(device) for k, v in task.collate([task.train_features[i] for i in idx]).items()}
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = model(**batch).loss
            loss.backward()
            if args.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append((step, float(loss.detach().float())))
            step += 1
        epoch += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_seconds = time.perf_counter() - t0
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        metrics, _ = task.evaluate(model, max(args.batch_size, 64))
    return {"losses": losses, "metrics": metrics, "train_seconds": train_seconds, "steps": step}
