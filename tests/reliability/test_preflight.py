"""Multi-node start-up and liveness (fastbert/training/preflight.py), on the CPU with gloo:

* a rank that cannot reach MASTER_ADDR:MASTER_PORT, and a rank 0 whose peer never comes, each exit
  non-zero within their timeouts with one actionable message (no hang);
* a simulated 2-node job (``torchrun --nnodes 2`` on 127.0.0.1, one rank per node) passes the
  preflight (known all-reduce, same versions), then node 1 is killed (``kill -9``) or frozen
  (SIGSTOP: a hung or unreachable node, which gloo/NCCL alone would wait on until the collective
  timeout): node 0's launcher exits non-zero within heartbeat_timeout_s + 2 x heartbeat_s + 10 s;
* the version comparison and the reachability check as functions."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fastbert.training.preflight import PreflightError, compare_ranks, wait_for_master
from reliability_harness import (REPO, cpu_env, descendants_of, free_port, kill9, launch, prepare_slice, records,
                                 tiny_config, torchrun_cmd, wait_for, write_config)

HEARTBEAT, HEARTBEAT_TIMEOUT = 0.5, 5.0
BOUND = HEARTBEAT_TIMEOUT + 2 * HEARTBEAT + 10.0      # + launcher teardown


# ----------------------------------------------------------------------------------------- functions
def test_version_mismatch_names_the_ranks():
    base = {"python": "3.11.7", "torch": "2.13.0", "torch_cuda": None, "nccl": None, "deepspeed": "0.19.8",
            "triton": "3.9.0", "fastbert": "0.1.0", "git_commit": "abc"}
    infos = [dict(base, rank=0, host="node0"), dict(base, rank=1, host="node1", torch="2.11.0")]
    with pytest.raises(PreflightError, match=r"torch differs \(2\.11\.0: ranks 1@node1; 2\.13\.0: ranks 0@node0\)"):
        compare_ranks(infos)
    compare_ranks([dict(base, rank=0, host="a"), dict(base, rank=1, host="b")])


def test_missing_deepspeed_is_named_and_the_environment_untouched(monkeypatch):
    """Without DeepSpeed the start names it (not "the process group did not form ... check MASTER_ADDR"), and
    sets none of the world's variables (a later start in the process would take them for a launcher's)."""
    from fastbert.training import preflight
    monkeypatch.setitem(sys.modules, "deepspeed", None)          # `import deepspeed` raises ImportError
    monkeypatch.setenv("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))
    world = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    with pytest.raises(PreflightError, match=r"DeepSpeed, which this Python \(.*\) cannot import") as info:
        preflight.start({"preflight": False})
    assert "process group" not in str(info.value) and "scripts/install.sh" in str(info.value)
    assert {k: os.environ.get(k) for k in world} == world


def test_unreachable_master_times_out_with_a_message():
    port = free_port()                     # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(PreflightError, match=f"cannot reach MASTER_ADDR:MASTER_PORT = 127.0.0.1:{port}"):
        wait_for_master("127.0.0.1", port, timeout_s=1.0)
    assert time.monotonic() - t0 < 3.0


# ----------------------------------------------------------------------------------------- one process
@pytest.fixture(scope="module")
def slice32(data_dir, tmp_path_factory):
    return prepare_slice(data_dir, tmp_path_factory.mktemp("preflight") / "data", num_files=1, seq_len=32)


def _single_rank_of_two(tmp_path, slice32, rank: int, *overrides: str):
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "cfg.json", tiny_config(slice32, out))
    env = dict(cpu_env(), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "fastbert.cli", "pretrain", "--config", str(cfg), *overrides],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return res, time.monotonic() - t0, out


def test_rank_without_master_exits_within_connect_timeout(tmp_path, slice32):
    res, seconds, out = _single_rank_of_two(tmp_path, slice32, 1, "dist.connect_timeout_s=2")
    assert res.returncode != 0 and seconds < 30
    err = res.stderr.strip().splitlines()
    assert err[-1].startswith("fastbert pretrain: error: cannot reach MASTER_ADDR:MASTER_PORT")
    assert "Traceback" not in res.stderr and not out.exists()


def test_rank0_without_peers_exits_within_collective_timeout(tmp_path, slice32):
    res, seconds, out = _single_rank_of_two(tmp_path, slice32, 0, "dist.collective_timeout_s=3")
    assert res.returncode != 0 and seconds < 40
    assert "the process group did not form within 3 s" in res.stderr and "1/2 clients joined" in res.stderr
    assert "Traceback" not in res.stderr and not out.exists()


# ----------------------------------------------------------------------------------------- two nodes
def _two_nodes(tmp_path, slice32):
    out = tmp_path / "out"
    cfg = tiny_config(slice32, out, steps=100000, ckpt_every=None,
                      dist={"heartbeat_s": HEARTBEAT, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT,
                            "collective_timeout_s": 600.0})
    cfg["export"]["hf"] = False
    cfg["checkpoint"]["at_end"] = False
    path = write_config(tmp_path / "cfg.json", cfg)
    port = free_port()
    nodes = [launch(torchrun_cmd(path, nproc=1, nnodes=2, node_rank=r, port=port), tmp_path / f"node{r}.txt")
             for r in (0, 1)]
    try:
        wait_for(lambda: any(r["step"] >= 3 for r in records(out)), timeout=180, proc=nodes[0],
                 what="step 3 of the two-node run")
    except BaseException:
        for n in nodes:
            kill9(n)
        raise
    return nodes, out


def _assert_node0_ends(node0, t0, log_path):
    try:
        rc = node0.wait(timeout=BOUND + 20)
    except subprocess.TimeoutExpired:
        kill9(node0)
        raise AssertionError(f"node 0 still running {BOUND + 20:.0f} s after node 1 went away:\n"
                             f"{log_path.read_text()[-3000:]}")
    seconds = time.monotonic() - t0
    assert rc != 0, log_path.read_text()[-3000:]
    assert seconds < BOUND, f"node 0 took {seconds:.1f} s (bound {BOUND} s)"
    return seconds


def test_preflight_passes_and_killed_node_ends_the_job(tmp_path, slice32):
    nodes, out = _two_nodes(tmp_path, slice32)
    start = records(out, "start")[0]
    assert start["world_size"] == 2 and start["num_nodes"] == 2 and start["preflight_s"] > 0
    assert "[fastbert] preflight ok: 2 ranks on 1 host(s), same software" in (tmp_path / "node0.txt").read_text()
    t0 = time.monotonic()
    kill9(nodes[1])
    seconds = _assert_node0_ends(nodes[0], t0, tmp_path / "node0.txt")
    log = (tmp_path / "node0.txt").read_text()
    # gloo sees the reset connection at once (NCCL would not: the heartbeat covers that case, below)
    assert ("fastbert pretrain: error: a collective failed on rank 0" in log or "sent no heartbeat" in log), log[-3000:]
    print(f"kill -9 of node 1: node 0 exited after {seconds:.1f} s")


def test_frozen_node_ends_the_job_through_the_heartbeat(tmp_path, slice32):
    nodes, out = _two_nodes(tmp_path, slice32)
    frozen = [nodes[1].pid, *descendants_of(nodes[1].pid)]
    t0 = time.monotonic()
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        seconds = _assert_node0_ends(nodes[0], t0, tmp_path / "node0.txt")
    finally:
        kill9(nodes[1])                       # SIGKILL ends stopped processes too
    log = (tmp_path / "node0.txt").read_text()
    assert "rank 1 sent no heartbeat" in log and "exit status 75" in log, log[-3000:]
    print(f"SIGSTOP of node 1: node 0 exited after {seconds:.1f} s")
