"""CUDA graphs of the model's forward + backward for static-shape batches (``packed=...``).

A training step on a small batch is mostly host time: hundreds of kernel launches through Python
and autograd for a few milliseconds of GPU work. With static shapes (``data/static_batch.py``) the
forward and the backward are recorded once per shape and replayed as one graph launch each (the
scheme of ``torch.cuda.make_graphed_callables``, written out here because of the stream rule
below). What stays eager: copying the batch into the graph's input buffers, the gradient hand-off
to ``.grad``, DeepSpeed's gradient reduction, clipping and the optimizer step (torch's fused AdamW:
a few launches).

Rules that keep replays equal to eager steps:

- training runs on one side stream (``activate``): the autograd engine syncs a gradient into the
  stream its parameter's accumulator was created on, so eager steps and captures share the stream
  (capturing next to accumulators made on the legacy default stream fails); captures are
  thread-local, so the data loader's thread may pin memory meanwhile;
- a shape is captured the second time it is seen (the first runs eagerly and pays Triton's
  compilation and tuning outside any capture), at most ``max_graphs`` shapes; others run eagerly;
- dropout draws its seeds on the device (``ops/_common.dropout_seed``) and torch's own dropout is
  graph-safe, so each replay draws new masks;
- bf16 runs under ``torch.autocast`` without its weight-cast cache (recorded casts are redone on
  every replay, so optimizer updates are seen); the fused ops' casts of the weights are the
  ``WeightCasts`` copies the engine keeps when steps accumulate (``ops/weight_casts.py``), if it is
  active around the capture: the graphs read those buffers, and the engine rewrites them in place,
  outside the graphs, before the first micro-batch of each optimizer step;
- outputs are copied out of the graph's buffers, which the next replay overwrites;
- with gradient accumulation, ``.grad`` lives in a buffer of ours from the first micro-batch of a
  step, and a graph captured then adds each micro-batch's gradients into it itself: the weight-gradient
  GEMMs of the fused ops add their products into ``.grad`` (``ops/grad_accum.py``: beta = 1, no pass of
  their own), the embedding backward's atomics add into the word and position tables' (the word table's
  other half, the tied decoder's, comes from its GEMM into the same buffer) and the other gradients are
  added by one multi-tensor addition inside the graph, so autograd adds nothing after a replay (before:
  one addition kernel per parameter, 1.3 GB of fp32 gradients read twice and written twice a BERT-large
  micro-batch). ``FASTBERT_GRAPH_ACCUMULATE=0`` keeps autograd's additions (the graph's gradient outputs
  added into ``.grad`` after each replay);
- eval mode, no-grad calls and any batch without ``packed`` run the eager model.
"""
from __future__ import annotations

import contextlib
import os
from collections import Counter
from typing import Optional

import torch

from fastbert.model import ModelOutput
from fastbert.ops import grad_accum


def unsupported_reason(device: torch.device, precision: str, zero_stage: int, kernels: str = "triton",
                       ds_profiling: bool = False) -> Optional[str]:
    """Why CUDA graphs cannot be used for this run (one line), or None. A replay bypasses DeepSpeed's
    forward (at ZeRO-0 it only starts timers and registers the backward prologue, which only
    starts timers): so not with its wall-clock breakdown or flops profiler on."""
    if device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if kernels != "triton":
        return f"CUDA graphs need kernels='triton' (the {kernels!r} reference path reads lengths from the device)"
    if precision == "fp16":
        return "CUDA graphs are not used with fp16 (DeepSpeed's loss scaling runs eagerly); use bf16"
    if zero_stage != 0:
        return f"CUDA graphs need ZeRO-0 (ZeRO-{zero_stage} reduces gradients from backward hooks)"
    if ds_profiling:
        return "CUDA graphs are off while DeepSpeed's wall_clock_breakdown or flops_profiler is on"
    return None


class _Captured:
    """One shape's forward and backward graphs with their static buffers."""

    def __init__(self, model: torch.nn.Module, packed: dict, autocast, stream, warmup: int = 2,
                 buffers: Optional[dict] = None):
        """``buffers``: ``{parameter: its .grad}`` to capture a step that adds its gradients into them (see the
        module docstring); None: a step that returns them."""
        self.names = tuple(k for k, v in sorted(packed.items()) if torch.is_tensor(v))
        scalars = {k: v for k, v in packed.items() if not torch.is_tensor(v)}
        self.inputs = tuple(packed[k].clone() for k in self.names)
        self.params = tuple(p for p in model.parameters() if p.requires_grad)

        def forward():
            out = model(packed={**dict(zip(self.names, self.inputs)), **scalars})
            return {k: v for k, v in out.items() if torch.is_tensor(v)}

        def backward(outs, grad_outs, accumulate=False):
            with_grad = [v for v in outs.values() if v.requires_grad]
            grads = torch.autograd.grad(with_grad, self.params, grad_outs, allow_unused=True)
            if not accumulate:
                return grads
            # What the fused ops' GEMMs did not add already (None here): one multi-tensor addition.
            rest = [(buffers[p], g) for p, g in zip(self.params, grads) if g is not None]
            if rest:
                torch._foreach_add_([b for b, _ in rest], [g for _, g in rest])
            return (None,) * len(self.params)

        pool = torch.cuda.graph_pool_handle()
        capture = dict(pool=pool, stream=stream, capture_error_mode="thread_local")
        with autocast:
            for _ in range(warmup):   # the graph's allocations and lazy initializations, outside capture
                outs = forward()
                backward(outs, [torch.ones_like(v) for v in outs.values() if v.requires_grad])
            self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            # The fused ops look their weights' buffers up while the forward runs (ops/grad_accum.py).
            with grad_accum.accumulating(buffers or {}), torch.cuda.graph(self.fwd, **capture):
                self.outs = forward()
            self.grad_outs = [torch.zeros_like(v) for v in self.outs.values() if v.requires_grad]
            with torch.cuda.graph(self.bwd, **capture):
                self.grads = backward(self.outs, self.grad_outs, accumulate=buffers is not None)


