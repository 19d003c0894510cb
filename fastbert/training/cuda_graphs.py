"""CUDA graphs of the model's forward + backward for static-shape batches (``packed=...``).

A training step on a small batch is mostly host time: hundreds of kernel launches through Python
and autograd for a few milliseconds of GPU work. With static shapes (``data/static_batch.py``) the
forward and backward can be recorded once per shape and replayed as two graph launches
(``torch.cuda.make_graphed_callables``). What stays eager: moving the batch into the graph's input
buffers, the gradient hand-off to ``.grad``, DeepSpeed's gradient reduction, clipping and the
optimizer step (torch's fused AdamW: a few launches).

Rules that keep replays equal to eager steps:

- a shape is captured the second time it is seen (the first runs eagerly and pays Triton's
  compilation and tuning outside any capture), at most ``max_graphs`` shapes; others run eagerly;
- dropout draws its seeds on the device (``ops/_common.dropout_seed``) and torch's own dropout is
  graph-safe, so each replay draws new masks;
- bf16 runs under ``torch.autocast`` without its weight-cast cache (recorded casts are redone on
  every replay, so optimizer updates are seen);
- outputs are copied out of the graph's buffers, which the next replay overwrites;
- with gradient accumulation, ``.grad`` lives in a buffer of ours from the first micro-batch of a
  step, so the graph's gradient outputs are added into it rather than kept (a replay would
  overwrite them);
- eval mode, and any batch without ``packed``, runs the eager model.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Optional

import torch

from fastbert.model import ModelOutput


def unsupported_reason(device: torch.device, precision: str, zero_stage: int, ds_profiling: bool = False) -> Optional[str]:
    """Why CUDA graphs cannot be used for this run (one line), or None. A replay bypasses DeepSpeed's
    forward (at ZeRO-0 it only starts timers and registers the backward prologue, which only
    starts timers): so not with its wall-clock breakdown or flops profiler on."""
    if device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if precision == "fp16":
        return "CUDA graphs are not used with fp16 (DeepSpeed's loss scaling runs eagerly); use bf16"
    if zero_stage != 0:
        return f"CUDA graphs need ZeRO-0 (ZeRO-{zero_stage} reduces gradients from backward hooks)"
    if ds_profiling:
        return "CUDA graphs are off while DeepSpeed's wall_clock_breakdown or flops_profiler is on"
    return None


class _PackedStep(torch.nn.Module):
    """``model(packed=...)`` as a module of tensors in, tensors out (what graph capture takes)."""

    def __init__(self, model: torch.nn.Module, names: tuple, scalars: dict):
        super().__init__()
        self.model = model
        self.names, self.scalars = names, scalars
        self.out_names: tuple = ()

    def forward(self, *tensors):
        out = self.model(packed={**dict(zip(self.names, tensors)), **self.scalars})
        self.out_names = tuple(k for k, v in out.items() if torch.is_tensor(v))
        return tuple(out[k] for k in self.out_names)


class GraphedModel:
    """Replays a captured forward + backward of ``model(packed=...)`` per batch shape."""

    def __init__(self, model: torch.nn.Module, precision: str, max_graphs: int = 16):
        self.model = model
        self.autocast = torch.bfloat16 if precision == "bf16" else None
        self.max_graphs = max_graphs
        self.graphs: dict = {}
        self.seen: Counter = Counter()
        self.replays = 0
        self._grads: Optional[list] = None

    @staticmethod
    def _key(packed: dict) -> tuple:
        return tuple((k, tuple(v.shape), v.dtype) if torch.is_tensor(v) else (k, v) for k, v in sorted(packed.items()))

    def __call__(self, packed: dict) -> Optional[ModelOutput]:
        """The model's output for this batch from a graph, or None: run the model eagerly."""
        if not self.model.training or not torch.is_grad_enabled():
            return None
        key = self._key(packed)
        step = self.graphs.get(key)
        if step is None:
            self.seen[key] += 1
            if self.seen[key] < 2 or len(self.graphs) >= self.max_graphs:
                return None
            step = self.graphs[key] = self._capture(packed)
        outs = step(*(packed[k] for k in step.names))
        self.replays += 1
        # Copies: the graph's output buffers are overwritten by the next replay (clone keeps autograd).
        return ModelOutput(**{k: v.clone() for k, v in zip(step.out_names, outs)})

    def _capture(self, packed: dict) -> _PackedStep:
        names = tuple(k for k, v in sorted(packed.items()) if torch.is_tensor(v))
        scalars = {k: v for k, v in packed.items() if not torch.is_tensor(v)}
        step = _PackedStep(self.model, names, scalars)
        sample = tuple(packed[k] for k in names)
        autocast = torch.autocast("cuda", dtype=self.autocast, cache_enabled=False) if self.autocast \
            else contextlib.nullcontext()
        with autocast:
            graphed = torch.cuda.make_graphed_callables(step, sample, allow_unused_input=True)
        graphed.names, graphed.out_names = names, step.out_names
        return graphed

    def own_grads(self) -> None:
        """Before the first backward of an accumulated optimizer step: zeroed gradients in a buffer of
        ours, so each micro-batch's graph gradients are added into it (see the module docstring)."""
        if self._grads is None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            by_dtype: dict = {}
            for p in params:
                by_dtype.setdefault(p.dtype, []).append(p)
            self._grads = []
            for dtype, group in by_dtype.items():
                flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=group[0].device)
                views, at = [], 0
                for p in group:
                    views.append(flat[at:at + p.numel()].view_as(p))
                    at += p.numel()
                self._grads.append((flat, group, views))
        for flat, group, views in self._grads:
            flat.zero_()
            for p, v in zip(group, views):
                p.grad = v
