"""benchmarks/e2e_train_step.py on the CPU: each contender, in its own worker process or all in one,
starts from the same weights and batches (equal eval losses and input digests)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "e2e_train_step.py"


@pytest.mark.parametrize("where", [[], ["--same-process"]], ids=["workers", "same-process"])
def test_cpu_smoke(tmp_path, where):
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--preset", "tiny", "--seq", "32", "--batch", "4",
           "--steps", "2", "--warmup", "1", "--contenders", "hf-sdpa,fb-torch", "--out", str(tmp_path), *where]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((tmp_path / "e2e_tiny_s32_b4_packed.json").read_text())
    hf, fb = report["results"]
    assert (hf["contender"], fb["contender"]) == ("hf-sdpa", "fb-torch")
    assert hf["inputs_digest"] == fb["inputs_digest"]          # (two processes) the same weights and batches
    assert abs(hf["check_loss"] - fb["check_loss"]) < 1e-3     # fp32, eval mode
    assert hf["ms_per_step"] > 0 and fb["ms_per_step"] > 0
    assert "| fb-torch |" in res.stdout
