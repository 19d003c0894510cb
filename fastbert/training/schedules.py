"""Learning-rate schedules over a step budget or a WALL-CLOCK budget, and the clocks they read.

Both schedules map training progress ``p`` in [0, 1] to a multiplier of the peak learning rate:
linear warmup over the first ``warmup`` fraction, then linear decay to 0 at ``p = 1`` (the
academic-budget recipe: warmup 6% of the time budget, decay to 0 when it runs out).

* ``StepSchedule``: ``p = (step + 0.5) / total_steps`` (midpoint, so neither the first nor the last
  optimizer step gets a learning rate of exactly 0).
* ``TimeBudgetSchedule``: ``p = elapsed / budget`` where ``elapsed`` is the training time so far,
  agreed across ranks by an all-reduce (MAX) at every optimizer step so every rank uses the SAME
  learning rate and stops at the same step, and carried over a resume through ``state_dict``.

Both have one interface, which the training loop uses without asking which one it has::

    schedule.start()                  # once, when all ranks are ready (after any resume)
    lr = schedule.tick(step)          # once per optimizer step, just before it
    if schedule.done(step): stop      # the budget is used up (a time budget also stops at max_steps)
    schedule.info(), schedule.eta(done_steps, seconds_per_step), schedule.spent(step)

The clock is injectable: ``MonotonicClock`` in real runs; ``FakeClock`` in tests (advances a fixed
tick per reading, optionally faster on higher ranks to exercise the cross-rank agreement).
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional


# ---------------------------------------------------------------------------------------- clocks
class MonotonicClock:
    """Seconds from ``time.monotonic`` (never jumps with NTP or DST)."""

    def __call__(self) -> float:
        return time.monotonic()


class FakeClock:
    """Deterministic clock for tests: every reading advances by ``tick * (1 + skew * rank)`` seconds."""

    def __init__(self, tick: float, skew: float = 0.0, rank: int = 0):
        if tick <= 0:
            raise ValueError(f"FakeClock tick must be > 0, got {tick}")
        self.step = tick * (1.0 + skew * rank)
        self.now = 0.0

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def make_clock(spec: str, rank: int = 0) -> Callable[[], float]:
    """``"monotonic"`` (default) or ``"fake:TICK[:SKEW]"`` (tests only)."""
    if spec in (None, "", "monotonic"):
        return MonotonicClock()
    if spec.startswith("fake:"):
        parts = spec.split(":")[1:]
        try:
            tick = float(parts[0])
            skew = float(parts[1]) if len(parts) > 1 else 0.0
        except (IndexError, ValueError):
            raise ValueError(f"clock {spec!r} is not valid; use 'monotonic' or 'fake:TICK[:SKEW]'") from None
        return FakeClock(tick, skew, rank)
    raise ValueError(f"clock {spec!r} is not known; use 'monotonic' or 'fake:TICK[:SKEW]'")


def parse_duration(value) -> float:
    """Seconds from a number or a string like ``"90s"``, ``"5m"``, ``"24h"``, ``"1h30m"``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"duration {value!r} is not valid; use seconds or e.g. '90s', '5m', '24h', '1h30m'")
    import re
    text = value.strip().lower()
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([smhd]?)", text)
    if not parts or re.sub(r"(\d+(?:\.\d+)?)\s*([smhd]?)", "", text).strip():
        raise ValueError(f"duration {value!r} is not valid; use seconds or e.g. '90s', '5m', '24h', '1h30m'")
    unit = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
    return sum(float(n) * unit[u] for n, u in parts)


# ---------------------------------------------------------------------------------------- shape
def warmup_linear_decay(progress: float, warmup: float) -> float:
    """Multiplier in [0, 1]: ``p / warmup`` during warmup, then linear decay to 0 at ``p = 1``."""
    p = min(max(progress, 0.0), 1.0)
    if warmup > 0 and p < warmup:
        return p / warmup
    if warmup >= 1.0:
        return 1.0
    return max(0.0, (1.0 - p) / (1.0 - warmup))


def warmup_constant(progress: float, warmup: float) -> float:
    p = min(max(progress, 0.0), 1.0)
    return p / warmup if warmup > 0 and p < warmup else 1.0


SHAPES = {"linear": warmup_linear_decay, "constant": warmup_constant}


# ---------------------------------------------------------------------------------------- schedules
class Schedule:
    """What the training loop asks of a schedule (see the module docstring)."""

    kind: str

    def start(self) -> None:
        """Training starts (or resumes) now."""

    def tick(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based); called once per step, before it."""
        raise NotImplementedError

    def done(self, step: int) -> bool:
        """True once the budget is used up, with ``step`` optimizer steps taken."""
        raise NotImplementedError

    def progress(self, step: int) -> float:
        raise NotImplementedError

    def info(self) -> dict:
        """Fields for the metrics log line (empty when the step count says it all)."""
        return {}

    def eta(self, done_steps: int, step_time: float) -> float:
        """Seconds left, at ``step_time`` seconds per step."""
        raise NotImplementedError

    def spent(self, step: int) -> str:
        """The config key of the budget that ran out (``train.max_steps`` or ``train.time_budget``)."""
        return "train.max_steps"

    def state_dict(self) -> dict:
        return {"kind": self.kind}

    def load_state_dict(self, state: dict) -> None:
        pass


class StepSchedule(Schedule):
    """Warmup + decay over ``total_steps`` optimizer steps."""

    kind = "steps"

    def __init__(self, peak_lr: float, total_steps: int, warmup: float = 0.06, shape: str = "linear"):
        if total_steps <= 0:
            raise ValueError(f"total_steps must be > 0, got {total_steps}")
        _check(peak_lr, warmup, shape)
        self.peak_lr, self.total_steps, self.warmup, self.shape = peak_lr, total_steps, warmup, shape

    def tick(self, step: int) -> float:
        return self.lr(step)

    def lr(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based)."""
        return self.peak_lr * SHAPES[self.shape]((step + 0.5) / self.total_steps, self.warmup)

    def progress(self, step: int) -> float:
        return min(1.0, step / self.total_steps)

    def done(self, step: int) -> bool:
        """True once ``step`` optimizer steps have been taken and the budget is used up."""
        return step >= self.total_steps

    def eta(self, done_steps: int, step_time: float) -> float:
        return (self.total_steps - done_steps) * step_time


