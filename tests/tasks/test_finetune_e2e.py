"""End to end on real data subsets with all-MiniLM-L6-v2 (CPU, fp32, DeepSpeed in one process):
SQuAD v1.1 and CoNLL-2003 NER train and score well above an untrained head on the same dev subset;
multiple choice trains exactly as HF's BertForMultipleChoice does; all write their outputs.

SQuAD's train split is not in ../shared/data, so training uses questions from dev articles 3..48 and
evaluation the first questions of articles 1..2 (no shared contexts)."""
import json

import numpy as np
import pytest
import torch

from fastbert.tasks.finetune import make_task, run_finetune
from fastbert.tasks.trainer import TrainArgs


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    from fastbert.tokenization import load_tokenizer
    return load_tokenizer(minilm_dir)


def untrained_score(task_name, data, minilm_dir, tokenizer, max_seq_len, key, **kw):
    """The metric of a freshly initialized head on the same dev subset (the trivial baseline)."""
    task = make_task(task_name, data, tokenizer, max_seq_len, max_train_samples=1, **kw)
    task.prepare()
    torch.manual_seed(0)
    model = task.model_cls.from_pretrained(minilm_dir, **task.model_kwargs())
    return task.evaluate(model, 64)[0][key]


@pytest.fixture(scope="module")
def squad_dir(tmp_path_factory, data_dir):
    doc = json.loads((data_dir / "squad" / "dev-v1.1.json").read_text())
    d = tmp_path_factory.mktemp("squad")
    (d / "train-v1.1.json").write_text(json.dumps({"version": "1.1", "data": doc["data"][2:]}))
    (d / "dev-v1.1.json").write_text(json.dumps({"version": "1.1", "data": doc["data"][:2]}))
    return d


@pytest.mark.slow
def test_squad_end_to_end(tmp_path, squad_dir, minilm_dir, tokenizer):
    args = TrainArgs(epochs=1, lr=3e-4, head_lr=1e-3, batch_size=16, warmup=0.1, seed=0, progress=False)
    opts = dict(doc_stride=32, max_query_len=32)
    out = tmp_path / "squad_out"
    summary = run_finetune("squad", squad_dir, minilm_dir, output=str(out), args=args, max_seq_len=128,
                           max_train_samples=320, max_eval_samples=100, task_options=opts, tokenizer=tokenizer,
                           save_model=False)
    m = summary["metrics"]
    base = untrained_score("squad", squad_dir, minilm_dir, tokenizer, 128, "f1", max_eval_samples=100, **opts)
    print("squad", m, "untrained f1", base)
    assert m["total"] == 100
    assert m["f1"] > max(15.0, base + 10.0), (m, base)
    preds = json.loads((out / "predictions.json").read_text())
    assert len(preds) == 100 and sum(bool(v) for v in preds.values()) == 100
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["metrics"]["f1"] == pytest.approx(m["f1"])
    events = [json.loads(line)["event"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert events[0] == "start" and "train" in events and "eval" in events and events[-1] == "end"


def test_conll_end_to_end(tmp_path, data_dir, minilm_dir, tokenizer):
    data = data_dir / "conll2003" / "original_iob1"   # the IOB1 release: converted to IOB2 for training
    args = TrainArgs(epochs=1, lr=3e-4, head_lr=3e-3, batch_size=16, warmup=0.1, seed=0, progress=False)
    out = tmp_path / "ner_out"
    summary = run_finetune("ner", data, minilm_dir, output=str(out), args=args, max_seq_len=64,
                           max_train_samples=640, max_eval_samples=200, tokenizer=tokenizer)
    m = summary["metrics"]
    base = untrained_score("ner", data, minilm_dir, tokenizer, 64, "f1", max_eval_samples=200)
    print("ner", {k: v for k, v in m.items()}, "untrained f1", base)
    assert m["eval_sentences"] == 200
    assert m["f1"] > max(0.45, base + 0.3), (m, base)   # 0.62 seen; an untrained head scores ~0.04
    lines = (out / "predictions.conll").read_text().split("\n")
    assert lines[0].split()[:2] == ["CRICKET", "O"] and len(lines[0].split()) == 3
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["BertForTokenClassification"] and len(config["id2label"]) == 9
    assert (out / "vocab.txt").is_file() and (out / "tokenizer_config.json").is_file()


def test_multiple_choice_end_to_end_matches_hf(tmp_path, data_dir, minilm_dir, tokenizer):
    """SST-2 sentences as two-way multiple choice ("Overall, the review is" negative. / positive.),
    trained by fastbert and by HF's BertForMultipleChoice without dropout: the same losses step by
    step and the same dev accuracy."""
    from fastbert.data.glue import get_task, read_examples, split_path
    from hf_reference import hf_finetune, load_hf_model
    task = get_task("sst2")
    mc = tmp_path / "mc"
    mc.mkdir()
    for split, name, n in (("train", "train.jsonl", 48), ("dev", "dev.jsonl", 64)):
        examples = read_examples(task, split_path(task, data_dir / "glue", split), n)
        (mc / name).write_text("".join(json.dumps({"context": e.text_a, "question": "Overall, the review is",
                                                   "choices": ["negative.", "positive."], "label": e.label}) + "\n"
                                       for e in examples))
    args = TrainArgs(epochs=1, lr=2e-4, head_lr=2e-3, batch_size=16, warmup=0.1, seed=0, progress=False)
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    out = tmp_path / "mc_out"
    summary = run_finetune("multiple-choice", mc, minilm_dir, output=str(out), args=args, max_seq_len=64,
                           tokenizer=tokenizer, save_model=False, model_overrides=no_dropout)
    hf_task = make_task("multiple-choice", mc, tokenizer, 64)
    hf_task.prepare()
    hf = hf_finetune(hf_task, load_hf_model(hf_task, minilm_dir, 0, "eager", **no_dropout), args)
    fb_losses = [v for _, v in summary["losses"]]
    assert len(fb_losses) == 3
    np.testing.assert_allclose(fb_losses, [v for _, v in hf["losses"]], atol=1e-4)
    assert summary["metrics"]["accuracy"] == hf["metrics"]["accuracy"]
    assert summary["metrics"]["eval_samples"] == 64
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 64 and all(len(r["scores"]) == 2 and r["prediction"] in (0, 1) for r in rows)
