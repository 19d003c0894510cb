"""The Quick start as a newcomer runs it, in a fresh clone: ``bash scripts/demo.sh`` installs into the
clone's own .venv (the system interpreter's package set stays the same), prepares data, trains, is
interrupted with Ctrl-C (SIGINT to its process group) and saves a checkpoint, resumes when run again
(the install now says it is up to date), ends with the report (expected range, fill-mask, loss curve)
and raises no guard event. Small budget: one Wikipedia file, a few steps.

CI cost: pip reuses its wheel cache (the same user's ~/.cache/pip, filled by the CI install), and the
DeepSpeed CPU op built for the CI checkout (.torch_extensions) is copied in, so the fresh install
builds only fastbert's own extension (~3 min in all on 2 cores)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _system_python() -> Path:
    """The interpreter the test venv was made from (the 'system' Python of the Quick start)."""
    return Path(getattr(sys, "_base_executable", sys.executable)).resolve()


def _newcomer_env(data_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "TORCH_EXTENSIONS_DIR", "TRITON_INTERPRET", "PYTHONHOME")}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and not (Path(p) / "activate").is_file()]
    env["PATH"] = os.pathsep.join([str(_system_python().parent), *path])
    env.update(DATA=str(data_dir), PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))  # scripts/test.sh: 1 (two workers)
    return env


def _freeze(env: dict) -> str:
    return subprocess.run(["python3", "-m", "pip", "freeze", "--all"], env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout


@pytest.mark.slow
def test_quickstart_in_a_fresh_clone(tmp_path, data_dir):
    if not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to clone")
    env = _newcomer_env(data_dir)
    clone = tmp_path / "fastbert"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    if (REPO / ".torch_extensions" / "deepspeed_shm_comm").is_dir():
        shutil.copytree(REPO / ".torch_extensions", clone / ".torch_extensions")
    before = _freeze(env)
    corpus = sorted((data_dir / "pretrain" / "enwiki_wikiextractor").glob("*.xz"))[0]
    small = [f'data.prepare.corpus=["{corpus}"]', "data.prepare.workers=1", "data.prepare.val_fraction=0.1",
             "log.every_steps=2", "eval.batches=2", "eval.micro_batch_size=8", "train.time_budget=null"]

    log1 = tmp_path / "run1.txt"
    with open(log1, "w") as f:
        proc = subprocess.Popen(["bash", "scripts/demo.sh", *small, "train.max_steps=100000"], cwd=clone, env=env,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.monotonic()
        while "step 4/" not in log1.read_text():
            assert proc.poll() is None, log1.read_text()[-4000:]
            assert time.monotonic() - t0 < 1800, "no training step within 30 minutes"
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)                             # Ctrl-C
        assert proc.wait(timeout=120) == 130, log1.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text1 = log1.read_text()
    assert "[install] creating .venv" in text1 and "Traceback" not in text1
    stopped = int(text1.split("stopped at step ")[1].split(":")[0])

    t0 = time.monotonic()
    res = subprocess.run(["bash", "scripts/demo.sh", *small, f"train.max_steps={stopped + 4}"], cwd=clone, env=env,
                         capture_output=True, text=True, timeout=1200)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "[install] up to date" in out and "[install] creating" not in out
    assert f"resuming from step {stopped} " in out
    assert any(line.startswith(f"final: step {stopped + 4} ") for line in res.stdout.splitlines())
    assert "\nexpected: " in res.stdout and "fill-mask on sentences it never saw" in res.stdout  # a range, or why none
    run_dir = clone / "runs" / "tiny"
    assert (run_dir / "loss_curve.png").is_file() and (run_dir / "hf" / "model.safetensors").is_file()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in records if r["event"].startswith("guard")], "a healthy run raised guard events"
    assert "[guard]" not in text1 + out
    assert len({r["run"] for r in records if r["event"] == "start"}) == 2
    assert _freeze(env) == before, "the Quick start changed the system interpreter's packages"
