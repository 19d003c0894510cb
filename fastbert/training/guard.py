"""Spike and NaN guard: skip optimizer steps whose loss or gradient norm is non-finite or spikes, and
ask for a rollback when bad steps repeat.

Per optimizer step, in the training loop::

    guard.add_micro_loss(loss)            # after each micro-batch's forward (device add, no sync)
    guard.check_loss(engine)              # before the LAST micro-batch's engine.step(): one all-reduce
    engine.step()                         # the guarded inner optimizer skips the update if told to
    verdict = guard.end_step(engine, data_step)

What is checked, with the same answer on every rank:

* the loss, averaged over micro-batches and ranks (one all-reduce): non-finite, or a spike;
* the global gradient norm before clipping, as DeepSpeed's ZeRO / bf16 / fp16 optimizers computed it
  (already reduced over ranks), or over the all-reduced ``.grad`` tensors (ZeRO-0 fp32): non-finite,
  or a spike.

A spike is a value above BOTH ``factor`` x the running median of the last ``window`` steps AND the
median plus ``noise_sigmas`` robust standard deviations (1.4826 x the median absolute deviation) of
that window: a series that is noisy by nature needs a bigger jump to count. Spike checks start once
``min_history`` steps are in the window and step ``warmup_steps`` is reached (the first steps move
fast by design). The gradient-norm factor is large (1000) on purpose: ten recorded healthy runs of the
demo config (tests/reliability/guard_traces.json) show single-step norm spikes of up to 107x the running
median (one seed; the others 1.4-27x), each recovered within two steps; gradient clipping already bounds
what such a step can do, and skipping leaves the model where the large gradients are, so the next steps
likely spike again (probably the skip / rollback cascades seen with a factor of 10); divergence shows in
the loss, and non-finite values are always caught.

A bad step is skipped by making the innermost torch optimizer's ``step`` a no-op for that step
(``install``): no parameter, moment or step-count update on any rank; DeepSpeed still clears the
gradients and counts the step, so the data position and the schedule move on. Steps DeepSpeed skips itself (fp16 overflow, or a non-finite
norm its ZeRO optimizer caught) are reported too; fp16 overflows are part of dynamic loss scaling
and never count towards a rollback. After ``rollback_after`` consecutive bad steps the verdict asks
for a rollback to the last good checkpoint (the loop then also moves past the offending data).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Optional

import torch

DEFAULTS = {
    "enabled": True,
    "window": 50,               # running median over the last N steps
    "min_history": 10,          # spike checks start after this many steps in the window ...
    "warmup_steps": 50,         # ... and from this optimizer step on
    "loss_factor": 3.0,         # loss > factor x median (and beyond its noise): spike (0 or null = off)
    "grad_norm_factor": 1000.0,  # grad norm > factor x median (and beyond its noise): spike (0 or null = off)
    "noise_sigmas": 8.0,        # a spike also exceeds median + this many robust standard deviations
    "rollback_after": 3,        # consecutive bad steps before rolling back to the last good checkpoint
    "max_rollbacks": 5,         # then stop with an error
    # Fault injection for tests and drills: on rank 0, at these (data) steps, multiply the loss by NaN
    # or by inject_spike_factor before backward.
    "inject_nan_steps": [],
    "inject_spike_steps": [],
    "inject_spike_factor": 100.0,
}


class GuardError(RuntimeError):
    """Training keeps diverging after the allowed rollbacks."""


@dataclass
class Verdict:
    """What happened to one optimizer step."""
    step: int                    # optimizer step index (0-based, == engine.global_steps before it)
    data_step: int               # position in the data stream (differs from step after a rollback)
    skipped: bool = False
    reason: Optional[str] = None           # nonfinite_loss | loss_spike | nonfinite_grad_norm | ...
    loss: Optional[float] = None
    loss_median: Optional[float] = None
    grad_norm: Optional[float] = None
    grad_norm_median: Optional[float] = None
    counts_as_failure: bool = False        # towards rollback (fp16 overflow does not)
    rollback: bool = False
    extra: dict = field(default_factory=dict)

    def record(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("extra", "step") and v is not None}
        out.update(self.extra)
        return out


def _finite(x: Optional[float]) -> bool:
    return x is not None and math.isfinite(x)


class SpikeGuard:
    def __init__(self, cfg: dict, rank: int = 0, device="cpu"):
        c = dict(DEFAULTS, **(cfg or {}))
        unknown = set(cfg or {}) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"unknown guard settings {sorted(unknown)}; known: {sorted(DEFAULTS)}")
        self.enabled = bool(c["enabled"])
        self.window = int(c["window"])
        self.min_history = int(c["min_history"])
        self.warmup_steps = int(c["warmup_steps"])
        self.noise_sigmas = float(c["noise_sigmas"])
        self.loss_factor = float(c["loss_factor"] or 0.0)
        self.grad_norm_factor = float(c["grad_norm_factor"] or 0.0)
        self.rollback_after = int(c["rollback_after"])
        self.max_rollbacks = int(c["max_rollbacks"])
        self.inject_nan = set(int(s) for s in c["inject_nan_steps"])
        self.inject_spike = set(int(s) for s in c["inject_spike_steps"])
        self.spike_factor = float(c["inject_spike_factor"])
        if self.window < 1 or self.min_history < 1 or self.min_history > self.window:
            raise ValueError("guard: need 1 <= min_history <= window")
        if self.warmup_steps < 0 or self.noise_sigmas < 0:
            raise ValueError("guard: warmup_steps and noise_sigmas must be >= 0")
        if self.rollback_after < 1 or self.max_rollbacks < 0:
            raise ValueError("guard: rollback_after must be >= 1 and max_rollbacks >= 0")
        self.rank, self.device = rank, device
        self.losses: deque = deque(maxlen=self.window)
        self.norms: deque = deque(maxlen=self.window)
        self.consecutive_bad = 0
        self.rollbacks = 0
        self.skipped_total = 0
        self.steps_seen = 0         # optimizer steps checked (spike checks wait for warmup_steps)
        self._reset_step()

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "norms": list(self.norms), "rollbacks": self.rollbacks,
                "skipped_total": self.skipped_total, "steps_seen": self.steps_seen}

    def load_state_dict(self, state: dict) -> None:
        self.losses.extend(state.get("losses", []))
        self.norms.extend(state.get("norms", []))
        self.rollbacks = int(state.get("rollbacks", 0))
        self.skipped_total = int(state.get("skipped_total", 0))
        self.steps_seen = int(state.get("steps_seen", len(self.losses)))

    @property
    def healthy(self) -> bool:
        """No bad step since the last good one (checkpoints written now are 'good')."""
        return self.consecutive_bad == 0

    def _reset_step(self) -> None:
        self._loss_sum: Optional[torch.Tensor] = None
        self._micro = 0
        self._skip_reason: Optional[str] = None
        self._loss: Optional[float] = None
        self._norm: Optional[float] = None
        self._norm_from_hook = False
        self._hook_decided = False

    # ------------------------------------------------------------------------------ injection
    def inject(self, loss: torch.Tensor, data_step: int) -> torch.Tensor:
        """The loss to backpropagate: faulted on rank 0 at the configured steps (tests, drills)."""
        if self.rank != 0:
            return loss
        if data_step in self.inject_nan:
            return loss * float("nan")
        if data_step in self.inject_spike:
            return loss * self.spike_factor
        return loss

    # ------------------------------------------------------------------------------ per step
    def add_micro_loss(self, loss: torch.Tensor) -> None:
        if not self.enabled:
            return
        v = loss.detach().double()
        self._loss_sum = v if self._loss_sum is None else self._loss_sum + v
        self._micro += 1

    def check_loss(self, engine) -> None:
        """Collective (all ranks, before the boundary ``engine.step()``): agree on this step's loss and,
        on ZeRO-0 fp32, compute the gradient norm from the reduced ``.grad`` tensors."""
        if not self.enabled:
            return
        import torch.distributed as dist
        total = self._loss_sum if self._loss_sum is not None else torch.zeros((), dtype=torch.float64)
        t = torch.stack([total.to(self.device, torch.float64).reshape(()),
                         torch.tensor(float(self._micro), dtype=torch.float64, device=self.device)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        norm = None
        if _wrapper_of(engine.ds.optimizer) is None:       # ZeRO-0: no DeepSpeed norm to read
            # The reduced gradients are final here: the engine clips now (one fused norm) and the norm
            # comes back in the same transfer as the loss (one device sync per step).
            norm = engine.clip_gradients() if getattr(engine, "clipping", 0) else _grad_norm_tensor(engine.module)
        if norm is not None:
            t = torch.cat([t, norm.to(t.device, torch.float64).reshape(1)])
        values = t.tolist()
        loss_sum, micros = values[:2]
        if norm is not None:
            self._norm = values[2]
        self._loss = loss_sum / max(1.0, micros)
        if not math.isfinite(self._loss):
            self._skip_reason = "nonfinite_loss"
        elif self._spike(self._loss, self.losses, self.loss_factor):
            self._skip_reason = "loss_spike"

    def _spike(self, value: float, history: deque, factor: float) -> bool:
        return value > self.threshold(history, factor)

    def threshold(self, history, factor: float) -> float:
        """The spike threshold of a series: above factor x median and median + noise_sigmas x robust std
        (inf while the checks wait for history or warm-up, or when ``factor`` is off)."""
        if not factor or len(history) < self.min_history or self.steps_seen < self.warmup_steps:
            return math.inf
        mid = median(history)
        robust_std = 1.4826 * median(abs(x - mid) for x in history)
        return max(factor * mid, mid + self.noise_sigmas * robust_std)

    def decide_in_optimizer(self, wrapper) -> bool:
        """Called by the guarded inner optimizer (once or per param group): True = skip the update."""
        if not self.enabled:
            return False
        if not self._hook_decided:
            self._hook_decided = True
            if wrapper is not None:
                norm = getattr(wrapper, "_global_grad_norm", None)
                if norm is not None:
                    self._norm = float(norm.item() if torch.is_tensor(norm) else norm)
                    self._norm_from_hook = True
            if self._skip_reason is None and self._norm is not None:
                if not math.isfinite(self._norm):
                    self._skip_reason = "nonfinite_grad_norm"
                elif self._spike(self._norm, self.norms, self.grad_norm_factor):
                    self._skip_reason = "grad_norm_spike"
        return self._skip_reason is not None

    def end_step(self, engine, step: int, data_step: int) -> Optional[Verdict]:
        """After the boundary ``engine.step()``: the verdict for a bad step (None for a good one)."""
        if not self.enabled:
            return None
        v = Verdict(step=step, data_step=data_step, loss=self._loss, grad_norm=self._norm)
        if self.losses:
            v.loss_median = median(self.losses)
        if self.norms:
            v.grad_norm_median = median(self.norms)
        if self._skip_reason is not None and not self._hook_decided:
            # The check said skip but the inner optimizer was never reached: DeepSpeed skipped the
            # step itself (overflow), which is just as good.
            v.extra["skipped_by"] = "deepspeed"
        if self._skip_reason is None and not engine.step_was_applied():
            self._skip_reason = "fp16_overflow" if engine.precision == "fp16" else "nonfinite_grad_norm"
            v.extra["skipped_by"] = "deepspeed"
            if engine.loss_scale is not None:
                v.extra["loss_scale"] = engine.loss_scale
        # Histories take every finite value (the median shrugs off single spikes and follows a
        # genuine level shift after window/2 steps instead of skipping forever).
        if _finite(self._loss):
            self.losses.append(self._loss)
        if _finite(self._norm):
            self.norms.append(self._norm)
        reason = self._skip_reason
        self._reset_step()
        self.steps_seen += 1
        if reason is None:
            self.consecutive_bad = 0
            return None
        v.skipped, v.reason = True, reason
        self.skipped_total += 1
        v.counts_as_failure = reason != "fp16_overflow"
        if v.counts_as_failure:
            self.consecutive_bad += 1
            v.extra["consecutive_bad"] = self.consecutive_bad
            if self.consecutive_bad >= self.rollback_after:
                if self.rollbacks >= self.max_rollbacks:
                    raise GuardError(
                        f"training keeps diverging: {self.consecutive_bad} bad steps in a row at step {step} "
                        f"(last: {reason}, loss {self._fmt(v.loss)}, grad norm {self._fmt(v.grad_norm)}) after "
                        f"{self.rollbacks} rollback(s); lower the learning rate, check the data near stream "
                        f"position {data_step}, or raise guard.max_rollbacks / guard.loss_factor")
                v.rollback = True
        return v

    def rolled_back(self) -> None:
        self.rollbacks += 1
        self.consecutive_bad = 0

    @staticmethod
    def _fmt(x) -> str:
        return "n/a" if x is None else f"{x:.4g}"

    def describe(self, v: Verdict) -> str:
        what = {"nonfinite_loss": "non-finite loss", "loss_spike": "loss spike",
                "nonfinite_grad_norm": "non-finite gradient norm", "grad_norm_spike": "gradient-norm spike",
                "fp16_overflow": "fp16 overflow"}.get(v.reason, v.reason)
        text = (f"[guard] step {v.step + 1}: {what}, update skipped (loss {self._fmt(v.loss)}, median "
                f"{self._fmt(v.loss_median)}; grad norm {self._fmt(v.grad_norm)}, median "
                f"{self._fmt(v.grad_norm_median)})")
        if v.rollback:
            text += f"; {self.consecutive_bad} bad steps in a row: rolling back to the last good checkpoint"
        return text


# ---------------------------------------------------------------------------------- optimizer hook
def _wrapper_of(ds_optimizer):
    """DeepSpeed's wrapper (ZeRO / bf16 / fp16 optimizer) around the torch optimizer, or None when the
    engine drives the torch optimizer directly (ZeRO-0 fp32)."""
    return None if isinstance(ds_optimizer, torch.optim.Optimizer) else ds_optimizer


def _innermost(ds_optimizer) -> torch.optim.Optimizer:
    opt = ds_optimizer
    while not isinstance(opt, torch.optim.Optimizer) or isinstance(getattr(opt, "optimizer", None),
                                                                    torch.optim.Optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None or inner is opt:
            break
        opt = inner
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"cannot find the torch optimizer inside {type(ds_optimizer).__name__}")
    return opt


def _grad_norm_tensor(module: torch.nn.Module) -> Optional[torch.Tensor]:
    """The global 2-norm of the ``.grad`` tensors, on the device (fused per-tensor norms)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return None
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm([g.float() for g in grads])))


def install(engine, guard: SpikeGuard) -> None:
    """Make the innermost torch optimizer's ``step`` consult ``guard`` (an instance attribute, so the
    class and other optimizers are untouched)."""
    wrapper = _wrapper_of(engine.ds.optimizer)
    inner = _innermost(engine.ds.optimizer)
    original = inner.step

    def guarded_step(*args, **kwargs):
        if guard.decide_in_optimizer(wrapper):
            return None
        return original(*args, **kwargs)

    inner.step = guarded_step
