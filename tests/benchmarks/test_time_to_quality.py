"""benchmarks/time_to_quality.py at toy scale on the CPU: the same batches and masks reach HF and fastbert
(identical step-0 held-out loss from a shared init), the `fastbert pretrain` command's final model is
evaluated on the same held-out masks, curves and plots are written, runs are resumable, and the budget
projection follows its formula."""
import json
import subprocess
import sys

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_pretrain_and_project_parts(data_dir, tmp_path):
    data = tmp_path / "data"
    subprocess.run([sys.executable, "-m", "fastbert.cli", "prepare", "--corpus",
                    str(data_dir / "pretrain/enwiki_wikiextractor/wiki_00.xz"), "--vocab",
                    str(data_dir / "vocab/bert-base-uncased/vocab.txt"), "--out", str(data), "--seq-len", "64",
                    "--workers", "1", "--val-fraction", "0.05"], check=True, capture_output=True)
    e2e = tmp_path / "e2e.json"
    e2e.write_text(json.dumps({"card": "test card", "results": [{"contender": "fb-triton", "seq_per_s": 2000.0}]}))
    out = tmp_path / "ttq"
    cmd = [sys.executable, str(REPO / "benchmarks/time_to_quality.py"), "--parts", "pretrain,project", "--data",
           str(data), "--out", str(out), "--preset", "tiny", "--steps", "4", "--batch", "8", "--eval-every", "2",
           "--eval-batches", "2", "--seeds", "0", "--ways", "hf,fb-torch,fb-pretrain,fb-pretrain-fp8", "--e2e-json",
           str(e2e)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    hf = json.loads((out / "pretrain_hf_seed0.json").read_text())
    fb = json.loads((out / "pretrain_fb-torch_seed0.json").read_text())
    assert [p["step"] for p in hf["curve"]] == [0, 2, 4] == [p["step"] for p in fb["curve"]]
    assert abs(hf["curve"][0]["mlm_loss"] - fb["curve"][0]["mlm_loss"]) < 1e-4  # same init, same eval masks
    assert abs(hf["curve"][-1]["mlm_loss"] - fb["curve"][-1]["mlm_loss"]) < 0.05  # same batches, dropout differs
    # the `fastbert pretrain` command, its final model evaluated on the same held-out masks as HF's
    cmd_run = json.loads((out / "pretrain_fb-pretrain_seed0.json").read_text())
    assert cmd_run["curve"][-1]["step"] == 4 and cmd_run["curve"][-1]["eval_masks"] == "shared"
    assert 0 < cmd_run["train_seconds"] < cmd_run["command_seconds"]
    assert abs(cmd_run["curve"][-1]["mlm_loss"] - hf["curve"][-1]["mlm_loss"]) < 0.5  # 4 steps, its own data order
    agreement = json.loads((out / "pretrain_summary.json").read_text())["agreement"]
    # train.precision=fp8: on the CPU fp32 with torch's FP8 GEMM emulation; the run says so and trains
    fp8 = json.loads((out / "pretrain_fb-pretrain-fp8_seed0.json").read_text())
    start = json.loads((out / "fb-pretrain-fp8_seed0" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["precision"] == "fp32+fp8", start
    # same seed, data order and init as fb-pretrain: only the FP8 rounding differs (the GPU run checks 3,000 steps)
    assert [p["step"] for p in fp8["curve"]] == [p["step"] for p in cmd_run["curve"]]
    assert abs(agreement["fb-pretrain-fp8"]["loss_diff_vs_bf16"]) < 0.01
    f = agreement["fb-pretrain"]
    assert f["seconds_vs_hf"] == f["train_seconds"] / agreement["hf"]["train_seconds"]
    assert f["time_to_quality_target_met"] == (f["final_mlm_loss"] <= agreement["hf"]["final_mlm_loss"] + 0.02
                                               and f["seconds_vs_hf"] <= 0.5)
    assert (out / "loss_vs_step.png").stat().st_size > 0 and (out / "loss_vs_seconds.png").stat().st_size > 0
    proj = json.loads((out / "projection.json").read_text())
    assert abs(proj["hours_1_cards"] - 95e6 / 2000 / 3600) < 1e-9
    assert abs(proj["hours_8_cards"] - 95e6 / (2000 * 8 * 0.9) / 3600) < 1e-9
    # resumable: a second call reuses the finished runs
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "[pretrain]" not in res.stdout
