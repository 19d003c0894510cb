"""GLUE metrics against scikit-learn / scipy on random and edge-case inputs."""
import numpy as np
import pytest
from scipy.stats import pearsonr, rankdata, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from fastbert.tasks import metrics as M


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("num_classes", [2, 3])
def test_classification_metrics_match_sklearn(seed, num_classes):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, 257)
    # Predictions correlated with the labels so the scores are away from 0.
    preds = np.where(rng.random(257) < 0.7, labels, rng.integers(0, num_classes, 257))
    assert M.accuracy(preds, labels) == pytest.approx(accuracy_score(labels, preds), abs=1e-12)
    assert M.matthews_corrcoef(preds, labels) == pytest.approx(matthews_corrcoef(labels, preds), abs=1e-12)
    if num_classes == 2:
        assert M.f1_binary(preds, labels) == pytest.approx(f1_score(labels, preds), abs=1e-12)


def test_degenerate_cases_match_sklearn():
    labels = np.array([0, 1, 1, 0, 1])
    constant = np.ones_like(labels)
    assert M.matthews_corrcoef(constant, labels) == matthews_corrcoef(labels, constant) == 0.0
    none_positive = np.zeros_like(labels)
    assert M.f1_binary(none_positive, np.zeros_like(labels)) == 0.0
    assert M.f1_binary(none_positive, labels) == pytest.approx(f1_score(labels, none_positive, zero_division=0))
    assert M.matthews_corrcoef(labels, labels) == pytest.approx(1.0)
    assert M.matthews_corrcoef(1 - labels, labels) == pytest.approx(-1.0)


@pytest.mark.parametrize("seed", range(5))
def test_correlations_match_scipy(seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 6, 200).astype(float)  # STS-B-like scores with many ties
    y = x + rng.normal(0, 1.5, 200)
    assert M.pearson(y, x) == pytest.approx(pearsonr(y, x)[0], abs=1e-12)
    assert M.spearman(y, x) == pytest.approx(spearmanr(y, x)[0], abs=1e-12)
    np.testing.assert_allclose(M.rankdata(x), rankdata(x))


def test_glue_metric_sets():
    labels = np.array([0, 1, 1, 0])
    preds = np.array([0, 1, 0, 0])
    assert set(M.glue_metrics("mrpc", preds, labels)) == {"f1", "accuracy"}
    assert set(M.glue_metrics("cola", preds, labels)) == {"matthews_corrcoef"}
    assert set(M.glue_metrics("stsb", preds.astype(float), labels.astype(float))) == {"pearson", "spearman"}
    assert M.glue_metrics("sst2", preds, labels)["accuracy"] == 0.75
    with pytest.raises(ValueError, match="unknown GLUE task"):
        M.glue_metrics("squad", preds, labels)
    with pytest.raises(ValueError, match="differ in length"):
        M.accuracy(preds, labels[:3])
