"""Pretraining through DeepSpeed on the CPU (gloo, DS_ACCELERATOR=cpu), launched by torchrun:

* two ranks, ZeRO-2, gradient accumulation, on a slice of the real Wikipedia sample: the loss falls;
* the wall-clock schedule with an injected clock (``fake:1.0:0.5``: rank 1's clock runs 1.5x
  faster): the LR follows the MAX of the ranks' elapsed time (the all-reduce, one step late), warmup/decay happen at
  the right fractions and both ranks stop at the same step;
* two simulated nodes x one rank (``--nnodes 2 --node_rank 0/1`` on 127.0.0.1): the same losses, bit
  for bit;
* ``kill -9`` mid-run, then resume: the loss and LR trajectories equal the uninterrupted run bit for
  bit (model, optimizer, schedule elapsed time, data position, masking and dropout RNGs);
* resume on ONE rank from the two-rank checkpoint and on TWO ranks from a one-rank checkpoint
  (DeepSpeed universal checkpoint conversion): the weights load bit for bit (fingerprint), the
  step-based LR equals the uninterrupted run's at every step, the loss continues (see
  fastbert/training/resume.py for the documented guarantee).

The runs are module-scoped fixtures shared by the tests (each launch costs ~30 s on 2 CPU cores).
"""
from __future__ import annotations

import json
import shutil

import pytest

from pretrain_harness import (by_step, kill9, launch, prepare_slice, records, run, torchrun_cmd, wait, wait_for,
                              write_config)

