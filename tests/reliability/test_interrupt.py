"""Ctrl-C and SIGTERM: the first signal saves a checkpoint at the next step boundary and the command
says how to resume (exit 130 / 143); the re-run says ``resuming from step N``; each run's records in
metrics.jsonl carry their own run id; a run whose budget is spent says so and how to train longer; a
second Ctrl-C exits at once."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from reliability_harness import REPO, checkpoint_tags, cli_cmd, cpu_env, launch, prepare_slice, records, tiny_config, \
    wait_for, write_config


def test_sigint_saves_resumes_and_tells_runs_apart(data_dir, tmp_path):
    data = prepare_slice(data_dir, tmp_path / "data", num_files=1, seq_len=32)
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "cfg.json", tiny_config(data, out, steps=10_000, ckpt_every=None))
    log = tmp_path / "log1.txt"
    proc = launch(cli_cmd(cfg), log)
    wait_for(lambda: "step 3/" in log.read_text(), 240, proc, "step 3")
    os.killpg(proc.pid, signal.SIGINT)                     # what Ctrl-C in a terminal does
    t0 = time.monotonic()
    assert proc.wait(timeout=60) == 130, log.read_text()[-3000:]
    text = log.read_text()
    assert time.monotonic() - t0 < 30
    assert "saving a checkpoint at the end of this step" in text and "Traceback" not in text
    stopped = int(text.split("stopped at step ")[1].split(":")[0])
    assert "Run the same command again to resume" in text
    assert checkpoint_tags(out / "checkpoints") == [f"step_{stopped:08d}"]
    assert records(out, "interrupted")[0]["step"] == stopped

    res = subprocess.run(cli_cmd(cfg, f"train.max_steps={stopped + 2}"), cwd=REPO, env=cpu_env(),
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert f"resuming from step {stopped} " in res.stdout
    assert any(line.startswith(f"final: step {stopped + 2} ") for line in res.stdout.splitlines())

    res = subprocess.run(cli_cmd(cfg, f"train.max_steps={stopped + 2}"), cwd=REPO, env=cpu_env(),
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert f"train.max_steps={stopped + 2} is already spent" in res.stdout and "To train longer" in res.stdout

    starts = records(out, "start")
    runs = [r["run"] for r in starts]
    assert len(set(runs)) == 3                              # three runs, told apart in one metrics.jsonl
    assert [r["step"] for r in starts] == [0, stopped, stopped + 2]
    assert {r["run"] for r in records(out, "train") if r["step"] > stopped} == {runs[1]}


STOPPER = """
import os, signal, sys, time
from fastbert.training.interrupt import StopRequest
stop = StopRequest(lambda text: print(text, flush=True), timeout_s={timeout}).install()
os.kill(os.getpid(), signal.{first})
time.sleep(0.2)
print("requested", stop.requested, flush=True)
{second}
time.sleep(30)
print("still running", flush=True)
"""


def _stopper(first: str, second: str = "", timeout: float = 60) -> subprocess.CompletedProcess:
    code = STOPPER.format(first=first, second=second, timeout=timeout)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cpu_env(), capture_output=True, text=True,
                          timeout=60)


def test_second_ctrl_c_exits_at_once():
    t0 = time.monotonic()
    res = _stopper("SIGINT", "os.kill(os.getpid(), signal.SIGINT)")
    assert res.returncode == 130 and time.monotonic() - t0 < 20
    assert "requested True" in res.stdout and "second Ctrl-C: stopping now" in res.stderr


def test_sigterm_after_sigint_is_the_same_request_and_the_wait_is_bounded():
    res = _stopper("SIGINT", "os.kill(os.getpid(), signal.SIGTERM)", timeout=2)
    assert res.returncode == 130 and "still running" not in res.stdout         # SIGTERM ignored, then gave up
    assert "no step boundary within 2s" in res.stderr
    res = _stopper("SIGTERM", timeout=1)
    assert res.returncode == 143 and "SIGTERM: saving a checkpoint" in res.stdout
