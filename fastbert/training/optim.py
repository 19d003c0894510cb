"""Optimizers: which implementation runs where, weight-decay groups, and a plain-PyTorch LAMB.

Choice (``OptimizerSpec.type``, ``optim_spec.py``: ``"adamw"`` or ``"lamb"``):

* CUDA, no offload: AdamW is :class:`AdamW` below (torch's ``AdamW(fused=True)`` whose step is one Triton
  launch a parameter group that also writes the weights' 16-bit copies, ``ops/adamw.py``) handed to DeepSpeed as
  a client optimizer (no DeepSpeed op to compile on the first run); Adam is torch's fused one; LAMB is DeepSpeed's
  ``FusedLamb`` through the DeepSpeed config, or apex's ``FusedLAMB`` when apex is importable.
* CUDA with ZeRO CPU offload: DeepSpeed builds ``DeepSpeedCPUAdam`` from the same config entry.
* CPU: ``torch.optim.AdamW`` (foreach) or ``TorchLamb`` below.

LAMB's trust ratio is per parameter TENSOR; ZeRO stages >= 1 hand the optimizer flat partitions that
cut across tensors, so LAMB there would silently compute the wrong ratio: refused with a clear error.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from fastbert.ops import adamw
from fastbert.ops._common import INTERPRET, HAS_TRITON
from fastbert.training.optim_spec import OptimizerSpec

NO_DECAY_MARKERS = ("bias", "LayerNorm", "layer_norm", "layernorm", "norm.weight", "ln_")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: weights with decay; biases and LayerNorm parameters without (BERT's recipe)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or any(m in name for m in NO_DECAY_MARKERS) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def apex_lamb_available() -> bool:
    try:
        from apex.optimizers import FusedLAMB  # noqa: F401
        return True
    except Exception:  # apex import can fail with more than ImportError when built for another torch
        return False


def build_client_optimizer(spec: OptimizerSpec, groups: list[dict], device_type: str, offload: bool = False):
    """A torch-side optimizer instance; None = let DeepSpeed build it (LAMB, or CPU offload's CPUAdam)."""
    if device_type == "cuda":
        if spec.type == "lamb" and apex_lamb_available():
            from apex.optimizers import FusedLAMB
            return FusedLAMB(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
        if spec.type == "adamw" and not offload and not spec.extra:
            return AdamW(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
        if spec.type == "adam" and not offload and not spec.extra:
            return torch.optim.Adam(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                    weight_decay=spec.weight_decay, fused=True)
        return None
    if spec.type in ("adamw", "adam"):
        cls = torch.optim.AdamW if spec.type == "adamw" else torch.optim.Adam
        return cls(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
                   foreach=True)
    return TorchLamb(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)


def _closure_loss(closure):
    """What ``step(closure)`` returns: the closure's loss, computed with gradients on (None without one)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW(fused=True)`` whose step, while it has copies to write (``weight_casts``: the 16-bit
    copies of the weights ``TrainEngine`` keeps), is ``ops.adamw.adamw_step_`` over fp32 weights with dense fp32
    gradients on CUDA (or the Triton interpreter): one launch a parameter group that also writes each weight's
    copy, so the next forward need not cast them again. Same state (per-tensor device step counts,
    ``exp_avg``, ``exp_avg_sq``) and state dicts as torch's; ``found_inf`` (the guard's verdict, a grad
    scaler's) is honoured on the device. Anything else runs torch's fused step: no copies to write (fp32
    training, ZeRO-1/2's flat partitions, ``FASTBERT_WEIGHT_CASTS=0``), where torch's kernel is faster (3.06 vs 3.65 ms a BERT-large
    step on an H200; with the copies 3.64 ms against torch's 3.74 + the casts), other dtypes, sparse gradients,
    amsgrad, maximize, a grad scaler's ``grad_scale``, tensor learning rates."""

    def __init__(self, params: Iterable, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
        self.weight_casts = None   # a WeightCasts whose copies this step writes (TrainEngine sets it)
        # group index -> (the ops.adamw Plan of its last step, the WeightCasts and its generation it was made with)
        self._kernel_plans: dict = {}

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._kernel_plans.clear()      # new moments and step counts: the plans' tables point at the old ones

    def _plans(self) -> Optional[list]:
        """Per group with gradients, (group, its parameters with gradients, their copies, the kernel's plan), or
        None where torch's step must run (for every group: nothing is updated before this is known).

        A group whose weights (same tensors, same addresses) and copies (``weight_casts.generation``) are its
        plan's takes that plan at once: its moments and step counts can only change by a state dict loaded, which
        drops the plans. Fine-tuning's short steps wait for the host: checking every tensor and looking up the
        copies every step cost ~1 ms of host time at BERT-base's four groups (this project's CPU)."""
        casts = self.weight_casts
        if casts is None or not HAS_TRITON or getattr(self, "grad_scale", None) is not None:
            return None
        plans = []
        for index, group in enumerate(self.param_groups):
            if group["amsgrad"] or group["maximize"] or group["differentiable"] or torch.is_tensor(group["lr"]):
                return None
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if not (params[0].is_cuda or INTERPRET) or any(p.grad.is_sparse for p in params):
                return None
            plan, made_with = self._kernel_plans.get(index, (None, None))
            if made_with == (casts, casts.generation) and plan.holds(params) and \
                    plan.bind([p.grad for p in params]) is None:
                plans.append((group, params, plan.copies, plan))
                continue
            for p in params:
                state = self.state[p]
                if not state:    # torch's fused layout
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            states = [self.state[p] for p in params]
            copies = casts.copies_of(params)
            grads = [p.grad for p in params]
            fixed = (params, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                     [s["step"] for s in states], copies)
            # A kept plan takes this step's gradients; another set of tensors (a parameter without a gradient
            # this step, new copies) gets a new plan.
            if plan is None or not plan.matches(*fixed) or plan.bind(grads) is not None:
                plan = adamw.prepare(fixed[0], grads, *fixed[1:])
                if isinstance(plan, str):
                    self._kernel_plans.pop(index, None)
                    return None
            self._kernel_plans[index] = (plan, (casts, casts.generation))
            plans.append((group, params, copies, plan))
        if plans and all(c is None for _, _, copies, _ in plans for c in copies):
            return None          # nothing to write (fp32 training): torch's kernel is faster
        return plans

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        plans = self._plans()
        if plans is None:
            super().step()
            return loss
        for group, params, copies, plan in plans:
            beta1, beta2 = group["betas"]
            plan.step(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], getattr(self, "found_inf", None))
            self.weight_casts.written([p for p, c in zip(params, copies) if c is not None])
        return loss


class TorchLamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020, Algorithm 2) in plain PyTorch: Adam direction with decoupled weight
    decay, scaled per tensor by the trust ratio ``||w|| / ||update||`` (1 where either norm is 0).
    Bias correction as in NVIDIA's / DeepSpeed's implementations."""

    def __init__(self, params: Iterable, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 max_trust_ratio: float = 10.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      max_trust_ratio=max_trust_ratio))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                dtype = torch.promote_types(p.dtype, torch.float32)   # fp32 maths for 16-bit params
                g = p.grad.to(dtype)
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                m_hat = m / (1 - b1 ** state["step"])
                v_hat = v / (1 - b2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"])
                w = p.to(dtype)
                if group["weight_decay"]:
                    update = update + group["weight_decay"] * w
                w_norm, u_norm = w.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0),
                                    (w_norm / u_norm).clamp(max=group["max_trust_ratio"]),
                                    torch.ones_like(w_norm))
                p.add_((update * trust * -group["lr"]).to(p.dtype))
        return loss
