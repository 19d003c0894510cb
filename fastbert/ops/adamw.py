"""AdamW over many fp32 tensors in one Triton launch that also writes each weight's 16-bit copy.

Under ``torch.autocast`` the fused ops read 16-bit copies of the fp32 master weights (``weight_casts.py``). With
one micro-batch an optimizer step, torch's fused AdamW reads and writes every weight (28 bytes an element: weight,
gradient and both moments in, weight and moments out) and then the copies are cast again: ~200 more kernels and 6
more bytes an element (~1.1 ms a BERT-large step on an H200, benchmarks/RESULTS.md). Here the update writes the
new weight's 16-bit value too, from the registers that hold it: 2 bytes an element and no launch of its own.

The math is torch's AdamW (decoupled weight decay, bias-corrected moments; ``torch.optim.AdamW``'s
documentation): for step t, with the learning rate ``lr`` and decay ``wd``::

    p <- p * (1 - lr * wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

One launch per parameter group and copy dtype (bf16, fp16, none): each program takes CHUNK elements of one
tensor, found through device tables of the tensors' element offsets from an anchor tensor and of the chunks'
(tensor, start). Offsets, not addresses cast to pointers (as Triton's grouped GEMM tutorial does): the compiler
knows nothing of a cast address's alignment and loads it one element at a time, which ran at 1.5 TB/s on an H200
(RESULTS.md); an offset marked a multiple of 16 bytes from an aligned anchor gets vector loads (2.6 TB/s there,
torch's fused AdamW 3.1: with copies to write this kernel wins, without them torch's runs, training/optim.py). The
step counts stay per tensor on the device (torch's fused layout, so state dicts are interchangeable), and
``found_inf`` (a device flag, the guard's or a grad scaler's) leaves weights, moments, copies and step counts as
they were without a host read. ``adamw_reference_`` is the same step in plain PyTorch.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from fastbert.ops._common import check_triton_device, fast_launch, tl, triton

CHUNK = 8192     # elements a program (4 blocks): the table lookups are paid once a chunk
BLOCK = 2048
WARPS = 4        # (chunk, block, warps) swept on an H200; loading the next block before this one's stores: slower
_COPY_TL = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@triton.jit
def _adamw_loads(P, G, M, V, offs, mask):
    return tl.load(P + offs, mask=mask), tl.load(G + offs, mask=mask), tl.load(M + offs, mask=mask), \
        tl.load(V + offs, mask=mask)


@triton.jit
def _adamw_update_store(P, M, V, C, offs, mask, p, g, m, v, beta1, beta2, one_minus_beta1, one_minus_beta2, eps,
                        keep, step_size, bc2_sqrt, COPY: tl.constexpr):
    """One block's update from its loaded values, and its stores (masked, or none when ``mask`` is None)."""
    p = p * keep
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(P + offs, p, mask=mask)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)
    if COPY != "":
        tl.store(C + offs, p.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _table_ptr(BASE, OFFS, row, n_tensors, t, ALIGN: tl.constexpr):
    """Tensor ``t``'s pointer in row ``row``: BASE plus its element offset from the table. ALIGN > 1: the offset
    is a multiple of ALIGN elements (16 bytes, as BASE), which lets the compiler vectorize (an address loaded
    and cast to a pointer carries no alignment it could use)."""
    off = tl.load(OFFS + row * n_tensors + t)
    if ALIGN > 1:
        off = tl.multiple_of(off, ALIGN)
    return BASE + off


@fast_launch
@triton.jit
def _adamw_kernel(F32, C16, OFFS, NUMELS, CHUNK_T, CHUNK_START, FOUND_INF, n_tensors, lr, beta1, beta2,
                  one_minus_beta1, one_minus_beta2, log2_beta1, log2_beta2, eps, decay, HAS_FOUND_INF: tl.constexpr,
                  COPY: tl.constexpr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """OFFS: (5 or 6, n_tensors) int64 element offsets from F32 (an fp32 anchor tensor) of the weights, gradients, first
    and second moments, step counts (one fp32 each), then from C16 (a 16-bit tensor) of the copies (COPY: "bf16"
    or "fp16", "" for none). The betas' complements and logarithms come from the host in double precision,
    rounded once. ALIGNED: every tensor but the step counts starts on 16 bytes; a chunk wholly inside its tensor
    then runs unmasked, with vector loads and stores, and a tensor's last chunk masked."""
    if HAS_FOUND_INF:
        if tl.load(FOUND_INF) != 0:
            return
    pid = tl.program_id(0)
    t = tl.load(CHUNK_T + pid)
    start = tl.multiple_of(tl.load(CHUNK_START + pid), CHUNK)
    n = tl.load(NUMELS + t)
    A32: tl.constexpr = 4 if ALIGNED else 1
    A16: tl.constexpr = 8 if ALIGNED else 1
    P = _table_ptr(F32, OFFS, 0, n_tensors, t, A32)
    G = _table_ptr(F32, OFFS, 1, n_tensors, t, A32)
    M = _table_ptr(F32, OFFS, 2, n_tensors, t, A32)
    V = _table_ptr(F32, OFFS, 3, n_tensors, t, A32)
    step = tl.load(_table_ptr(F32, OFFS, 4, n_tensors, t, 1))
    C = _table_ptr(C16, OFFS, 5, n_tensors, t, A16) if COPY != "" else C16
    bc1 = 1.0 - tl.exp2(step * log2_beta1)
    bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    step_size = lr / bc1
    keep = 1.0 - lr * decay
    if ALIGNED and start + CHUNK <= n:       # unmasked: vector loads and stores
        for i in tl.static_range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK)
            p, g, m, v = _adamw_loads(P, G, M, V, offs, None)
            _adamw_update_store(P, M, V, C, offs, None, p, g, m, v, beta1, beta2, one_minus_beta1, one_minus_beta2,
                                eps, keep, step_size, bc2_sqrt, COPY)
    else:
        for i in tl.static_range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK)
            p, g, m, v = _adamw_loads(P, G, M, V, offs, offs < n)
            _adamw_update_store(P, M, V, C, offs, offs < n, p, g, m, v, beta1, beta2, one_minus_beta1,
                                one_minus_beta2, eps, keep, step_size, bc2_sqrt, COPY)


