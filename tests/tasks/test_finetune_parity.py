"""fastbert fine-tuning (DeepSpeed engine, fastbert model) vs a plain HF transformers loop
(BertForSequenceClassification loaded from the same all-MiniLM-L6-v2 folder), on real SST-2 and
MRPC subsets: same features, batches and order, seed, parameter groups, learning rates, schedule,
AdamW, clipping and initial head (tests/tasks/hf_reference.py).

* Dropout off, the two runs are the same computation in a different op order: per-step losses
  agree to 1e-4 and dev predictions are identical.
* Dropout on (the real setting), the runs differ only in their dropout masks. Stated tolerance:
  dev accuracy / F1 within 0.06 on 200 dev examples (about 2 standard deviations of the
  difference between two runs that disagree on up to 15% of the dev examples:
  sqrt(0.15 / 200) = 0.027); per-step training losses within 0.05 on average (single steps drift
  further apart as the trajectories separate) and no systematic offset (mean losses within 0.02).
The fine-tuned fastbert model is also loaded by HF from the output folder and gives the same logits.
"""
import json

import numpy as np
import pytest
import torch

from fastbert.tasks.finetune import make_task, run_finetune
from fastbert.tasks.trainer import TrainArgs
from hf_reference import hf_finetune, load_hf_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    from fastbert.tokenization import load_tokenizer
    return load_tokenizer(minilm_dir)


def both(task_name, data_dir, minilm_dir, tokenizer, tmp_path, n_train, n_eval, args, max_seq_len, dropout=None):
    overrides = {} if dropout is None else dict(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    glue = data_dir / "glue"
    fb = run_finetune(task_name, glue, minilm_dir, output=str(tmp_path / task_name), args=args,
                      max_seq_len=max_seq_len, max_train_samples=n_train, max_eval_samples=n_eval,
                      tokenizer=tokenizer, model_overrides=overrides, kernels="torch")
    task = make_task(task_name, glue, tokenizer, max_seq_len, n_train, n_eval)
    task.prepare()
    hf_model = load_hf_model(task, minilm_dir, args.seed, attn_implementation="eager", **overrides)
    hf = hf_finetune(task, hf_model, args)
    return fb, hf, task, hf_model


def test_identical_without_dropout(tmp_path, data_dir, minilm_dir, tokenizer):
    args = TrainArgs(epochs=1, lr=2e-4, head_lr=2e-3, batch_size=16, warmup=0.1, seed=1, progress=False)
    fb, hf, task, _ = both("sst2", data_dir, minilm_dir, tokenizer, tmp_path, 64, 64, args, 64, dropout=0.0)
    fb_losses = np.array([v for _, v in fb["losses"]])
    hf_losses = np.array([v for _, v in hf["losses"]])
    assert len(fb_losses) == len(hf_losses) == 4
    np.testing.assert_allclose(fb_losses, hf_losses, atol=1e-4)
    assert fb["metrics"]["accuracy"] == hf["metrics"]["accuracy"]
    fb_pred = (tmp_path / "sst2" / "predictions_dev.tsv").read_text().splitlines()[1:]
    assert len(fb_pred) == 64


@pytest.mark.slow
@pytest.mark.parametrize("task_name, n_train, epochs, max_seq_len", [("sst2", 512, 1, 64), ("mrpc", 384, 2, 64)])
def test_dev_metrics_agree_with_hf(tmp_path, data_dir, minilm_dir, tokenizer, task_name, n_train, epochs,
                                   max_seq_len):
    args = TrainArgs(epochs=epochs, lr=2e-4, head_lr=2e-3, batch_size=16, warmup=0.1, seed=0, progress=False)
    fb, hf, task, _ = both(task_name, data_dir, minilm_dir, tokenizer, tmp_path, n_train, 200, args, max_seq_len)
    fb_losses = np.array([v for _, v in fb["losses"]])
    hf_losses = np.array([v for _, v in hf["losses"]])
    assert len(fb_losses) == len(hf_losses) == fb["train"]["steps"] == n_train // 16 * epochs
    print(task_name, "fastbert", fb["metrics"], "HF", hf["metrics"], "mean |dloss|",
          np.abs(fb_losses - hf_losses).mean(), "offset", fb_losses.mean() - hf_losses.mean())
    assert np.abs(fb_losses - hf_losses).mean() < 0.05
    assert abs(fb_losses.mean() - hf_losses.mean()) < 0.02
    for losses in (fb_losses, hf_losses):      # both learned something
        assert losses[-8:].mean() < losses[:8].mean() - 0.05
    for key in fb["metrics"]:
        if key != "eval_samples":
            assert abs(fb["metrics"][key] - hf["metrics"][key]) <= 0.06, (key, fb["metrics"], hf["metrics"])
    if task_name == "sst2":
        assert fb["metrics"]["accuracy"] > 0.65 and hf["metrics"]["accuracy"] > 0.65

    # The output folder is an HF checkpoint: transformers loads it and gives fastbert's logits.
    out = tmp_path / task_name
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["metrics"] == pytest.approx(fb["metrics"])
    assert (out / "vocab.txt").is_file() and (out / "predictions_dev.tsv").is_file()
    reloaded = transformers.BertForSequenceClassification.from_pretrained(str(out), attn_implementation="eager")
    from fastbert import BertForSequenceClassification
    ours = BertForSequenceClassification.from_pretrained(out).eval()
    batch = task.collate(task.eval_sets["dev"][1][:8])
    batch.pop("labels")
    with torch.no_grad():
        torch.testing.assert_close(ours(**batch).logits, reloaded.eval()(**batch).logits, atol=1e-4, rtol=1e-4)
    assert reloaded.config.id2label == {0: "0", 1: "1"}
