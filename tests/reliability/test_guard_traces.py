"""No false alarms: real per-step loss and gradient-norm traces of healthy runs of the demo config
(configs/tiny.json, one per seed, recorded by record_guard_traces.py) replayed through SpikeGuard with
its default settings raise no event, with room to spare; the same traces with the drills' faults (a
NaN loss, a 100x loss spike, an exploding gradient norm) do. Replaying takes milliseconds, so CI
checks every recorded seed without training ten models."""
from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import median
from types import SimpleNamespace

import pytest
import torch

from fastbert.training.guard import DEFAULTS, SpikeGuard

RECORDED = json.loads(Path(__file__).with_name("guard_traces.json").read_text())
TRACES = RECORDED["traces"]


class Wrapper:
    """A DeepSpeed ZeRO optimizer as the guard sees it: it knows the global gradient norm."""
    _global_grad_norm = None


def replay(trace: dict, cfg: dict | None = None, faults: dict | None = None) -> list:
    """Feed a recorded trace through a guard step by step; returns its verdicts (events)."""
    guard = SpikeGuard(cfg or {})
    wrapper = Wrapper()
    engine = SimpleNamespace(ds=SimpleNamespace(optimizer=wrapper), module=None, precision="fp32", loss_scale=None,
                             step_was_applied=lambda: True)
    events = []
    for step, (loss, norm) in enumerate(zip(trace["loss"], trace["grad_norm"])):
        loss_factor, norm_factor = (faults or {}).get(step, (1.0, 1.0))
        guard.add_micro_loss(torch.tensor(loss * loss_factor, dtype=torch.float64))
        guard.check_loss(engine)
        wrapper._global_grad_norm = norm * norm_factor
        guard.decide_in_optimizer(wrapper)
        for verdict in guard.end_step(engine, step, step):
            events.append(verdict)
            if verdict.rollback:
                guard.rolled_back()
    return events


def test_enough_healthy_runs_were_recorded():
    assert len(TRACES) >= 10, "record seeds: python tests/reliability/record_guard_traces.py --seeds 10"
    assert all(len(t["loss"]) >= 110 for t in TRACES.values())        # past steps 88-99 of the alarms
    assert all(math.isfinite(x) for t in TRACES.values() for x in t["loss"] + t["grad_norm"])


@pytest.mark.parametrize("seed", sorted(TRACES, key=int))
def test_healthy_run_raises_no_guard_event(seed):
    assert replay(TRACES[seed]) == []


@pytest.mark.parametrize("seed", sorted(TRACES, key=int))
def test_defaults_leave_room_above_the_largest_healthy_value(seed):
    """Every healthy value stays below a third of the threshold the guard would apply to it."""
    guard = SpikeGuard({})
    for name, factor in (("loss", guard.loss_factor), ("grad_norm", guard.grad_norm_factor)):
        series = TRACES[seed][name]
        for i in range(max(guard.warmup_steps, guard.min_history), len(series)):
            history = series[max(0, i - guard.window):i]
            limit = max(factor * median(history), median(history))
            assert series[i] < median(history) + (limit - median(history)) / 3, (name, i, series[i], median(history))


DRILLS = {
    "nan loss": ({70: (math.nan, 1.0)}, "nonfinite_loss"),
    "100x loss spike": ({70: (100.0, 100.0)}, "loss_spike"),          # what guard.inject_spike_steps does
    "exploding gradient norm": ({70: (1.0, 1e5)}, "grad_norm_spike"),           # >= 1e5x the healthy median
    "non-finite gradient norm": ({70: (1.0, math.inf)}, "nonfinite_grad_norm"),
}


@pytest.mark.parametrize("drill", sorted(DRILLS))
def test_drills_still_fire_on_the_same_traces(drill):
    faults, reason = DRILLS[drill]
    for seed, trace in TRACES.items():
        events = replay(trace, faults=faults)
        assert [(e.step, e.reason) for e in events] == [(70, reason)], seed


def test_three_faults_in_a_row_still_ask_for_a_rollback():
    faults = {s: (math.nan, 1.0) for s in (80, 81, 82)}
    events = replay(next(iter(TRACES.values())), faults=faults)
    assert [e.rollback for e in events] == [False, False, True]


def test_healthy_norm_spikes_reach_within_3x_of_the_old_factor():
    """A 10x gradient-norm factor with no warm-up or noise margin sits within reach of healthy norm
    spikes (largest healthy ratio to the running median, over all seeds)."""
    worst = 0.0
    for trace in TRACES.values():
        norms = trace["grad_norm"]
        for i in range(10, len(norms)):
            worst = max(worst, norms[i] / median(norms[max(0, i - 50):i]))
    assert 10.0 / 3 < worst < DEFAULTS["grad_norm_factor"] / 3, worst
