"""`fastbert pretrain` on a GPU with its defaults (bf16 autocast over fp32 weights, ZeRO-0, Triton kernels,
CUDA graphs, the guard with its verdict on the device): a NaN step is skipped and logged, checkpoints and
the HF export are written (the module's own fp32 weights; ZeRO-0 has no DeepSpeed fp32 partitions to
consolidate), and HF transformers loads the export. The same with train.precision=fp8 (FP8 GEMMs inside the
graphs; a NaN step must not poison the amax history)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pretrain_harness import REPO, prepare_slice, records, write_config  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["auto", "fp8"])
def test_default_gpu_run_skips_a_nan_step_and_exports(tmp_path, data_dir, precision):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    transformers = pytest.importorskip("transformers")
    data = prepare_slice(data_dir, tmp_path / "data", num_files=1, seq_len=64)
    out = tmp_path / "out"
    cfg = {
        "output_dir": str(out),
        "model": {"preset": "tiny", "overrides": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                                                  "intermediate_size": 128}},
        "data": {"dir": str(data), "auto_prepare": False},
        "train": {"micro_batch_size": 16, "global_batch_size": 16, "max_steps": 12, "precision": precision,
                  "optimizer": {"type": "adamw", "lr": 1e-3}},
        "eval": {"every_steps": None, "batches": 2, "at_end": True},
        "checkpoint": {"every_steps": 6, "every_minutes": None, "keep": 2},
        "guard": {"inject_nan_steps": [8]},
        "log": {"every_steps": 4, "tensorboard": False},
        "export": {"hf": True},
    }
    config = write_config(tmp_path / "config.json", cfg)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    res = subprocess.run([sys.executable, "-m", "fastbert.cli", "pretrain", "--config", str(config)], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    start = records(out, "start")[0]
    assert start["precision"] == {"auto": "bf16", "fp8": "bf16+fp8"}[precision] and start["zero_stage"] == 0
    guard = records(out, "guard")
    assert [(g["step"], g["reason"]) for g in guard] == [(9, "nonfinite_loss")]
    train = records(out, "train")
    assert [t["step"] for t in train] == [4, 8, 12] and all(math.isfinite(t["loss"]) for t in train)
    assert train[-1]["train_s"] > train[0]["train_s"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["guard_skipped"] == 1
    hf = transformers.BertForMaskedLM.from_pretrained(out / "hf")
    assert all(torch.isfinite(p).all() for p in hf.parameters())
    logits = hf(input_ids=torch.tensor([[2, 1000, 1001, 3]])).logits
    assert torch.isfinite(logits).all()