BUDGET, TICK, SKEW = 30.0, 1.0, 0.5       # fake seconds; rank r's clock advances TICK * (1 + SKEW * r) per read
LR, WARMUP = 3e-3, 0.1
FAST = TICK * (1 + SKEW)                  # the fastest rank's tick: what the all-reduce (MAX) must agree on
# The agreement arrives one step late (host_copy.LaggedAllReduceMax: no wait on the device each step): step k
# (0-based) is given FAST*k, the MAX of the times read at step k-1 (0 at the first); the run stops at the first
# step given BUDGET or more.
STEPS = int(BUDGET // FAST)


def expected_lr(done_steps: int, budget: float = BUDGET, tick: float = FAST, offset: float = 0.0) -> float:
    """The learning rate of 1-based step ``done_steps``, given ``offset + tick * done_steps`` seconds."""
    p = (offset + tick * done_steps) / budget
    return LR * (p / WARMUP if p < WARMUP else (1 - p) / (1 - WARMUP))


def config(data: str, out: str, **train) -> dict:
    return {
        "output_dir": out,
        "model": {"preset": "tiny"},            # dropout 0.1 stays on: resume must restore the RNGs
        "data": {"dir": data, "auto_prepare": False},
        "train": {"micro_batch_size": 4, "global_batch_size": 16, "time_budget": BUDGET,
                  "clock": f"fake:{TICK}:{SKEW}", "warmup": WARMUP, "max_steps": 1000,
                  "optimizer": {"type": "adamw", "lr": LR, "betas": [0.9, 0.98]},
                  "deepspeed": "configs/ds_zero2.json", "precision": "fp32", **train},
        "eval": {"every_steps": 10, "batches": 2},
        "checkpoint": {"every_steps": 6, "every_minutes": None, "keep": 2},
        "log": {"every_steps": 1, "tensorboard": False},
        "export": {"hf": False},
    }


@pytest.fixture(scope="module")
def slice_dir(data_dir, tmp_path_factory):
    return prepare_slice(data_dir, tmp_path_factory.mktemp("slice") / "data", num_files=2, seq_len=64)


@pytest.fixture(scope="module")
def run_a(slice_dir, tmp_path_factory):
    """Uninterrupted: one node, two ranks."""
    root = tmp_path_factory.mktemp("run_a")
    cfg = write_config(root / "cfg.json", config(str(slice_dir), str(root / "out")))
    run(torchrun_cmd(cfg, nproc=2), root / "log.txt")
    return root / "out"


@pytest.fixture(scope="module")
def run_b(slice_dir, tmp_path_factory):
    """Two simulated nodes of one rank each (static rendezvous on 127.0.0.1)."""
    root = tmp_path_factory.mktemp("run_b")
    cfg = write_config(root / "cfg.json", config(str(slice_dir), str(root / "out")))
    from pretrain_harness import free_port
    port = free_port()
    procs = [launch(torchrun_cmd(cfg, nproc=1, nnodes=2, node_rank=r, port=port), root / f"log{r}.txt")
             for r in (0, 1)]
    for r, p in enumerate(procs):
        wait(p, root / f"log{r}.txt")
    return root / "out"


@pytest.fixture(scope="module")
def run_c(slice_dir, tmp_path_factory):
    """kill -9 (all ranks and the launcher) after the first checkpoint, then resume to the end."""
    root = tmp_path_factory.mktemp("run_c")
    out = root / "out"
    cfg = write_config(root / "cfg.json", config(str(slice_dir), str(out)))
    proc = launch(torchrun_cmd(cfg, nproc=2), root / "log1.txt")
    try:
        wait_for(lambda: any(r["step"] >= 8 for r in records(out)), timeout=240, proc=proc,
                 what="step 8 of the run to be killed")
    finally:
        kill9(proc)
    killed_at = max(r["step"] for r in records(out))
    assert killed_at < STEPS, "the run finished before it could be killed; lengthen the budget"
    run(torchrun_cmd(cfg, nproc=2), root / "log2.txt")
    return out, killed_at


def test_two_ranks_zero2_loss_falls(run_a):
    start = records(run_a, "start")[0]
    assert start["world_size"] == 2 and start["zero_stage"] == 2 and start["grad_accum"] == 2
    steps = by_step(records(run_a))
    assert sorted(steps) == list(range(1, STEPS + 1))
    losses = [steps[s]["loss"] for s in sorted(steps)]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert first > 10.0                      # ln(30522) = 10.33 at init
    assert last < first - 1.0, losses
    ev = records(run_a, "eval")
    assert ev and ev[-1]["mlm_loss"] < ev[0]["mlm_loss"]


def test_wall_clock_schedule_agreed_across_ranks(run_a):
    steps = by_step(records(run_a))
    for s, r in steps.items():
        # elapsed is rank 1's (faster) clock, one step late: the MAX all-reduce of step s-1's reads
        assert r["elapsed_s"] == FAST * (s - 1)
        assert r["lr"] == pytest.approx(expected_lr(s - 1), rel=1e-12, abs=0)
    peak = max(steps, key=lambda s: steps[s]["lr"])
    assert FAST * (peak - 1) / BUDGET == pytest.approx(WARMUP)     # warmup ends at 10% of the budget
    assert steps[STEPS]["lr"] < 0.1 * LR                            # decayed towards 0 at the end
    done = records(run_a, "done")[-1]
    assert done["step"] == STEPS and done["elapsed_s"] >= BUDGET  # both ranks stopped at the same step


def test_two_nodes_match_one_node(run_a, run_b):
    start = records(run_b, "start")[0]
    assert start["world_size"] == 2 and start["num_nodes"] == 2 and start["local_world_size"] == 1
    a, b = by_step(records(run_a)), by_step(records(run_b))
    assert sorted(a) == sorted(b)
    assert [a[s]["loss"] for s in sorted(a)] == [b[s]["loss"] for s in sorted(b)]
    assert [a[s]["lr"] for s in sorted(a)] == [b[s]["lr"] for s in sorted(b)]


def test_kill9_resume_is_bit_identical(run_a, run_c):
    out, killed_at = run_c
    resumes = records(out, "resume")
    assert len(resumes) == 1 and resumes[0]["step"] < killed_at      # it really restarted from a checkpoint
    a, c = by_step(records(run_a)), by_step(records(out))
    assert sorted(a) == sorted(c)
    for s in sorted(a):
        assert c[s]["loss"] == a[s]["loss"], f"step {s}: {c[s]['loss']!r} != {a[s]['loss']!r}"
        assert c[s]["lr"] == a[s]["lr"] and c[s]["elapsed_s"] == a[s]["elapsed_s"]
    ev_a, ev_c = records(run_a, "eval")[-1], records(out, "eval")[-1]
    assert ev_a["mlm_loss"] == ev_c["mlm_loss"] and ev_a["mlm_acc"] == ev_c["mlm_acc"]
    tags = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert tags == ["step_00000018", f"step_{STEPS:08d}"]               # retention: keep 2


def test_resume_on_one_rank_from_two(run_a, slice_dir, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(run_a / "checkpoints", out / "checkpoints")
    budget = BUDGET + 6 * TICK
    cfg = write_config(tmp_path / "cfg.json", config(str(slice_dir), str(out), time_budget=budget))
    run(torchrun_cmd(cfg, nproc=1), tmp_path / "log.txt")
    resume = records(out, "resume")[0]
    assert resume["tag"] == f"step_{STEPS:08d}_universal" and resume["world_size"] == 1
    assert resume["weights_match"] is True                      # the universal load is lossless
    steps = by_step(records(out))
    saved = json.loads((run_a / "checkpoints" / f"step_{STEPS:08d}" / "fastbert_complete.json").read_text())
    assert saved["world_size"] == 2
    # One rank: its own clock (TICK per step, no lag) continues from the elapsed time stored in the
    # checkpoint: the time the two-rank run had agreed for the step after its last, FAST * (STEPS + 1).
    offset = FAST * (STEPS + 1)
    assert sorted(steps) == list(range(STEPS + 1, STEPS + 1 + int((budget - offset) // TICK)))
    for s, r in steps.items():
        assert r["lr"] == pytest.approx(expected_lr(s - STEPS, budget, TICK, offset=offset), rel=1e-12)
    last_a = by_step(records(run_a))[STEPS]["loss"]
    assert all(r["loss"] < last_a + 1.0 for r in steps.values())  # optimizer state came along: no blow-up


def step_config(data: str, out: str) -> dict:
    """Step-based schedule (16 steps, checkpoints every 4, three kept), dropout on."""
    cfg = config(data, out, time_budget=None, max_steps=16, clock="monotonic")
    cfg["checkpoint"].update(every_steps=4, keep=3)
    cfg["eval"]["every_steps"] = None
    return cfg


def test_resume_on_two_ranks_from_one(slice_dir, tmp_path):
    one = tmp_path / "one"
    cfg1 = write_config(tmp_path / "cfg1.json", step_config(str(slice_dir), str(one)))
    run(torchrun_cmd(cfg1, nproc=1), tmp_path / "log1.txt")
    ref = by_step(records(one))
    assert records(one, "start")[0]["grad_accum"] == 4 and sorted(ref) == list(range(1, 17))
    # Resume on two ranks from the one-rank checkpoint of step 12 (drop step 16 as if it never happened).
    two = tmp_path / "two"
    shutil.copytree(one / "checkpoints", two / "checkpoints")
    shutil.rmtree(two / "checkpoints" / "step_00000016")
    (two / "checkpoints" / "latest").write_text("step_00000012\n")
    cfg2 = write_config(tmp_path / "cfg2.json", step_config(str(slice_dir), str(two)))
    run(torchrun_cmd(cfg2, nproc=2), tmp_path / "log2.txt")
    resume = records(two, "resume")[0]
    # One rank trains on ZeRO-0 (train.zero_stage=auto), whose states are whole: two ranks load them as they
    # are (no universal conversion) and keep ZeRO-0 (a resumed run stays on its checkpoint's stage).
    assert resume["tag"] == "step_00000012" and resume["world_size"] == 2 and resume["step"] == 12
    assert resume["weights_match"] is True
    start = [r for r in records(two, "start") if r["step"] == 12][0]
    assert start["world_size"] == 2 and start["grad_accum"] == 2
    assert start["pack_span"] == 4 == records(one, "start")[0]["pack_span"]   # bins of 4 rows: micro batch 4
    got = by_step(records(two))
    assert sorted(got) == [13, 14, 15, 16]
    for s in got:
        assert got[s]["lr"] == ref[s]["lr"]                      # same schedule position, bit for bit
    # Other masks and dropout (re-seeded), same weights, optimizer and data: the same loss level, far
    # below a fresh model's (~10.3) and the run's level of 4 steps before the checkpoint.
    mean_got = sum(got[s]["loss"] for s in got) / 4
    mean_ref = sum(ref[s]["loss"] for s in got) / 4
    assert abs(mean_got - mean_ref) < 0.5 and max(r["loss"] for r in got.values()) < ref[8]["loss"], (got, ref)
    assert (two / "checkpoints" / "step_00000016" / "hf" / "model.safetensors").is_file()
