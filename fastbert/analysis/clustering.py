"""k-means clustering of sentence embeddings (numpy): k-means++ seeding, Lloyd iterations, best of
``n_init`` restarts by inertia (the within-cluster sum of squared distances), as scikit-learn's
``KMeans`` does. With L2-normalized embeddings (``fastbert.sentence_embeddings.encode_sentences``'s
default) squared Euclidean distance is ``2 - 2 cos``, so this clusters by cosine similarity.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class KMeansResult:
    labels: np.ndarray    # (N,) cluster of each point
    centers: np.ndarray   # (k, D)
    inertia: float
    iterations: int


def _sq_dist(x: np.ndarray, centers: np.ndarray) -> np.ndarray:
    """``(N, k)`` squared distances, via ``|x|^2 - 2 x.c + |c|^2`` (clipped at 0 for rounding)."""
    d = (x * x).sum(1)[:, None] - 2.0 * x @ centers.T + (centers * centers).sum(1)[None, :]
    return np.maximum(d, 0.0)


def kmeans_plus_plus(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Seeds drawn with probability proportional to the squared distance to the nearest seed so far."""
    centers = [x[rng.integers(len(x))]]
    closest = _sq_dist(x, np.array(centers))[:, 0]
    for _ in range(1, k):
        total = closest.sum()
        idx = rng.integers(len(x)) if total <= 0 else rng.choice(len(x), p=closest / total)
        centers.append(x[idx])
        closest = np.minimum(closest, _sq_dist(x, x[idx][None])[:, 0])
    return np.array(centers)


def kmeans(x, k: int, n_init: int = 10, max_iter: int = 300, tol: float = 1e-6, seed: int = 0) -> KMeansResult:
    """Cluster the rows of ``x`` into ``k`` groups; the restart with the lowest inertia wins."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or len(x) == 0:
        raise ValueError(f"kmeans needs a non-empty (N, D) array, got shape {x.shape}")
    if not 1 <= k <= len(x):
        raise ValueError(f"k={k} must be between 1 and the number of points ({len(x)})")
    rng = np.random.default_rng(seed)
    best = None
    for _ in range(max(1, n_init)):
        centers = kmeans_plus_plus(x, k, rng)
        for it in range(1, max_iter + 1):
            labels = _sq_dist(x, centers).argmin(1)
            new = centers.copy()
            for c in range(k):
                members = x[labels == c]
                if len(members):
                    new[c] = members.mean(0)
                else:  # an empty cluster takes the point farthest from its center
                    far = _sq_dist(x, centers)[np.arange(len(x)), labels].argmax()
                    new[c] = x[far]
            shift = float(((new - centers) ** 2).sum())
            centers = new
            if shift <= tol:
                break
        labels = _sq_dist(x, centers).argmin(1)
        inertia = float(_sq_dist(x, centers)[np.arange(len(x)), labels].sum())
        if best is None or inertia < best.inertia:
            best = KMeansResult(labels, centers, inertia, it)
    return best


def cluster_texts(model, tokenizer, texts, k: int, batch_size: int = 64, max_length: int = 256, seed: int = 0,
                  progress: bool = False) -> tuple[KMeansResult, np.ndarray]:
    """Embed ``texts`` (mean pooling, L2-normalized) and k-means them; returns the result and embeddings."""
    from fastbert.sentence_embeddings import encode_sentences

    emb = encode_sentences(model, tokenizer, list(texts), batch_size=batch_size, max_length=max_length,
                           normalize=True, progress=progress).numpy()
    return kmeans(emb, k, seed=seed), emb