_chunk_tables: dict = {}   # (device, numels, CHUNK) -> (numels, chunk tensor, chunk start) on the device


def _pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``t`` ready for a copy to ``device`` that the host does not wait for: pinned for a CUDA device (a
    copy from pageable memory waits for the stream, which is the optimizer step's)."""
    return t.pin_memory() if device.type == "cuda" else t


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return _pinned(t, device).to(device, non_blocking=True)


def _chunks(numels: tuple, device: torch.device):
    """Device tables for tensors of these sizes: each tensor's size, and every chunk's (tensor, start)."""
    key = (device, numels, CHUNK)
    hit = _chunk_tables.get(key)
    if hit is None:
        counts = [(n + CHUNK - 1) // CHUNK for n in numels]
        tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), torch.tensor(counts))
        first = torch.tensor([0] + counts[:-1], dtype=torch.int64).cumsum(0)
        start = (torch.arange(len(tensor), dtype=torch.int64) - first[tensor.long()]) * CHUNK
        hit = (_to_device(torch.tensor(numels, dtype=torch.int64), device), _to_device(tensor, device),
               _to_device(start, device))
        _chunk_tables[key] = hit
    return hit


_NOT_DENSE = "weights, gradients and moments must be contiguous fp32 tensors of one size on one device"


def _dense_fp32(params, row) -> bool:
    """Whether ``row``'s tensors are contiguous fp32 tensors of their weights' sizes on the first weight's device."""
    device = params[0].device
    return all(t.dtype == torch.float32 and t.device == device and t.is_contiguous() and t.numel() == p.numel()
               for p, t in zip(params, row))