class _Replay(torch.autograd.Function):
    """Autograd sees the replayed step as one op of the batch and the parameters."""

    @staticmethod
    def forward(ctx, cap: _Captured, *tensors):
        for buf, t in zip(cap.inputs, tensors[:len(cap.inputs)]):
            buf.copy_(t)
        cap.fwd.replay()
        ctx.cap = cap
        outs = tuple(v.detach() for v in cap.outs.values())
        ctx.mark_non_differentiable(*(o for o, v in zip(outs, cap.outs.values()) if not v.requires_grad))
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        cap = ctx.cap
        with_grad = [g for g, v in zip(grads, cap.outs.values()) if v.requires_grad]
        for buf, g in zip(cap.grad_outs, with_grad):
            buf.copy_(g)
        cap.bwd.replay()
        return (None,) + (None,) * len(cap.inputs) + tuple(g.detach() if g is not None else None for g in cap.grads)


def grad_views(params: list) -> tuple:
    """One zeroed buffer for the gradients of ``params`` (one dtype, one device) and a view of it per parameter, each
    starting on 16 bytes: the fused AdamW loads a step's gradients with vector loads only when every one is so
    aligned (``ops/adamw.py``), and one odd-sized tensor (BERT's 30,522-entry decoder bias) would otherwise shift
    every later view off it: the BERT-large command's optimizer step took 5.75 ms, 2.70 with the views aligned (H200,
    thirty-ninth session)."""
    align = max(1, 16 // params[0].element_size())
    starts, at = [], 0
    for p in params:
        starts.append(at)
        at += -(-p.numel() // align) * align
    flat = torch.zeros(at, dtype=params[0].dtype, device=params[0].device)
    return flat, [flat[s:s + p.numel()].view_as(p) for s, p in zip(starts, params)]


class GraphedModel:
    """Replays a captured forward + backward of ``model(packed=...)`` per batch shape."""

    def __init__(self, model: torch.nn.Module, precision: str, max_graphs: int = 16):
        self.model = model
        self.autocast = torch.bfloat16 if precision == "bf16" else None
        self.max_graphs = max_graphs
        self.graphs: dict = {}
        self.seen: Counter = Counter()
        self.replays = 0
        self.stream = torch.cuda.Stream()
        self._grads: Optional[list] = None
        self._buffers: Optional[dict] = None  # {parameter: its .grad buffer} once own_grads() made them
        self.accumulate = os.environ.get("FASTBERT_GRAPH_ACCUMULATE", "1") != "0"

    def activate(self) -> None:
        """Make the training stream this thread's current CUDA stream (see the module docstring)."""
        self.stream.wait_stream(torch.cuda.current_stream())
        torch.cuda.set_stream(self.stream)

    @staticmethod
    def _key(packed: dict) -> tuple:
        return tuple((k, tuple(v.shape), v.dtype) if torch.is_tensor(v) else (k, v) for k, v in sorted(packed.items()))

    def __call__(self, packed: dict) -> Optional[ModelOutput]:
        """The model's output for this batch from a graph, or None: run the model eagerly."""
        if not self.model.training or not torch.is_grad_enabled():
            return None
        if torch.cuda.current_stream() != self.stream:
            raise RuntimeError("CUDA graphs: training must run on GraphedModel.stream (call activate() first)")
        key = self._key(packed)
        cap = self.graphs.get(key)
        if cap is None:
            self.seen[key] += 1
            if self.seen[key] < 2 or len(self.graphs) >= self.max_graphs:
                return None
            autocast = torch.autocast("cuda", dtype=self.autocast, cache_enabled=False) if self.autocast \
                else contextlib.nullcontext()
            try:
                buffers = self._buffers if self.accumulate else None
                cap = self.graphs[key] = _Captured(self.model, packed, autocast, self.stream, buffers=buffers)
            except RuntimeError as e:
                # A failed capture leaves torch's CUDA generator unusable for the rest of the process:
                # no eager fallback is safe, so stop with what to change.
                raise RuntimeError(f"CUDA graph capture of the training step failed ({str(e).splitlines()[0]}); "
                                   "rerun with train.cuda_graphs=false (fastbert finetune --no-cuda-graphs)") from e
        outs = _Replay.apply(cap, *(packed[k] for k in cap.names), *cap.params)
        self.replays += 1
        # Copies: the graph's output buffers are overwritten by the next replay (clone keeps autograd).
        return ModelOutput(**{k: v.clone() for k, v in zip(cap.outs, outs)})

    def own_grads(self) -> None:
        """Before the first backward of an accumulated optimizer step: zeroed gradients in a buffer of
        ours, so each micro-batch's gradients are added into it (by the graphs captured from then on
        themselves; see the module docstring)."""
        if self._grads is None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            by_dtype: dict = {}
            for p in params:
                by_dtype.setdefault(p.dtype, []).append(p)
            self._grads = []
            for group in by_dtype.values():
                flat, views = grad_views(group)
                self._grads.append((flat, group, views))
            self._buffers = {p: v for _, group, views in self._grads for p, v in zip(group, views)}
        for flat, group, views in self._grads:
            flat.zero_()
            for p, v in zip(group, views):
                p.grad = v
