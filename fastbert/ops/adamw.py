"""AdamW over many fp32 tensors in one Triton launch that also writes each weight's 16-bit copy.

Under ``torch.autocast`` the fused ops read 16-bit copies of the fp32 master weights (``weight_casts.py``). With
one micro-batch an optimizer step, torch's fused AdamW reads and writes every weight (28 bytes an element: weight,
gradient and both moments in, weight and moments out) and then the copies are cast again: 156 more kernels and 6
more bytes an element (~0.75 ms a BERT-large step on an H200, benchmarks/RESULTS.md). Here the update writes the
new weight's 16-bit value too, from the registers that hold it: 2 bytes an element and no launch of its own.

The math is torch's AdamW (decoupled weight decay, bias-corrected moments; ``torch.optim.AdamW``'s
documentation): for step t, with the learning rate ``lr`` and decay ``wd``::

    p <- p * (1 - lr * wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

One launch per parameter group and copy dtype (bf16, fp16, none): each program takes CHUNK elements of one tensor, found through
device tables of the tensors' addresses (as Triton's grouped GEMM tutorial finds its matrices) and of the chunks'
(tensor, start). The step counts stay per tensor on the device (torch's fused layout, so state dicts are
interchangeable), and ``found_inf`` (a device flag, the guard's or a grad scaler's) leaves weights, moments,
copies and step counts as they were without a host read. ``adamw_reference_`` is the same step in plain PyTorch.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from fastbert.ops._common import check_triton_device, tl, triton

CHUNK = 8192     # elements a program (4 blocks): the table lookups are paid once a chunk
BLOCK = 2048
_COPY_TL = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@triton.jit
def _adamw_kernel(PTRS, NUMELS, CHUNK_T, CHUNK_START, FOUND_INF, n_tensors, lr, beta1, beta2, one_minus_beta1,
                  one_minus_beta2, log2_beta1, log2_beta2, eps, decay, HAS_FOUND_INF: tl.constexpr,
                  COPY: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """PTRS: (5 or 6, n_tensors) int64 addresses: weights, gradients, first and second moments (fp32), step
    counts (one fp32 each), then the copies (COPY: "bf16" / "fp16" / "" for none). The betas' complements and
    logarithms come from the host in double precision, rounded once."""
    if HAS_FOUND_INF:
        if tl.load(FOUND_INF) != 0:
            return
    pid = tl.program_id(0)
    t = tl.load(CHUNK_T + pid)
    start = tl.load(CHUNK_START + pid)
    n = tl.load(NUMELS + t)
    P = tl.load(PTRS + t).to(tl.pointer_type(tl.float32))
    G = tl.load(PTRS + n_tensors + t).to(tl.pointer_type(tl.float32))
    M = tl.load(PTRS + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
    V = tl.load(PTRS + 3 * n_tensors + t).to(tl.pointer_type(tl.float32))
    S = tl.load(PTRS + 4 * n_tensors + t).to(tl.pointer_type(tl.float32))
    step = tl.load(S)
    bc1 = 1.0 - tl.exp2(step * log2_beta1)
    bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    step_size = lr / bc1
    keep = 1.0 - lr * decay
    for i in tl.static_range(0, CHUNK, BLOCK):
        offs = start + i + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(P + offs, mask=mask)
        g = tl.load(G + offs, mask=mask)
        m = tl.load(M + offs, mask=mask)
        v = tl.load(V + offs, mask=mask)
        p = p * keep
        m = beta1 * m + one_minus_beta1 * g
        v = beta2 * v + one_minus_beta2 * g * g
        p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(P + offs, p, mask=mask)
        tl.store(M + offs, m, mask=mask)
        tl.store(V + offs, v, mask=mask)
        if COPY == "bf16":
            C = tl.load(PTRS + 5 * n_tensors + t).to(tl.pointer_type(tl.bfloat16))
            tl.store(C + offs, p.to(tl.bfloat16), mask=mask)
        elif COPY == "fp16":
            C = tl.load(PTRS + 5 * n_tensors + t).to(tl.pointer_type(tl.float16))
            tl.store(C + offs, p.to(tl.float16), mask=mask)


_chunk_tables: dict = {}   # (device, numels) -> (numels, chunk tensor, chunk start) on the device


def _chunks(numels: tuple, device: torch.device):
    """Device tables for tensors of these sizes: each tensor's size, and every chunk's (tensor, start)."""
    key = (device, numels)
    hit = _chunk_tables.get(key)
    if hit is None:
        counts = [(n + CHUNK - 1) // CHUNK for n in numels]
        tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), torch.tensor(counts))
        first = torch.tensor([0] + counts[:-1], dtype=torch.int64).cumsum(0)
        start = (torch.arange(len(tensor), dtype=torch.int64) - first[tensor.long()]) * CHUNK
        hit = (torch.tensor(numels, dtype=torch.int64).to(device), tensor.to(device), start.to(device))
        _chunk_tables[key] = hit
    return hit


def _table(rows: Sequence[Sequence[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """The tensors' addresses as one (len(rows), n) int64 device table (pinned, copied without a host wait)."""
    host = torch.tensor([[t.data_ptr() for t in row] for row in rows], dtype=torch.int64,
                        pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def check_tensors(params, grads, exp_avgs, exp_avg_sqs, steps, copies) -> Optional[str]:
    """Why ``adamw_step_`` cannot take these tensors (one line), or None."""
    if not params:
        return "no tensors"
    device = params[0].device
    for row in (params, grads, exp_avgs, exp_avg_sqs):
        for p, t in zip(params, row):
            if t.dtype != torch.float32 or t.device != device or not t.is_contiguous() or t.numel() != p.numel():
                return "weights, gradients and moments must be contiguous fp32 tensors of one size on one device"
    if any(s.dtype != torch.float32 or s.device != device or s.numel() != 1 for s in steps):
        return "step counts must be one-element fp32 tensors on the weights' device"
    if any(c is not None and c.dtype not in _COPY_TL for c in copies):
        return "copies must be bf16 or fp16"
    if any(c is not None and (c.shape != p.shape or c.device != device or not c.is_contiguous())
           for p, c in zip(params, copies)):
        return "a copy must be a contiguous tensor of its weight's shape on its device"
    return None


def adamw_step_(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None, *, lr: float, beta1: float,
                beta2: float, eps: float, weight_decay: float, found_inf: Optional[torch.Tensor] = None) -> None:
    """One AdamW step over these tensors in place (Triton; CUDA, or the interpreter for CPU tensors): adds one
    to each step count, updates weights and moments and writes ``copies[i]`` (a 16-bit tensor of the weight's
    shape, or None) from the new weight. ``found_inf``: a device flag; nonzero leaves everything as it was."""
    copies = list(copies) if copies is not None else [None] * len(params)
    if not params:
        return
    reason = check_tensors(params, grads, exp_avgs, exp_avg_sqs, steps, copies)
    if reason is not None:
        raise ValueError(f"adamw_step_: {reason}")
    check_triton_device(params[0])
    device = params[0].device
    if found_inf is None:
        torch._foreach_add_(steps, 1.0)
    else:
        found_inf = found_inf.reshape(()).to(device=device, dtype=torch.float32)
        torch._foreach_add_(steps, 1.0 - found_inf)
    launches: dict = {}       # copy dtype (None: no copy) -> the tensors' indices
    for i, c in enumerate(copies):
        launches.setdefault(c.dtype if c is not None else None, []).append(i)
    for dtype, idx in launches.items():
        rows = [[params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                [exp_avg_sqs[i] for i in idx], [steps[i] for i in idx]]
        if dtype is not None:
            rows.append([copies[i] for i in idx])
        numels, chunk_t, chunk_start = _chunks(tuple(params[i].numel() for i in idx), device)
        _adamw_kernel[(chunk_t.numel(),)](
            _table(rows, device), numels, chunk_t, chunk_start, found_inf if found_inf is not None else numels,
            len(idx), float(lr), float(beta1), float(beta2), 1.0 - beta1, 1.0 - beta2, math.log2(beta1),
            math.log2(beta2), float(eps), float(weight_decay),
            HAS_FOUND_INF=found_inf is not None, COPY=_COPY_TL.get(dtype, ""), CHUNK=CHUNK, BLOCK=BLOCK)


@torch.no_grad()
def adamw_reference_(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None, *, lr: float, beta1: float,
                     beta2: float, eps: float, weight_decay: float, found_inf: Optional[torch.Tensor] = None) -> None:
    """``adamw_step_`` in plain PyTorch, tensor by tensor (the bias corrections in double, as torch's
    for-loop AdamW takes them)."""
    copies = list(copies) if copies is not None else [None] * len(params)
    if found_inf is not None and bool(found_inf.reshape(())):
        return
    for p, g, m, v, s, c in zip(params, grads, exp_avgs, exp_avg_sqs, steps, copies):
        s += 1
        t = float(s)
        p.mul_(1.0 - lr * weight_decay)
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = v.sqrt() / (1.0 - beta2 ** t) ** 0.5 + eps
        p.addcdiv_(m, denom, value=-lr / (1.0 - beta1 ** t))
        if c is not None:
            c.copy_(p)
