"""Issue 15, item 9 (fine-tuning seed spread vs HF): what reaches the model over whole runs.

On the STS-B-like set of ``benchmarks/finetune_seed_spread.py`` (real MRPC pairs scored 5 x label):
* every batch of every epoch carries exactly what HF's tokenizer and ``DataCollatorWithPadding`` give
  for the same examples (ids, token types, masks, float labels; pairs truncated longest-first), each
  example once per epoch, the short last batch kept, in HF ``Trainer``'s epoch order (``seed + epoch``);
* dropout sits where HF's BERT has it and nowhere else, with the same probabilities, and draws a fresh
  mask at every site and every step;
* with dropout off, three epochs of ``fastbert finetune`` (DeepSpeed engine, evaluations between
  epochs) are the same computation as HF's model trained on the same batches.
"""
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastbert import BertForSequenceClassification
from fastbert.tasks.finetune import make_task, run_finetune
from fastbert.tasks.trainer import TrainArgs, epoch_batches
from hf_reference import hf_finetune, load_hf_model  # tests/tasks/hf_reference.py

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]


def _benchmark():
    path = REPO / "benchmarks" / "finetune_seed_spread.py"
    spec = importlib.util.spec_from_file_location("finetune_seed_spread", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def stsb_like(data_dir, tmp_path_factory):
    """STS-B-layout folder: the first 200 MRPC training pairs and 24 dev pairs, score = 5 x label."""
    return _benchmark().make_regression_set(data_dir / "glue", tmp_path_factory.mktemp("stsb"), 200, 24)


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    from fastbert.tokenization import load_tokenizer
    return load_tokenizer(minilm_dir)


def test_every_batch_of_every_epoch_is_hfs(stsb_like, minilm_dir, tokenizer):
    max_len, batch_size, seed = 40, 32, 3        # 40 tokens: many MRPC pairs are cut (longest-first)
    task = make_task("stsb", stsb_like, tokenizer, max_len)
    task.prepare()
    rows = [line.split("\t") for line in (stsb_like / "train.tsv").read_text(encoding="utf-8").splitlines()[1:]]
    hf_tok = transformers.BertTokenizerFast.from_pretrained(str(minilm_dir))
    enc = hf_tok([r[1] for r in rows], [r[2] for r in rows], truncation=True, max_length=max_len)
    hf_rows = [{"input_ids": enc["input_ids"][i], "token_type_ids": enc["token_type_ids"][i],
                "attention_mask": enc["attention_mask"][i], "labels": float(r[3])} for i, r in enumerate(rows)]
    collate = transformers.DataCollatorWithPadding(hf_tok)
    n = len(rows)
    assert n == len(task.train_features) == 200
    assert sum(len(a) > max_len - 1 for a in enc["input_ids"]) > 20      # truncation is exercised
    for epoch in range(3):
        batches = epoch_batches(n, batch_size, seed, epoch)
        # HF Trainer's order: accelerate's SeedableRandomSampler reseeds a generator with seed + epoch.
        trainer_order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        assert [i for b in batches for i in b] == trainer_order
        assert [len(b) for b in batches] == [32] * 6 + [8]               # the short last batch is kept
        for idx in batches:
            ours = task.collate([task.train_features[i] for i in idx])
            theirs = collate([hf_rows[i] for i in idx])
            assert set(ours) == set(theirs)
            for key in ours:
                assert ours[key].dtype == theirs[key].dtype, key
                assert torch.equal(ours[key], theirs[key]), (epoch, key)
    assert {float(r[3]) for r in rows} == {0.0, 5.0}


def _record_dropout(model, batch, steps):
    """(p, ndim, (kept, seen)) of every dropout call in ``steps`` training forwards of ``model``: ``kept``
    the elements dropout kept, ``seen`` those where that is visible (non-zero input; masked attention
    probabilities are 0 before dropout)."""
    calls = []
    real = F.dropout

    def spy(x, p=0.5, training=True, inplace=False):
        out = real(x, p, training, inplace)
        if training and p > 0:
            calls.append((p, x.dim(), (out != 0, x != 0)))
        return out

    model.train()
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "dropout", spy)
        for _ in range(steps):
            model(**batch)
    return calls


