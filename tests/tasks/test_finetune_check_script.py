"""scripts/gpu_finetune_check.py (full SST-2 / MRPC fine-tuning, fastbert beside HF; README "Full-size
runs") end to end in its --smoke mode: tiny subsets, one epoch, the same code path as the full run."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_finetune_check_smoke(tmp_path, data_dir, minilm_dir):
    cmd = [sys.executable, "scripts/gpu_finetune_check.py", "run", "--smoke", "--tasks", "mrpc",
           "--model", str(minilm_dir), "--glue", str(data_dir / "glue"), "--out", str(tmp_path)]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_finetune_check.json").read_text())
    assert report["sanity"]["max_abs_err_last_hidden"] < 1e-4        # fp32 on the CPU: same model as HF
    mrpc = report["tasks"]["mrpc"]
    assert mrpc["fastbert"]["steps"] == mrpc["hf"]["steps"] > 0
    assert set(mrpc["fastbert"]["metrics"]) == set(mrpc["hf"]["metrics"]) >= {"f1", "accuracy"}
    assert "mrpc   f1" in res.stdout                                    # the printed table
