"""Deterministic mode: ``fastbert pretrain --deterministic`` twice with the same seed on the same
machine gives the same loss curve and weights bit for bit (dropout on), records what it set in the
manifest, and switches torch / cuBLAS / Triton to their deterministic settings."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from reliability_harness import REPO, cli_cmd, cpu_env, marker, prepare_slice, records, run, tiny_config, write_config

STEPS = 12


@pytest.fixture(scope="module")
def two_runs(data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("det")
    data = prepare_slice(data_dir, root / "data", num_files=1, seq_len=32)
    outs = []
    for name in ("a", "b"):
        out = root / name
        cfg = write_config(root / f"{name}.json", tiny_config(data, out, steps=STEPS, ckpt_every=None))
        run(cli_cmd(cfg, "--deterministic"), root / f"{name}.txt")
        outs.append(out)
    return outs


def test_same_seed_same_curve_bit_for_bit(two_runs):
    a, b = two_runs
    ra, rb = records(a), records(b)
    assert [r["step"] for r in ra] == list(range(1, STEPS + 1))
    assert [(r["loss"], r["lr"], r.get("mlm_acc")) for r in ra] == [(r["loss"], r["lr"], r.get("mlm_acc")) for r in rb]
    assert records(a, "eval")[-1]["mlm_loss"] == records(b, "eval")[-1]["mlm_loss"]
    tag = f"step_{STEPS:08d}"
    assert marker(a / "checkpoints", tag)["weights_sha256"] == marker(b / "checkpoints", tag)["weights_sha256"]


def test_mode_is_recorded(two_runs):
    a, _ = two_runs
    assert records(a, "start")[0]["deterministic"] is True
    det = json.loads((a / "manifest.json").read_text())["deterministic"]
    assert det["use_deterministic_algorithms"] is True and det["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert json.loads((a / "config.json").read_text())["train"]["deterministic"] is True


def _in_fresh_process(code: str) -> dict:
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cpu_env(), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_enable_sets_torch_cublas_and_triton():
    got = _in_fresh_process(
        "import json, os, torch\n"
        "from fastbert.training import determinism\n"
        "determinism.enable()\n"
        "print(json.dumps({'alg': torch.are_deterministic_algorithms_enabled(),"
        " 'cudnn': torch.backends.cudnn.deterministic, 'bench': torch.backends.cudnn.benchmark,"
        " 'cublas': os.environ.get('CUBLAS_WORKSPACE_CONFIG'), 'triton': os.environ.get('TRITON_CACHE_AUTOTUNING'),"
        " 'torch_ops': determinism.check_ops('torch')}))")
    assert got == {"alg": True, "cudnn": True, "bench": False, "cublas": ":4096:8", "triton": "1", "torch_ops": []}


def test_triton_table_has_no_atomic_ops_in_deterministic_mode():
    got = _in_fresh_process(
        "import json\n"
        "from fastbert.training import determinism\n"
        "determinism.enable()\n"
        "print(json.dumps(determinism.check_ops('triton')))")
    assert got == []
