"""The fine-tuning loop: parameter groups (smaller LR for pretrained weights than for the new head,
or a frozen encoder), warmup then linear decay, deterministic batches, and DeepSpeed underneath.

Training goes through ``fastbert.training`` (``init_distributed``, the DeepSpeed config builder and
``TrainEngine``), the same path as pretraining: one CPU process (gloo) or many GPUs under the
``deepspeed`` launcher. The optimizer is pretraining's AdamW (``training/optim.py``: fastbert's on CUDA, which
also writes the weights' 16-bit copies, torch's on the CPU) handed to DeepSpeed as a client optimizer, so
per-group learning rates (encoder vs head) survive ZeRO's flattening (ZeRO keeps one flat partition per group)
and no DeepSpeed op has to be compiled.

Batches: every epoch draws a permutation from ``seed + epoch``; global batches of
``batch_size x world_size`` examples are cut from it and rank ``r`` takes the ``r``-th slice. With
several ranks a short last global batch is filled up from the start of the permutation so that every
rank runs the same number of steps (as ``DistributedSampler`` does).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from tqdm import tqdm

from fastbert.tasks.settings import TrainArgs
from fastbert.training.engine import to_device


NO_DECAY = ("bias", "LayerNorm.weight", "LayerNorm.bias", "layer_norm")
# AdamW as HF TrainingArguments' defaults (adam_beta1, adam_beta2, adam_epsilon).
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


def param_groups(model: torch.nn.Module, lr: float, head_lr: Optional[float], weight_decay: float,
                 freeze_encoder: bool, encoder_prefix: str = "bert.") -> list[dict]:
    """Up to four AdamW groups: (encoder | head) x (decay | no decay). Each carries ``base_lr``, the
    peak learning rate the schedule scales. ``freeze_encoder`` turns off gradients of every
    parameter under ``encoder_prefix`` (feature-based training: only the head learns)."""
    head_lr = lr if head_lr is None else head_lr
    buckets: dict[tuple[bool, bool], list] = {}
    for name, p in model.named_parameters():
        is_encoder = name.startswith(encoder_prefix)
        if is_encoder and freeze_encoder:
            p.requires_grad_(False)
        if not p.requires_grad:
            continue
        decay = p.ndim >= 2 and not any(m in name for m in NO_DECAY)
        buckets.setdefault((is_encoder, decay), []).append(p)
    if not buckets:
        raise ValueError("no trainable parameters (is the whole model frozen?)")
    groups = []
    for (is_encoder, decay), params in sorted(buckets.items(), key=lambda kv: (not kv[0][0], not kv[0][1])):
        base = lr if is_encoder else head_lr
        groups.append({"params": params, "weight_decay": weight_decay if decay else 0.0, "lr": base,
                       "base_lr": base, "name": f"{'encoder' if is_encoder else 'head'}{'' if decay else '_no_decay'}"})
    return groups


def warmup_steps(total_steps: int, warmup: float) -> int:
    """Warmup length in optimizer steps: a fraction (< 1) of ``total_steps`` rounded up, or a step
    count (>= 1), as HF ``TrainingArguments.get_warmup_steps``."""
    return int(warmup) if warmup >= 1 else math.ceil(total_steps * warmup)


def lr_multiplier(step: int, total_steps: int, warmup: float) -> float:
    """HF's ``get_linear_schedule_with_warmup`` (what Trainer and run_glue use) at 0-based optimizer
    step ``step``: ``step / W`` during the ``W`` warmup steps (so the first step has a learning rate
    of 0 when there is warmup), then linear decay to 0 at ``total_steps``."""
    w = warmup_steps(total_steps, warmup)
    if step < w:
        return step / max(1, w)
    return max(0.0, (total_steps - step) / max(1, total_steps - w))


def set_group_lrs(optimizer, multiplier: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = g.get("base_lr", g["lr"]) * multiplier


# ---------------------------------------------------------------------------------------- batches
def epoch_batches(n: int, batch_size: int, seed: int, epoch: int, rank: int = 0, world: int = 1,
                  shuffle: bool = True) -> list[list[int]]:
    """This rank's example indices for each step of ``epoch`` (see the module docstring)."""
    if n == 0:
        return []
    if shuffle:
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    per_step = batch_size * world
    steps = math.ceil(n / per_step)
    if world > 1 and n % per_step:
        order = order + (order * per_step)[: steps * per_step - n]
    return [order[s * per_step + rank * batch_size: s * per_step + (rank + 1) * batch_size] for s in range(steps)]


def steps_per_epoch(n: int, batch_size: int, world: int = 1) -> int:
    return math.ceil(n / (batch_size * world))


def total_steps(n: int, batch_size: int, epochs: float, world: int = 1) -> int:
    return max(1, math.ceil(steps_per_epoch(n, batch_size, world) * epochs))


