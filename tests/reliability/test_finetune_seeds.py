"""`fastbert finetune --seeds N`: one run per seed under OUT/seed-S/, median and spread of every dev
metric in OUT/seeds.json, finished seeds reused on a rerun."""
import json
import subprocess
import sys


def test_finetune_seeds_reports_median_and_spread(minilm_dir, data_dir, tmp_path):
    out = tmp_path / "mrpc"
    cmd = [sys.executable, "-m", "fastbert.cli", "finetune", "--task", "mrpc", "--data", str(data_dir / "glue/MRPC"),
           "--model", str(minilm_dir), "--output", str(out), "--epochs", "1", "--max-train-samples", "16",
           "--max-eval-samples", "16", "--batch-size", "8", "--seeds", "2", "--no-save-model"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((out / "seeds.json").read_text())
    assert report["seeds"] == [42, 43]
    acc = report["summary"]["accuracy"]
    assert acc["n"] == 2 and acc["min"] <= acc["median"] <= acc["max"]
    assert set(acc["values"]) == {"42", "43"}
    for seed in (42, 43):
        assert (out / f"seed-{seed}" / "metrics.json").is_file()
    assert (out / "manifest.json").is_file()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stderr.count("already finished") == 2
