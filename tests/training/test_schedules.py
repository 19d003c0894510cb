"""Learning-rate schedules: step budget and wall-clock budget with an injected clock (warmup and
decay fractions, agreement through the MAX reduction, resume of the elapsed time)."""
from __future__ import annotations

import pytest

from fastbert.training.schedules import (FakeClock, StepSchedule, TimeBudgetSchedule, make_clock, parse_duration,
                                         warmup_linear_decay)


def test_shape():
    assert warmup_linear_decay(0.0, 0.06) == 0.0
    assert warmup_linear_decay(0.03, 0.06) == pytest.approx(0.5)
    assert warmup_linear_decay(0.06, 0.06) == pytest.approx(1.0)
    assert warmup_linear_decay(0.53, 0.06) == pytest.approx(0.5)
    assert warmup_linear_decay(1.0, 0.06) == 0.0 and warmup_linear_decay(1.5, 0.06) == 0.0


def test_step_schedule_midpoints():
    s = StepSchedule(1e-3, total_steps=100, warmup=0.1)
    lrs = [s.lr(k) for k in range(100)]
    assert lrs[0] == pytest.approx(1e-3 * 0.005 / 0.1) and lrs[-1] == pytest.approx(1e-3 * 0.005 / 0.9)
    assert max(range(100), key=lambda k: lrs[k]) == 10       # first step past the 10% warmup
    assert all(x > 0 for x in lrs) and s.done(100) and not s.done(99)


def test_time_budget_with_fake_clock():
    clock = FakeClock(tick=2.0)
    s = TimeBudgetSchedule(1e-3, budget_s=100.0, warmup=0.06, clock=clock)
    s.start()
    lrs, k = [], 0
    while True:
        lr = s.tick(k)
        if s.done(k):
            break
        lrs.append(lr)
        k += 1
    assert len(lrs) == 49                               # elapsed 2, 4, ..., 98 < 100
    assert lrs[2] == pytest.approx(1e-3)                # elapsed 6 = 6% of the budget: the peak
    assert lrs[0] == pytest.approx(1e-3 / 3)            # elapsed 2 -> 1/3 of warmup
    assert lrs[-1] == pytest.approx(1e-3 * 2 / 94)      # elapsed 98: 2% of the decay left


def test_time_budget_agrees_on_max_and_resumes():
    # Rank 0's view when rank 1's clock runs 1.5x faster: the reduction returns rank 1's elapsed time.
    # (The real all-reduce across processes is exercised in test_pretrain_distributed.py.)
    s0 = TimeBudgetSchedule(1.0, 10.0, 0.0, clock=FakeClock(1.0), all_reduce_max=lambda x: max(x, 1.5 * x))
    s0.start()
    assert s0.tick(0) == pytest.approx(1 - 1.5 / 10)    # rank 0 sees 1.0 locally, agrees on 1.5
    state = s0.state_dict()
    assert state["elapsed"] == 1.5
    s1 = TimeBudgetSchedule(1.0, 10.0, 0.0, clock=FakeClock(1.0))
    s1.load_state_dict(state)
    s1.start()
    assert s1.tick(1) == pytest.approx(1 - 2.5 / 10)    # continues from the stored elapsed time
    with pytest.raises(ValueError, match="schedule"):
        s1.load_state_dict(StepSchedule(1.0, 10).state_dict())


def test_time_budget_with_a_lagged_agreement():
    """LaggedAllReduceMax answers one call late: the first tick uses the checkpoint's elapsed time (0 fresh,
    the same on every rank), later ticks the time agreed at the tick before, so every rank takes the same
    learning rate and stops at the same step (at most one step past the budget)."""
    answers = iter([None, 1.5, 3.0, 4.5, 6.0])                 # what the other ranks agreed, one call late
    s = TimeBudgetSchedule(1.0, 4.0, 0.0, clock=FakeClock(1.0), all_reduce_max=lambda x: next(answers))
    s.start()
    lrs = [s.tick(step) for step in range(4)]
    assert lrs == pytest.approx([1.0, 1 - 1.5 / 4, 1 - 3.0 / 4, 0.0])
    assert [s.done(3), s.elapsed] == [True, 4.5]


def test_lagged_all_reduce_max(monkeypatch):
    """Without a process group (or with one rank) it is the identity; with several ranks each call starts a
    reduction and returns the previous call's result (here gloo's blocking path, faked: MAX with 2.0)."""
    import torch.distributed as dist
    from fastbert.training.host_copy import LaggedAllReduceMax
    assert LaggedAllReduceMax("cpu")(3.0) == 3.0
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: t.clamp_(min=2.0))
    reduce = LaggedAllReduceMax("cpu")
    assert reduce.peek() is None
    assert [reduce(x) for x in (1.0, 5.0, 0.5)] == [None, 2.0, 5.0]
    assert reduce.peek() == 2.0                                 # what the next call will return
    # A checkpoint stores that value: resuming from it, the next step sees what it would have seen.
    s = TimeBudgetSchedule(1.0, 10.0, 0.0, clock=FakeClock(3.0), all_reduce_max=reduce)
    s.start()
    s.tick(0)                                                   # submits 3.0, is given the 2.0 agreed before
    assert s.elapsed == 2.0 and s.state_dict()["elapsed"] == 3.0


def test_durations_and_clocks():
    assert parse_duration("24h") == 86400 and parse_duration("1h30m") == 5400 and parse_duration(90) == 90
    assert parse_duration("2.5m") == 150
    for bad in ("", "soon", "5x"):
        with pytest.raises(ValueError, match="duration"):
            parse_duration(bad)
    c = make_clock("fake:0.5:1", rank=1)
    assert c() == 1.0 and c() == 2.0
    with pytest.raises(ValueError):
        make_clock("sundial")


def _drive(schedule, max_iterations=1000) -> list[float]:
    """The training loop's use of a schedule, written once for every kind (as in training/pretrain.py)."""
    schedule.start()
    lrs = []
    for step in range(max_iterations):
        lr = schedule.tick(step)
        if schedule.done(step):
            break
        lrs.append(lr)
    return lrs


def test_one_interface_for_step_and_time_budgets():
    from fastbert.training.schedules import Schedule
    steps = StepSchedule(1e-3, total_steps=10, warmup=0.1)
    timed = TimeBudgetSchedule(1e-3, budget_s=20.0, warmup=0.1, clock=FakeClock(tick=2.0))
    for s in (steps, timed):
        assert isinstance(s, Schedule)
    assert _drive(steps) == [steps.lr(k) for k in range(10)]
    assert steps.info() == {} and steps.spent(10) == "train.max_steps"
    assert steps.eta(done_steps=4, step_time=0.5) == 3.0
    assert len(_drive(timed)) == 9                       # elapsed 2, 4, ..., 18 < 20
    assert timed.info() == {"elapsed_s": 20.0, "budget_s": 20.0} and timed.spent(9) == "train.time_budget"
    assert timed.eta(done_steps=9, step_time=1.0) == 0.0


def test_time_budget_with_a_step_cap():
    s = TimeBudgetSchedule(1e-3, budget_s=100.0, warmup=0.0, clock=FakeClock(tick=1.0), max_steps=5)
    assert len(_drive(s)) == 5 and s.spent(5) == "train.max_steps"
    assert s.eta(done_steps=3, step_time=2.0) == 4.0     # the cap comes before the time budget
