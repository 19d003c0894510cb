"""Spike and NaN guard: skip optimizer steps whose loss or gradient norm is non-finite or spikes, and
ask for a rollback when bad steps repeat.

Per optimizer step, in the training loop::

    guard.add_micro_loss(loss)            # after each micro-batch's forward (device add, no sync)
    guard.check_loss(engine)              # before the LAST micro-batch's engine.step(): one all-reduce
    engine.step()                         # the guarded inner optimizer skips the update if told to
    for verdict in guard.end_step(engine, step, data_step, settle=...):   # bad steps, maybe a step late
        ...

What is checked, with the same answer on every rank:

* the loss, averaged over micro-batches and ranks (one all-reduce): non-finite, or a spike;
* the global gradient norm before clipping, as DeepSpeed's ZeRO / bf16 / fp16 optimizers computed it
  (already reduced over ranks), or over the all-reduced ``.grad`` tensors (ZeRO-0): non-finite, or a spike.

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

The verdict is computed on the device (the histories live there as NaN-padded windows) and reaches the
optimizer without a device-to-host read: when the innermost torch optimizer takes ``found_inf`` (torch's
fused Adam/AdamW, the default on CUDA), it is handed the verdict as ``found_inf``, and the fused kernel
leaves parameters, moments and the step count untouched on a bad step. Other optimizers (CPU foreach
AdamW, LAMB) and DeepSpeed's ZeRO / fp16 wrappers (which read their norm on the host anyway) read the
verdict in their ``step`` and return without updating. Either way DeepSpeed still clears the gradients
and counts the step, so the data position and the schedule move on.

The host learns each verdict one step late (``end_step`` copies it to pinned memory and reads the previous
step's, which the GPU has finished by then), or at once with ``settle=True``: the loop settles at log,
evaluation and checkpoint steps, and ``flush`` before it stops, so a checkpoint is only called good when
every step before it is known. Steps DeepSpeed skips itself (fp16 overflow, or a non-finite norm its ZeRO
optimizer caught) are reported too; fp16 overflows are part of dynamic loss scaling and never count
towards a rollback. After ``rollback_after`` consecutive bad steps the verdict asks for a rollback to the
last good checkpoint (the loop then also moves past the offending data); a step taken after the last bad
one, before its verdict was read, is rolled back with it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from fastbert.training.host_copy import HostCopy

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


REASONS = (None, "nonfinite_loss", "loss_spike", "nonfinite_grad_norm", "grad_norm_spike")  # device codes


def _median(rows: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Per row, statistics.median of its ``n`` non-NaN values (NaN sorts last; NaN when n == 0)."""
    s = torch.sort(rows, dim=-1).values
    middle = torch.stack([(n - 1) // 2, n // 2], dim=-1).clamp(0, rows.shape[-1] - 1)  # gather: s[t] reads t back
    return s.gather(-1, middle).mean(-1)


def _window_stats(history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per history row, on the device: how many values it holds, their median, and their median
    absolute deviation."""
    n = (~torch.isnan(history)).sum(-1)
    mid = _median(history, n)
    return n, mid, _median((history - mid[..., None]).abs(), n)


@dataclass
class _Pending:
    """One step's verdict on its way to the host: the device values copied to pinned memory, and what the
    host already knew."""
    step: int
    data_step: int
    values: HostCopy              # [code, loss, loss median, grad norm, grad norm median] (float64)
    has_loss: bool
    has_norm: bool
    hook_decided: bool
    applied: bool
    fp16: bool
    loss_scale: Optional[float]


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
        self.rank, self.device = rank, torch.device(device)
        # The last `window` finite losses (row 0) and gradient norms (row 1), oldest first, NaN-padded.
        self._history = torch.full((2, self.window), math.nan, dtype=torch.float64, device=self.device)
        self.consecutive_bad = 0
        self.rollbacks = 0
        self.skipped_total = 0
        self.steps_seen = 0         # optimizer steps checked (spike checks wait for warmup_steps)
        self.last_ok: Optional[torch.Tensor] = None   # 1.0 / 0.0 on the device: was the last step applied
        self._pending: Optional[_Pending] = None
        self._reset_step()

    # ------------------------------------------------------------------------------ state
    def _series(self, row: int) -> list[float]:
        return [x for x in self._history[row].tolist() if not math.isnan(x)]

    @property
    def losses(self) -> list[float]:
        return self._series(0)

    @property
    def norms(self) -> list[float]:
        return self._series(1)

    def state_dict(self) -> dict:
        return {"losses": self.losses, "norms": self.norms, "rollbacks": self.rollbacks,
                "skipped_total": self.skipped_total, "steps_seen": self.steps_seen}

    def load_state_dict(self, state: dict) -> None:
        for row, key in enumerate(("losses", "norms")):
            values = (self._series(row) + [float(x) for x in state.get(key, [])])[-self.window:]
            self._history[row].fill_(math.nan)
            if values:
                self._history[row, self.window - len(values):] = torch.tensor(values, dtype=torch.float64)
        self.rollbacks = int(state.get("rollbacks", 0))
        self.skipped_total = int(state.get("skipped_total", 0))
        self.steps_seen = int(state.get("steps_seen", len(state.get("losses", []))))

    @property
    def healthy(self) -> bool:
        """No bad step since the last good one, as far as the host knows (settle first: checkpoints written
        now are 'good')."""
        return self.consecutive_bad == 0

    def _reset_step(self) -> None:
        self._loss_sum: Optional[torch.Tensor] = None
        self._micro = 0
        self._loss_t: Optional[torch.Tensor] = None      # this step's loss, on the device
        self._norm_t: Optional[torch.Tensor] = None      # this step's gradient norm, on the device
        self._code: Optional[torch.Tensor] = None        # this step's verdict (index into REASONS)
        self._stats: Optional[tuple] = None              # _window_stats of the history this step is judged on
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
        on ZeRO-0, compute the gradient norm from the reduced ``.grad`` tensors; the verdict stays on the
        device."""
        if not self.enabled:
            return
        import torch.distributed as dist
        total = self._loss_sum if self._loss_sum is not None else torch.zeros((), dtype=torch.float64)
        t = torch.stack([total.to(self.device, torch.float64).reshape(()),
                         torch.full((), float(self._micro), dtype=torch.float64, device=self.device)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        self._loss_t = t[0] / t[1].clamp(min=1.0)
        if _wrapper_of(engine.ds.optimizer) is None:       # ZeRO-0: no DeepSpeed norm to read
            # The reduced gradients are final here: the engine clips now (one fused norm).
            norm = engine.clip_gradients() if getattr(engine, "clipping", 0) else _grad_norm_tensor(engine.module)
            self._norm_t = None if norm is None else norm.detach().to(torch.float64).reshape(())
        self._stats = _window_stats(self._history)
        self._code = self._verdict()

    def _check(self, value: torch.Tensor, row: int, factor: float, nonfinite: int) -> torch.Tensor:
        """0, ``nonfinite`` or ``nonfinite + 1`` (spike) for one value against its history row."""
        spike = self.threshold(row, factor, self._stats) if factor and self.steps_seen >= self.warmup_steps else None
        bad = torch.where(value > spike, nonfinite + 1, 0) if spike is not None else torch.zeros_like(value)
        return torch.where(torch.isfinite(value), bad, nonfinite).to(torch.int64)

    def _verdict(self) -> torch.Tensor:
        code = self._check(self._loss_t, 0, self.loss_factor, 1)
        if self._norm_t is not None:
            code = torch.where(code > 0, code, self._check(self._norm_t, 1, self.grad_norm_factor, 3))
        return code

    def threshold(self, row: int, factor: float, stats: Optional[tuple] = None) -> torch.Tensor:
        """The spike threshold of history ``row`` (0 loss, 1 grad norm), on the device: above factor x
        median and median + noise_sigmas x robust std; inf while the window holds fewer than
        ``min_history`` values. ``stats``: the history's ``_window_stats`` when already computed."""
        n, mid, mad = (stats or _window_stats(self._history))
        limit = torch.maximum(factor * mid[row], mid[row] + self.noise_sigmas * 1.4826 * mad[row])
        return torch.where(n[row] >= self.min_history, limit, math.inf)

    def decide_in_optimizer(self, wrapper, inner: Optional[torch.optim.Optimizer] = None) -> bool:
        """Called by the guarded inner optimizer (once or per param group): True = skip the update now.
        When ``inner`` takes ``found_inf`` the verdict goes to it on the device instead (returns False)."""
        if not self.enabled:
            return False
        if not self._hook_decided:
            self._hook_decided = True
            norm = getattr(wrapper, "_global_grad_norm", None) if wrapper is not None else None
            if norm is not None:
                self._norm_t = torch.as_tensor(norm, dtype=torch.float64).to(self.device).reshape(())
                if self._code is not None:
                    self._code = self._verdict()
        if self._code is None:
            return False
        if inner is not None and getattr(inner, "_step_supports_amp_scaling", False):
            inner.found_inf = (self._code > 0).float()
            return False
        return bool(self._code > 0)

    def end_step(self, engine, step: int, data_step: int, settle: bool = True) -> list:
        """After the boundary ``engine.step()``: the verdicts of bad steps the host can now see, oldest
        first. This step's verdict is read now with ``settle``, else at the next call (one step late, no
        wait on the device). A rollback verdict drops the steps after it."""
        if not self.enabled:
            return []
        applied = engine.step_was_applied()
        code = self._code if self._code is not None else torch.zeros((), dtype=torch.int64, device=self.device)
        nan = torch.full((), math.nan, dtype=torch.float64, device=self.device)
        loss = self._loss_t if self._loss_t is not None else nan
        norm = self._norm_t if self._norm_t is not None else nan
        medians = (self._stats or _window_stats(self._history))[1]     # of the history before this step
        values = torch.stack([code.double(), loss, medians[0], norm, medians[1]])
        ok = (code == 0).double() if applied else torch.zeros((), dtype=torch.float64, device=self.device)
        self.last_ok = ok
        # Histories take every finite value (the median shrugs off single spikes and follows a
        # genuine level shift after window/2 steps instead of skipping forever).
        for row, v in ((0, loss), (1, norm)):
            self._history[row] = torch.where(torch.isfinite(v), torch.cat([self._history[row, 1:], v.reshape(1)]),
                                             self._history[row])
        record = _Pending(step, data_step, HostCopy(values), self._loss_t is not None, self._norm_t is not None,
                          self._hook_decided, applied, engine.precision == "fp16",
                          engine.loss_scale if not applied else None)
        self._reset_step()
        self.steps_seen += 1
        ready = [self._pending] if self._pending is not None else []
        self._pending = record
        if settle:
            ready.append(record)
            self._pending = None
        return self._resolve(ready)

    def flush(self) -> list:
        """Read the verdict still on its way (before stopping, or anything that needs the host's view)."""
        ready = [self._pending] if self._pending is not None else []
        self._pending = None
        return self._resolve(ready)

    def _resolve(self, records: list) -> list:
        out = []
        for rec in records:
            verdict = self._judge(rec)
            if verdict is not None:
                out.append(verdict)
                if verdict.rollback:
                    self._pending = None       # rolled back with it
                    break
        return out

    def _judge(self, rec: _Pending) -> Optional[Verdict]:
        code, loss, loss_median, norm, norm_median = rec.values.wait().tolist()
        known = lambda x: None if math.isnan(x) else x  # noqa: E731  (a median of no history)
        v = Verdict(step=rec.step, data_step=rec.data_step, loss=loss if rec.has_loss else None,
                    loss_median=known(loss_median), grad_norm=norm if rec.has_norm else None,
                    grad_norm_median=known(norm_median))
        reason = REASONS[int(code)]
        if reason is not None and not rec.hook_decided:
            # The check said skip but the inner optimizer was never reached: DeepSpeed skipped the
            # step itself (overflow), which is just as good.
            v.extra["skipped_by"] = "deepspeed"
        if reason is None and not rec.applied:
            reason = "fp16_overflow" if rec.fp16 else "nonfinite_grad_norm"
            v.extra["skipped_by"] = "deepspeed"
            if rec.loss_scale is not None:
                v.extra["loss_scale"] = rec.loss_scale
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
                        f"training keeps diverging: {self.consecutive_bad} bad steps in a row at step {rec.step} "
                        f"(last: {reason}, loss {self._fmt(v.loss)}, grad norm {self._fmt(v.grad_norm)}) after "
                        f"{self.rollbacks} rollback(s); lower the learning rate, check the data near stream "
                        f"position {rec.data_step}, or raise guard.max_rollbacks / guard.loss_factor")
                v.rollback = True
        return v

    def rolled_back(self) -> None:
        self.rollbacks += 1
        self.consecutive_bad = 0
        self._pending = None

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
        if guard.decide_in_optimizer(wrapper, inner):
            return None
        try:
            return original(*args, **kwargs)
        finally:
            inner.__dict__.pop("found_inf", None)

    inner.step = guarded_step