def test_dropout_sites_and_fresh_masks_as_hf(stsb_like, minilm_dir, tokenizer):
    task = make_task("stsb", stsb_like, tokenizer, 128)
    task.prepare()
    batch = task.collate(task.train_features[:16])
    batch.pop("labels")
    torch.manual_seed(0)
    ours = _record_dropout(BertForSequenceClassification.from_pretrained(minilm_dir, num_labels=1), batch, 2)
    hf = transformers.BertForSequenceClassification.from_pretrained(str(minilm_dir), num_labels=1,
                                                                    attn_implementation="eager")
    theirs = _record_dropout(hf, batch, 1)
    layers = hf.config.num_hidden_layers
    # embeddings, then per layer attention probabilities, attention output, FFN output; then the classifier
    assert len(theirs) == 1 + 3 * layers + 1 and len(ours) == 2 * len(theirs)
    sites = [(p, ndim == 4) for p, ndim, _ in theirs]
    assert [(p, ndim == 4) for p, ndim, _ in ours[:len(theirs)]] == sites
    assert [(p, ndim == 4) for p, ndim, _ in ours[len(theirs):]] == sites

    def keep_fraction(a):
        kept, seen = a
        return kept[seen].float().mean().item()

    def agreement(a, b):
        seen = a[1] & b[1]
        return (a[0] == b[0])[seen].float().mean().item()

    first, second = ours[:len(theirs)], ours[len(theirs):]
    expected = 0.9 ** 2 + 0.1 ** 2                                         # two independent masks, p = 0.1
    for (_, _, a), (_, _, b) in zip(first, second):                        # each site, consecutive steps
        assert abs(keep_fraction(a) - 0.9) < 0.02
        assert abs(agreement(a, b) - expected) < 0.02
    hidden = [m for _, ndim, m in first[1:-1] if ndim == 2]                # residual-branch sites
    assert len(hidden) == 2 * layers
    # every row, but the last layer's two sites run on each example's first token alone (what the pooler reads:
    # BertModel.pooled), as in a packed step
    rows = [kept.shape[0] for kept, _ in hidden]
    assert rows[-2:] == [16, 16] and set(rows[:-2]) == {sum(len(f["input_ids"]) for f in task.train_features[:16])}
    for a, b in zip(hidden, hidden[1:]):                                   # consecutive sites, same step
        if a[0].shape == b[0].shape:
            assert abs(agreement(a, b) - expected) < 0.02


def test_three_epochs_without_dropout_are_hfs_computation(stsb_like, minilm_dir, tokenizer, tmp_path):
    """24 pairs in batches of 10 (a short last batch of 4), 3 epochs, dev evaluation after each epoch; the
    checkpoint's first two layers (for time)."""
    overrides = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_hidden_layers=2)
    args = TrainArgs(epochs=3, lr=5e-5, batch_size=10, seed=0, progress=False)
    fb = run_finetune("stsb", stsb_like, minilm_dir, output=str(tmp_path / "fb"), args=args, max_seq_len=48,
                      max_train_samples=24, max_eval_samples=16, tokenizer=tokenizer, model_overrides=overrides,
                      kernels="torch", save_model=False)
    task = make_task("stsb", stsb_like, tokenizer, 48, 24, 16)
    task.prepare()
    hf_model = load_hf_model(task, minilm_dir, args.seed, attn_implementation="eager", **overrides)
    hf = hf_finetune(task, hf_model, args)
    assert fb["train"]["steps"] == hf["steps"] == 9 and len(fb["epochs"]) == 3
    np.testing.assert_allclose([v for _, v in fb["losses"]], [v for _, v in hf["losses"]], atol=1e-4)
    ours = [float(line.split("\t")[1])
            for line in (tmp_path / "fb" / "predictions_dev.tsv").read_text().splitlines()[1:]]
    theirs = task.predict_split(hf_model, task.eval_sets["dev"][1], 64)
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
