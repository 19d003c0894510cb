"""Sentence-BERT on MRPC pairs (both objectives), the saved model through `fastbert embed`, and k-means."""
import json

import numpy as np
import pytest
import torch

from fastbert.analysis.clustering import cluster_texts, kmeans
from fastbert.cli import main
from fastbert.data.sentence_pairs import read_pairs
from fastbert.tasks.sbert import SentenceBert, encode_pairs, evaluate_pairs
from fastbert.tasks.trainer import TrainArgs


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    from fastbert.tokenization import load_tokenizer
    return load_tokenizer(minilm_dir)


def mse_on(model_dir, tokenizer, pairs, targets):
    """Regression loss of a saved encoder on ``pairs`` (eval mode, no dropout)."""
    from fastbert import BertModel
    model = SentenceBert(BertModel.from_pretrained(model_dir), "regression").eval()
    feats = encode_pairs(pairs, tokenizer, 64, targets)
    from fastbert.tasks.trainer import pad_batch
    with torch.no_grad():
        return float(model(**pad_batch(feats, {})).loss)


def test_sbert_regression_trains_and_embed_uses_it(tmp_path, data_dir, minilm_dir, tokenizer, capsys):
    train = data_dir / "glue" / "MRPC" / "train.tsv"
    out = tmp_path / "sbert_reg"
    assert main(["sbert-train", "--model", str(minilm_dir), "--data", str(train), "--eval-data",
                 str(data_dir / "glue" / "MRPC" / "dev.tsv"), "--objective", "regression", "--output", str(out),
                 "--max-train-samples", "96", "--max-eval-samples", "64", "--batch-size", "16", "--lr", "1e-4",
                 "--max-seq-len", "64", "--seed", "0"]) == 0
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["score_scale"] == 1.0 and summary["train"]["steps"] == 6
    assert -1.0 <= summary["metrics"]["spearman"] <= 1.0
    # The training objective went down on the training pairs (measured without dropout).
    pairs = read_pairs(train, 96)[0]
    targets = [float(p.target) for p in pairs]
    assert mse_on(out, tokenizer, pairs, targets) < mse_on(minilm_dir, tokenizer, pairs, targets)
    # Sentence-transformers metadata (mean pooling) and an HF BertModel checkpoint.
    assert json.loads((out / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"] is True
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertModel"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("A cat sleeps on the sofa.\nStocks fell sharply on Monday.\nThe kitten naps on the couch.\n")
    capsys.readouterr()
    assert main(["embed", "--model", str(out), "--corpus", str(corpus), "--query", "a sleeping cat", "--top-k", "2",
                 "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)[0]["hits"]
    assert {h["line"] for h in hits} == {0, 2}


def test_sbert_classification_objective(tmp_path, data_dir, minilm_dir, tokenizer):
    from fastbert.tasks.sbert import run_sbert
    mrpc = data_dir / "glue" / "MRPC"
    args = TrainArgs(epochs=1, lr=1e-4, head_lr=1e-3, batch_size=16, seed=0, progress=False)
    summary = run_sbert(minilm_dir, mrpc / "train.tsv", "classification", tmp_path / "sbert_cls", mrpc / "dev.tsv",
                        args, max_seq_len=64, max_train_samples=96, max_eval_samples=64)
    assert summary["labels"] == ["0", "1"] and summary["train"]["steps"] == 6
    assert 0.0 <= summary["metrics"]["accuracy"] <= 1.0 and summary["metrics"]["eval_pairs"] == 64
    losses = [v for _, v in summary["losses"]]
    assert all(np.isfinite(losses)) and abs(losses[0] - np.log(2)) < 0.2   # a fresh 2-way head starts near ln 2


def test_siamese_forward_matches_separate_encoding(minilm_dir, tokenizer):
    """One stacked forward over both sides equals encoding each side on its own; (u, v, |u-v|) layout."""
    from fastbert import BertModel
    from fastbert.data.sentence_pairs import SentencePair
    from fastbert.tasks.trainer import pad_batch
    torch.manual_seed(0)
    model = SentenceBert(BertModel.from_pretrained(minilm_dir), "classification", 3).eval()
    pairs = [SentencePair("A man plays a guitar.", "Someone is making music on a guitar outdoors.", "x"),
             SentencePair("Short.", "Much longer second sentence here.", "x")]
    batch = pad_batch(encode_pairs(pairs, tokenizer, 64, [0, 1]), {})
    with torch.no_grad():
        out = model(**batch)
        u = model.embed(batch["a_input_ids"], batch["a_attention_mask"])
        v = model.embed(batch["b_input_ids"], batch["b_attention_mask"])
        want = model.classifier(torch.cat([u, v, (u - v).abs()], -1))
    torch.testing.assert_close(out.logits, want, atol=1e-5, rtol=1e-5)
    metrics, preds = evaluate_pairs(model, tokenizer, pairs, [0, 1], 64, 8)
    assert preds.tolist() == want.argmax(-1).tolist()


def test_kmeans_matches_sklearn():
    sklearn = pytest.importorskip("sklearn")
    from sklearn.cluster import KMeans
    from sklearn.datasets import make_blobs
    from sklearn.metrics import adjusted_rand_score
    x, y = make_blobs(300, centers=5, n_features=8, cluster_std=2.0, random_state=0)
    ours = kmeans(x, 5, seed=0)
    ref = KMeans(5, n_init=10, random_state=0).fit(x)
    assert ours.inertia == pytest.approx(ref.inertia_, rel=1e-6)
    assert adjusted_rand_score(ours.labels, ref.labels_) == 1.0 and adjusted_rand_score(ours.labels, y) == 1.0
    with pytest.raises(ValueError, match="k=7 must be between 1 and the number of points"):
        kmeans(x[:6], 7)
    assert sklearn


def test_cluster_sentences_by_topic(tmp_path, minilm_dir, tokenizer, capsys):
    from fastbert import BertModel
    cats = ["The cat is sleeping on the windowsill.", "My kitten loves chasing a ball of yarn.",
            "Cats purr when they are content."]
    markets = ["The stock market fell three percent today.", "Investors sold bonds as interest rates rose.",
               "Shares of the bank dropped after its earnings report."]
    model = BertModel.from_pretrained(minilm_dir)
    result, emb = cluster_texts(model, tokenizer, cats + markets, k=2)
    assert len(set(result.labels[:3])) == 1 and len(set(result.labels[3:])) == 1
    assert result.labels[0] != result.labels[3]
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    inp = tmp_path / "s.txt"
    inp.write_text("\n".join(cats + markets) + "\n")
    out = tmp_path / "c.json"
    assert main(["cluster", "--model", str(minilm_dir), "--input", str(inp), "--k", "2", "--out", str(out)]) == 0
    clusters = sorted(sorted(c) for c in json.loads(out.read_text())["clusters"])
    assert clusters == sorted([sorted(cats), sorted(markets)])