def check_tensors(params, grads, exp_avgs, exp_avg_sqs, steps, copies) -> Optional[str]:
    """Why ``adamw_step_`` cannot take these tensors (one line), or None."""
    if not params:
        return "no tensors"
    device = params[0].device
    if not all(_dense_fp32(params, row) for row in (params, grads, exp_avgs, exp_avg_sqs)):
        return _NOT_DENSE
    if any(s.dtype != torch.float32 or s.device != device or s.numel() != 1 for s in steps):
        return "step counts must be one-element fp32 tensors on the weights' device"
    if any(c is not None and c.dtype not in _COPY_TL for c in copies):
        return "copies must be bf16 or fp16"
    if any(c is not None and (c.shape != p.shape or c.device != device or not c.is_contiguous())
           for p, c in zip(params, copies)):
        return "a copy must be a contiguous tensor of its weight's shape on its device"
    return None


_anchors: dict = {}   # (device, dtype) -> a small tensor of ours: the origin of the tables' offsets


def _anchor(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    t = _anchors.get((device, dtype))
    if t is None:
        t = _anchors[(device, dtype)] = torch.zeros(16, dtype=dtype, device=device)
    return t


def _offsets(tensors, anchor: torch.Tensor) -> list:
    """The tensors' element offsets from ``anchor``'s first element (same dtype)."""
    base, size = anchor.data_ptr(), anchor.element_size()
    return [(t.data_ptr() - base) // size for t in tensors]


def _aligned(tensors) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


class _Launch:
    """One kernel launch's device tables: the tensors' element offsets from an fp32 anchor (rows 0-4: weights,
    gradients, moments, step counts) and from a 16-bit one (row 5, the copies), the chunks, and whether every
    tensor but the step counts starts on 16 bytes. The gradients' row is rewritten when they move
    (:meth:`set_grads`)."""

    def __init__(self, rows: list, device: torch.device):
        self.f32 = _anchor(device, torch.float32)
        self.c16 = _anchor(device, rows[5][0].dtype) if len(rows) > 5 else self.f32
        self.fixed_aligned = all(_aligned(row) for r, row in enumerate(rows) if r not in (1, 4))
        self.aligned = self.fixed_aligned and _aligned(rows[1])
        offs = [_offsets(row, self.f32) for row in rows[:5]]
        if len(rows) > 5:
            offs.append(_offsets(rows[5], self.c16))
        self.table = _to_device(torch.tensor(offs, dtype=torch.int64), device)
        self.numels, self.chunk_t, self.chunk_start = _chunks(tuple(t.numel() for t in rows[0]), device)
        self.n = len(rows[0])
        self.copy = _COPY_TL[rows[5][0].dtype] if len(rows) > 5 else ""

    def set_grads(self, grads) -> None:
        host = torch.tensor(_offsets(grads, self.f32), dtype=torch.int64)
        self.table[1].copy_(_pinned(host, self.table.device), non_blocking=True)
        self.aligned = self.fixed_aligned and _aligned(grads)

    def __call__(self, found_inf, lr, beta1, beta2, eps, weight_decay):
        _adamw_kernel[(self.chunk_t.numel(),)](
            self.f32, self.c16, self.table, self.numels, self.chunk_t, self.chunk_start,
            found_inf if found_inf is not None else self.numels, self.n, float(lr), float(beta1), float(beta2),
            1.0 - beta1, 1.0 - beta2, math.log2(beta1), math.log2(beta2), float(eps), float(weight_decay),
            HAS_FOUND_INF=found_inf is not None, COPY=self.copy, ALIGNED=self.aligned, CHUNK=CHUNK, BLOCK=BLOCK,
            num_warps=WARPS)


class Plan:
    """``adamw_step_``'s launches for one set of tensors (``prepare``). An optimizer keeps its plan across steps
    (building one checks every tensor and fills device tables: ~2-3 ms of host time at BERT-base's 200 tensors,
    which a step that waits for its host pays in full): :meth:`matches` says whether the weights, moments, step
    counts and copies are still the ones it was built for (the same tensors at the same addresses), and
    :meth:`bind` takes each step's gradients, which are new tensors every step when they are set to None between
    steps (their rows of the tables are rewritten only when their addresses moved)."""

    def __init__(self, params, grads, exp_avgs, exp_avg_sqs, steps, copies):
        self.device = params[0].device
        self.steps = steps
        self.fixed = (params, exp_avgs, exp_avg_sqs, steps, copies)   # held: their ids stay theirs
        self.ids = self._ids(*self.fixed)
        self.param_ptrs = [p.data_ptr() for p in params]
        self.grad_ptrs = [g.data_ptr() for g in grads]
        groups: dict = {}       # copy dtype (None: no copy) -> the tensors' indices
        for i, c in enumerate(copies):
            groups.setdefault(c.dtype if c is not None else None, []).append(i)
        self.launches = []
        for dtype, idx in groups.items():
            rows = [[params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                    [exp_avg_sqs[i] for i in idx], [steps[i] for i in idx]]
            if dtype is not None:
                rows.append([copies[i] for i in idx])
            self.launches.append((idx, _Launch(rows, self.device)))

    @staticmethod
    def _ids(*rows) -> tuple:
        return tuple(tuple(map(id, row)) for row in rows)

    def matches(self, params, exp_avgs, exp_avg_sqs, steps, copies) -> bool:
        """Whether these are the tensors this plan was built for, the weights still at their addresses (a weight's
        ``.data`` may be replaced in place of the parameter, e.g. by ``module.to``)."""
        return self.holds(params) and self._ids(exp_avgs, exp_avg_sqs, steps, copies) == self.ids[1:]

    @property
    def copies(self) -> list:
        return self.fixed[4]

    def holds(self, params) -> bool:
        """Whether ``params`` are this plan's weights, still at their addresses: :meth:`matches` without the moments,
        step counts and copies, for a caller that knows those are unchanged (an optimizer whose state was not
        loaded, with the same copies: ``training.optim.AdamW``)."""
        return tuple(map(id, params)) == self.ids[0] and [p.data_ptr() for p in params] == self.param_ptrs

    def bind(self, grads) -> Optional[str]:
        """This step's gradients (one for each weight, in order), or why they cannot be taken. torch keeps a
        ``.grad``'s dtype, shape and device its parameter's; its layout may differ, so contiguity is checked
        every step."""
        ptrs = [g.data_ptr() for g in grads]
        if ptrs != self.grad_ptrs:
            if len(grads) != len(self.fixed[0]) or not _dense_fp32(self.fixed[0], grads):
                return _NOT_DENSE
            for idx, launch in self.launches:
                launch.set_grads([grads[i] for i in idx])
            self.grad_ptrs = ptrs
        elif not all(g.is_contiguous() for g in grads):
            return _NOT_DENSE
        return None

    def step(self, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
             found_inf: Optional[torch.Tensor] = None) -> None:
        if found_inf is None:
            torch._foreach_add_(self.steps, 1.0)
        else:
            found_inf = found_inf.reshape(()).to(device=self.device, dtype=torch.float32)
            # a list of tensors: with one tensor, _foreach_add_ reads its value on the host (a sync that stalled
            # the step until its backward had finished, benchmarks/RESULTS.md, twenty-sixth session)
            torch._foreach_add_(self.steps, [1.0 - found_inf] * len(self.steps))
        for _, launch in self.launches:
            launch(found_inf, lr, beta1, beta2, eps, weight_decay)


def prepare(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None):
    """A :class:`Plan` for these tensors, or the reason (one line) they cannot take this step."""
    copies = list(copies) if copies is not None else [None] * len(params)
    if not params:
        return "no tensors"
    rows = (params, grads, exp_avgs, exp_avg_sqs, steps, copies)
    reason = check_tensors(*rows)
    if reason is not None:
        return reason
    check_triton_device(params[0])
    return Plan(*rows)


def adamw_step_(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None, *, lr: float, beta1: float,
                beta2: float, eps: float, weight_decay: float, found_inf: Optional[torch.Tensor] = None) -> None:
    """One AdamW step over these tensors in place (Triton; CUDA, or the interpreter for CPU tensors): adds one
    to each step count, updates weights and moments and writes ``copies[i]`` (a 16-bit tensor of the weight's
    shape, or None) from the new weight. ``found_inf``: a device flag; nonzero leaves everything as it was."""
    if not params:
        return
    plan = prepare(params, grads, exp_avgs, exp_avg_sqs, steps, copies)
    if isinstance(plan, str):
        raise ValueError(f"adamw_step_: {plan}")
    plan.step(lr, beta1, beta2, eps, weight_decay, found_inf)


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
