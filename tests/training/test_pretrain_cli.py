"""The main-job path on the CPU: ``fastbert pretrain --config configs/tiny.json`` prepares missing data,
trains one process through DeepSpeed, evaluates, logs (console, JSONL, TensorBoard) and writes an HF
checkpoint that transformers loads with the same outputs."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pretrain_harness import REPO, cpu_env, records

WIKI = "pretrain/enwiki_wikiextractor"


@pytest.fixture(scope="module")
def tiny_run(data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    corpus = sorted((data_dir / WIKI).glob("*.xz"))[0]
    cmd = [sys.executable, "-m", "fastbert.cli", "pretrain", "--config", "configs/tiny.json",
           f"data.dir={root / 'data'}", f'data.prepare.corpus=["{corpus}"]',
           f"data.prepare.vocab={data_dir / 'vocab/bert-base-uncased/vocab.txt'}", "data.prepare.val_fraction=0.05",
           "train.time_budget=null", "train.max_steps=8", "train.micro_batch_size=8", "train.global_batch_size=16",
           "eval.every_steps=4", "eval.batches=2", "log.every_steps=2", "--output-dir", str(root / "out")]
    res = subprocess.run(cmd, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return root, res


def test_prints_progress_and_final_accuracy(tiny_run):
    root, res = tiny_run
    assert "seq/s" in res.stdout and "tok/s" in res.stdout and "ETA" in res.stdout
    final = [line for line in res.stdout.splitlines() if line.startswith("final:")]
    assert len(final) == 1 and "MLM accuracy" in final[0]
    assert (root / "data" / "index.json").is_file()                     # prepared on first use
    train = records(root / "out")
    assert [r["step"] for r in train] == [2, 4, 6, 8]
    assert all(r["seq_per_s"] > 0 and r["tokens_per_s"] > 0 for r in train)
    assert records(root / "out", "eval")[-1]["final"] is True
    assert list((root / "out" / "tensorboard").glob("events.out.tfevents.*"))
    summary = json.loads((root / "out" / "summary.json").read_text())
    assert summary["steps"] == 8 and 0 <= summary["eval"]["mlm_acc"] <= 1


def test_hf_export_loads_in_transformers(tiny_run):
    transformers = pytest.importorskip("transformers")
    import fastbert
    root, _ = tiny_run
    hf_dir = root / "out" / "hf"
    ref = transformers.BertForMaskedLM.from_pretrained(hf_dir).eval()
    tok = transformers.BertTokenizerFast.from_pretrained(hf_dir)
    ours = fastbert.BertForMaskedLM.from_pretrained(hf_dir).eval()
    enc = tok(["the capital of france is [MASK].", "a short one"], padding=True, return_tensors="pt")
    with torch.no_grad():
        a, b = ref(**enc).logits, ours(**enc).logits
    mask = enc["attention_mask"].bool()
    torch.testing.assert_close(b[mask], a[mask], rtol=1e-4, atol=1e-4)


def test_bad_config_is_one_clear_error(tmp_path):
    res = subprocess.run([sys.executable, "-m", "fastbert.cli", "pretrain", "--config", "configs/tiny.json",
                          "train.max_step=3"], cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "unknown config key 'train.max_step'" in res.stderr and "Traceback" not in res.stderr
