"""2-D t-SNE embeddings of features (the paper's Figures 3 and 6), with scikit-learn."""

from __future__ import annotations

import numpy as np

from fedhpro.errors import ConfigError


def tsne_embedding(points: np.ndarray, seed: int = 0, perplexity: float = 30.0) -> np.ndarray:
    """``N x d`` -> ``N x 2`` by t-SNE (PCA initialisation, seeded; perplexity capped below N)."""
    try:
        from sklearn.manifold import TSNE
    except ImportError:
        raise ConfigError("t-SNE needs scikit-learn; pip install scikit-learn") from None
    points = np.asarray(points, dtype=np.float64)
    if points.shape[0] < 5:
        raise ValueError(f"t-SNE needs at least 5 points, got {points.shape[0]}")
    perplexity = min(perplexity, (points.shape[0] - 1) / 3.0)
    return TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=seed).fit_transform(points)