class TimeBudgetSchedule(Schedule):
    """Warmup + decay over a wall-clock budget of ``budget_s`` seconds of training.

    Call ``start()`` once all ranks are ready (after any resume), then ``tick()`` exactly once per
    optimizer step, just before it: it reads the clock, agrees on the elapsed time across ranks (MAX,
    so the slowest view of time wins) and returns the learning rate for that step. ``all_reduce_max``
    may answer one call late (``host_copy.LaggedAllReduceMax``: no wait on the device each step); every
    rank then uses the same agreed time, one step old, so the learning rates and the last step agree
    everywhere and a run may overrun its budget by one step. ``elapsed`` survives a resume through ``state_dict``
    (time between a crash and the restart is not counted: the budget measures training time).
    ``max_steps``, when set, is a hard cap on the steps as well.
    """

    kind = "time"

    def __init__(self, peak_lr: float, budget_s: float, warmup: float = 0.06, shape: str = "linear",
                 clock: Optional[Callable[[], float]] = None, all_reduce_max: Optional[Callable] = None,
                 max_steps: Optional[int] = None):
        if not budget_s > 0:
            raise ValueError(f"time budget must be > 0 seconds, got {budget_s}")
        _check(peak_lr, warmup, shape)
        self.peak_lr, self.budget_s, self.warmup, self.shape = peak_lr, float(budget_s), warmup, shape
        self.clock = clock or MonotonicClock()
        self.all_reduce_max = all_reduce_max
        self.max_steps = max_steps
        self.offset = 0.0     # elapsed seconds carried over from before a resume
        self.t0: Optional[float] = None
        self.elapsed = 0.0    # last agreed elapsed time

    def start(self) -> None:
        self.t0 = self.clock()

    def _agreed_elapsed(self) -> float:
        if self.t0 is None:
            self.start()
        local = self.offset + (self.clock() - self.t0)
        if self.all_reduce_max is None:
            return local
        agreed = self.all_reduce_max(local)
        # A lagged reduction has nothing agreed at its first call: the elapsed time of the checkpoint (0 on
        # a fresh start) is the same on every rank.
        return self.offset if agreed is None else agreed

    def tick(self, step: int) -> float:
        """Read the clock (once) and return the learning rate of optimizer step ``step``."""
        self.elapsed = self._agreed_elapsed()
        return self.lr_at(self.elapsed)

    def lr_at(self, elapsed: float) -> float:
        return self.peak_lr * SHAPES[self.shape](elapsed / self.budget_s, self.warmup)

    def progress(self, step: int) -> float:
        return min(1.0, self.elapsed / self.budget_s)

    def done(self, step: int) -> bool:
        return self.elapsed >= self.budget_s or (self.max_steps is not None and step >= self.max_steps)

    def spent(self, step: int) -> str:
        return "train.time_budget" if self.elapsed >= self.budget_s else "train.max_steps"

    def remaining_s(self) -> float:
        return max(0.0, self.budget_s - self.elapsed)

    def info(self) -> dict:
        return {"elapsed_s": self.elapsed, "budget_s": self.budget_s}

    def eta(self, done_steps: int, step_time: float) -> float:
        left = self.remaining_s()
        if self.max_steps is not None:
            left = min(left, (self.max_steps - done_steps) * step_time)
        return left

    def state_dict(self) -> dict:
        # A lagged agreement holds the time the next step will be given: a resume must start from it, so
        # that its steps see the times and learning rates of the uninterrupted run.
        peek = getattr(self.all_reduce_max, "peek", None)
        ahead = peek() if peek is not None else None
        return {"kind": self.kind, "elapsed": self.elapsed if ahead is None else ahead, "budget_s": self.budget_s}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(f"checkpoint was written with a {state.get('kind')!r} schedule, this run uses "
                             f"{self.kind!r}; keep train.time_budget / train.max_steps as they were to resume")
        self.offset = self.elapsed = float(state["elapsed"])
        self.t0 = None


def _check(peak_lr, warmup, shape):
    if not (peak_lr >= 0 and math.isfinite(peak_lr)):
        raise ValueError(f"learning rate must be a finite number >= 0, got {peak_lr}")
    if not 0.0 <= warmup <= 1.0:
        raise ValueError(f"warmup is a fraction of the budget in [0, 1], got {warmup}")
    if shape not in SHAPES:
        raise ValueError(f"schedule shape {shape!r} is not known; use one of {sorted(SHAPES)}")
