"""``kill -9`` at random points, five times in one run, each time resumed from the newest complete
checkpoint: every logged step of every attempt, the final evaluation and the final weights equal an
uninterrupted run bit for bit (dropout on; checkpoints every 2 steps, so some kills land mid-save).

The kill points come from a seeded RNG (printed on failure): a random step to wait for, then a random
delay of up to 0.3 s, so a kill can hit a forward/backward, an optimizer step or a checkpoint write."""
from __future__ import annotations

import random
import time

import pytest

from reliability_harness import (cli_cmd, kill9, launch, marker, prepare_slice, records, run_cli, tiny_config,
                                 wait, wait_for, write_config)

STEPS, TRIALS, SEED = 30, 5, 20261126


@pytest.fixture(scope="module")
def slice32(data_dir, tmp_path_factory):
    return prepare_slice(data_dir, tmp_path_factory.mktemp("kill") / "data", num_files=1, seq_len=32)


def _config(data, out):
    return tiny_config(data, out, steps=STEPS, ckpt_every=2, keep=2)


@pytest.fixture(scope="module")
def reference(slice32, tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    run_cli(write_config(root / "cfg.json", _config(slice32, root / "out")), root / "log.txt")
    return root / "out"


def test_five_random_kills_resume_bit_identical(slice32, reference, tmp_path):
    rng = random.Random(SEED)
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "cfg.json", _config(slice32, out))
    kills = []
    for trial in range(TRIALS):
        logged = max((r["step"] for r in records(out)), default=0)
        # leave room for the remaining trials: each needs a few steps of its own
        room = STEPS - 2 * (TRIALS - trial) - logged
        target = logged + 1 + rng.randrange(max(1, min(4, room)))
        delay = rng.uniform(0.0, 0.3)
        proc = launch(cli_cmd(cfg), tmp_path / f"log{trial}.txt")
        try:
            wait_for(lambda: any(r["step"] >= target for r in records(out)), timeout=180, proc=proc,
                     what=f"step {target} of trial {trial} (seed {SEED})")
            time.sleep(delay)
            assert proc.poll() is None, f"trial {trial} finished before it could be killed (seed {SEED})"
        finally:
            kill9(proc)
        kills.append((target, round(delay, 3), max(r["step"] for r in records(out))))
    final = launch(cli_cmd(cfg), tmp_path / "log_final.txt")
    wait(final, tmp_path / "log_final.txt")
    print(f"kills (step waited for, extra delay s, last logged step): {kills}; "
          f"resumed from {[r['tag'] for r in records(out, 'resume')]}")

    resumes = records(out, "resume")
    assert len(resumes) >= TRIALS - 1, (kills, resumes)   # a kill before the first checkpoint restarts fresh
    assert all(r["weights_match"] is True for r in resumes)
    ref = {r["step"]: r for r in records(reference)}
    got = records(out)
    assert {r["step"] for r in got} == set(range(1, STEPS + 1))
    for r in got:                     # every attempt's record of a step, not just the last one
        a = ref[r["step"]]
        assert (r["loss"], r["lr"], r.get("mlm_acc")) == (a["loss"], a["lr"], a.get("mlm_acc")), \
            f"step {r['step']} differs after kills {kills} (seed {SEED})"
    ev_ref, ev = records(reference, "eval")[-1], records(out, "eval")[-1]
    assert (ev["mlm_loss"], ev["mlm_acc"]) == (ev_ref["mlm_loss"], ev_ref["mlm_acc"])
    tag = f"step_{STEPS:08d}"
    assert marker(out / "checkpoints", tag)["weights_sha256"] == marker(reference / "checkpoints", tag)["weights_sha256"]
    assert (out / "hf" / "model.safetensors").read_bytes() == (reference / "hf" / "model.safetensors").read_bytes()
