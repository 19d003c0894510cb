"""GLUE metrics in plain numpy: accuracy, binary F1, Matthews correlation, Pearson and Spearman.

Each follows the definition GLUE uses (the scikit-learn / scipy functions of the same names);
tests/tasks/test_metrics.py checks them against those libraries. Kept dependency-free so that
fine-tuning does not need scikit-learn or scipy installed.
"""
from __future__ import annotations

import math

import numpy as np


def accuracy(preds, labels) -> float:
    preds, labels = np.asarray(preds), np.asarray(labels)
    _check_same_length(preds, labels)
    return float((preds == labels).mean()) if len(labels) else 0.0


def f1_binary(preds, labels, positive=1) -> float:
    """F1 of the positive class (sklearn ``f1_score(average="binary")``); 0 when undefined."""
    preds, labels = np.asarray(preds), np.asarray(labels)
    _check_same_length(preds, labels)
    tp = float(np.sum((preds == positive) & (labels == positive)))
    fp = float(np.sum((preds == positive) & (labels != positive)))
    fn = float(np.sum((preds != positive) & (labels == positive)))
    denom = 2 * tp + fp + fn
    return 2 * tp / denom if denom else 0.0


def matthews_corrcoef(preds, labels) -> float:
    """Multiclass Matthews correlation (Gorodkin's R_K, as sklearn computes it); 0 when undefined."""
    preds, labels = np.asarray(preds), np.asarray(labels)
    _check_same_length(preds, labels)
    classes, inv = np.unique(np.concatenate([labels, preds]), return_inverse=True)
    y, p = inv[: len(labels)], inv[len(labels):]
    k = len(classes)
    cm = np.zeros((k, k), dtype=np.float64)  # (true, pred)
    np.add.at(cm, (y, p), 1.0)
    t_sum, p_sum = cm.sum(axis=1), cm.sum(axis=0)
    n_correct, n = np.trace(cm), cm.sum()
    cov_ytyp = n_correct * n - np.dot(t_sum, p_sum)
    cov_ypyp = n * n - np.dot(p_sum, p_sum)
    cov_ytyt = n * n - np.dot(t_sum, t_sum)
    denom = cov_ytyt * cov_ypyp
    return float(cov_ytyp / math.sqrt(denom)) if denom > 0 else 0.0


def pearson(x, y) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    _check_same_length(x, y)
    xm, ym = x - x.mean(), y - y.mean()
    denom = math.sqrt(float(np.dot(xm, xm)) * float(np.dot(ym, ym)))
    return float(np.dot(xm, ym) / denom) if denom > 0 else 0.0


def rankdata(a) -> np.ndarray:
    """Ranks starting at 1 with ties given their average rank (scipy ``rankdata(method="average")``)."""
    a = np.asarray(a)
    order = np.argsort(a, kind="mergesort")
    sorted_a = a[order]
    # Group boundaries of equal values; every member of a group gets the group's mean rank.
    new_group = np.concatenate([[True], sorted_a[1:] != sorted_a[:-1]])
    group_id = np.cumsum(new_group) - 1
    starts = np.flatnonzero(new_group)
    ends = np.concatenate([starts[1:], [len(a)]])
    mean_rank = (starts + ends + 1) / 2.0  # mean of ranks start+1 .. end
    ranks = np.empty(len(a), dtype=np.float64)
    ranks[order] = mean_rank[group_id]
    return ranks


def spearman(x, y) -> float:
    _check_same_length(np.asarray(x), np.asarray(y))
    return pearson(rankdata(x), rankdata(y))


def _check_same_length(a, b):
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"predictions ({a.shape[0]}) and labels ({b.shape[0]}) differ in length")


# GLUE task -> the metrics GLUE reports for it (the first one is the task's main score).
GLUE_METRICS = {
    "cola": ("matthews_corrcoef",),
    "sst2": ("accuracy",),
    "mrpc": ("f1", "accuracy"),
    "stsb": ("pearson", "spearman"),
    "qqp": ("f1", "accuracy"),
    "mnli": ("accuracy",),
    "qnli": ("accuracy",),
    "rte": ("accuracy",),
    "wnli": ("accuracy",),
}


def glue_metrics(task: str, preds, labels) -> dict[str, float]:
    """The GLUE metrics of ``task``; classification ``preds`` are class ids, STS-B's are scores."""
    fns = {"accuracy": accuracy, "f1": f1_binary, "matthews_corrcoef": matthews_corrcoef,
           "pearson": pearson, "spearman": spearman}
    if task not in GLUE_METRICS:
        raise ValueError(f"unknown GLUE task {task!r}; known: {', '.join(GLUE_METRICS)}")
    return {name: fns[name](preds, labels) for name in GLUE_METRICS[task]}