def pad_batch(rows: Sequence[dict], pad_values: dict[str, int], device=None) -> dict[str, torch.Tensor]:
    """Stack feature dicts into tensors; list-valued fields are right-padded to the longest row.

    ``pad_values`` gives the padding value per list field (default 0; labels use -100)."""
    out = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        if isinstance(values[0], (list, tuple)):
            if values[0] and isinstance(values[0][0], (list, tuple)):   # (choices, seq) per row
                width = max(len(s) for v in values for s in v)
                fill = pad_values.get(key, 0)
                t = torch.tensor([[list(s) + [fill] * (width - len(s)) for s in v] for v in values])
            else:
                width = max(len(v) for v in values)
                fill = pad_values.get(key, 0)
                t = torch.tensor([list(v) + [fill] * (width - len(v)) for v in values])
        else:
            t = torch.tensor(values)
        out[key] = t.to(device) if device is not None else t
    return out


# ---------------------------------------------------------------------------------------- engine
def build_finetune_engine(model: torch.nn.Module, groups: list[dict], args: TrainArgs):
    """DeepSpeed engine over ``model`` with our parameter groups (fastbert.training's config builder,
    process-group set-up and ``TrainEngine``; a client AdamW so per-group LRs are kept)."""
    import deepspeed

    from fastbert.training.engine import (TrainEngine, build_ds_config, deepspeed_view, init_distributed,
                                          resolve_precision, use_fp8)
    from fastbert.training.optim import build_client_optimizer
    from fastbert.training.optim_spec import OptimizerSpec

    dist = init_distributed()
    model = model.to(dist.device)
    spec = OptimizerSpec(type="adamw", lr=args.lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=args.weight_decay)
    precision = resolve_precision(args.precision, dist.device)
    use_fp8(model, args.precision)
    opt_groups = [{k: v for k, v in g.items() if k != "name"} for g in groups]
    optimizer = build_client_optimizer(spec, opt_groups, dist.device.type)
    cfg = build_ds_config(args.ds_config, micro_batch_size=args.batch_size,
                          global_batch_size=args.batch_size * dist.world_size, world_size=dist.world_size,
                          precision=precision, gradient_clipping=args.max_grad_norm, optimizer=spec,
                          device=dist.device, zero_stage=args.zero_stage, client_optimizer=optimizer)
    ds_engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_view(cfg),
                                              dist_init_required=False)
    engine = TrainEngine(ds_engine, dist, cfg, spec, precision)
    engine.enable_cuda_graphs(args.cuda_graphs, say=(lambda text: print(text, flush=True)) if dist.is_main else None)
    return engine


# ---------------------------------------------------------------------------------------- loop
@dataclass
class TrainResult:
    steps: int = 0
    losses: list = field(default_factory=list)   # (step, loss) of every optimizer step on this rank
    train_seconds: float = 0.0
    epoch_metrics: list = field(default_factory=list)


def train(engine, features: Sequence[dict], collate: Callable[[list], dict], args: TrainArgs,
          logger=None, evaluate: Optional[Callable[[int], dict]] = None) -> TrainResult:
    """Run ``args.epochs`` epochs over ``features``; ``evaluate(epoch)`` (if given) runs after each
    full epoch and its metrics go to the log. ``collate`` turns feature dicts into model kwargs."""
    rank, world = engine.dist.rank, engine.dist.world_size
    n_total = total_steps(len(features), args.batch_size, args.epochs, world)
    per_epoch = steps_per_epoch(len(features), args.batch_size, world)
    result = TrainResult()
    bar = tqdm(total=n_total, desc="finetune", unit="step", disable=not (args.progress and rank == 0),
               dynamic_ncols=True)
    torch.manual_seed(args.seed)  # dropout streams
    t0 = time.perf_counter()
    step, epoch = 0, 0
    window = []
    while step < n_total:
        engine.train()
        for idx in epoch_batches(len(features), args.batch_size, args.seed, epoch, rank, world):
            if step >= n_total:
                break
            set_group_lrs(engine.ds.optimizer, lr_multiplier(step, n_total, args.warmup))
            batch = to_device(collate([features[i] for i in idx]), engine.device)
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            # Losses stay on the device and are read every log_every steps: no per-step host sync.
            window.append(loss.detach().float())
            step += 1
            if step % args.log_every == 0 or step == n_total:
                values = torch.stack(window).tolist()
                first = step - len(values)
                for i, value in enumerate(values):
                    if not math.isfinite(value):
                        raise FloatingPointError(f"loss is {value} at step {first + i}; lower --lr or use "
                                                 "--precision fp32")
                    result.losses.append((first + i, value))
                bar.update(len(values))
                bar.set_postfix(loss=f"{values[-1]:.4f}", epoch=epoch)
                if logger is not None:
                    lrs = [g["lr"] for g in engine.ds.optimizer.param_groups]
                    logger.log("train", step, loss=sum(values) / len(values), lr=lrs[0], head_lr=lrs[-1],
                               epoch=step / per_epoch, elapsed_s=time.perf_counter() - t0)
                window = []
        epoch += 1
        full_epoch = step == epoch * per_epoch or step == n_total
        if evaluate is not None and full_epoch:
            elapsed = time.perf_counter() - t0
            metrics = evaluate(epoch)
            result.epoch_metrics.append({"epoch": epoch, "step": step, **metrics})
            if logger is not None:
                logger.log("eval", step, epoch=epoch, **{k: v for k, v in metrics.items()
                                                         if isinstance(v, (int, float))})
            t0 = time.perf_counter() - elapsed  # evaluation time does not count as training time
    bar.close()
    result.steps = step
    result.train_seconds = time.perf_counter() - t0
    return result
