"""Pure measurements of a classifier's outputs and of feature / prototype geometry (issue 27's study).

Everything here takes tensors and returns numbers or tensors; nothing trains or
reads files. Classes with no sample are NaN where a per-class value is asked
for, and are left out of means over classes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedhpro.metrics.prototypes import class_means

__all__ = [
    "per_class_accuracy",
    "cosine_matrix",
    "mean_offdiagonal_cosine",
    "max_offdiagonal_cosine",
    "within_class_cosine",
    "matched_cosine",
]


def per_class_accuracy(predictions: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """``C`` accuracies in percent (float64): the share of class c's samples predicted c; NaN for a class
    without samples."""
    predictions, labels = predictions.reshape(-1).long(), labels.reshape(-1).long()
    if predictions.shape != labels.shape:
        raise ValueError(f"predictions {tuple(predictions.shape)} and labels {tuple(labels.shape)} differ in size")
    totals = torch.bincount(labels, minlength=num_classes)[:num_classes].double()
    correct = torch.bincount(labels[predictions == labels], minlength=num_classes)[:num_classes].double()
    accuracy = 100.0 * correct / totals.clamp(min=1.0)
    return torch.where(totals > 0, accuracy, torch.full_like(accuracy, float("nan")))


def cosine_matrix(vectors: Tensor, eps: float = 1e-12) -> Tensor:
    """``C x C`` cosines between the rows (float64); a zero row has cosine 0 with everything."""
    vectors = vectors.double()
    units = vectors / vectors.norm(dim=1, keepdim=True).clamp(min=eps)
    return units @ units.T


def _offdiagonal(vectors: Tensor, present: Tensor | None) -> Tensor:
    if present is not None:
        vectors = vectors[present]
    n = vectors.shape[0]
    if n < 2:
        raise ValueError("need at least two vectors for an inter-class cosine")
    cosines = cosine_matrix(vectors)
    return cosines[~torch.eye(n, dtype=torch.bool, device=cosines.device)]


def mean_offdiagonal_cosine(vectors: Tensor, present: Tensor | None = None) -> float:
    """The mean cosine over ordered pairs of different rows (of the ``present`` ones): 0 for orthogonal
    classes, ``-1/(C-1)`` for a regular simplex, 1 when they all point the same way."""
    return float(_offdiagonal(vectors, present).mean())


def max_offdiagonal_cosine(vectors: Tensor, present: Tensor | None = None) -> float:
    """The largest cosine between two different rows: the closest pair of classes."""
    return float(_offdiagonal(vectors, present).max())


def within_class_cosine(features: Tensor, labels: Tensor, num_classes: int) -> float:
    """The mean over samples of the cosine between a sample's feature and its class mean (1: every class
    collapsed onto one direction)."""
    means, _ = class_means(features, labels, num_classes)
    features = features.reshape(features.shape[0], -1).double()
    own = means.double()[labels]
    cosines = (features * own).sum(1) / (features.norm(dim=1) * own.norm(dim=1)).clamp(min=1e-12)
    return float(cosines.mean())


def matched_cosine(a: Tensor, b: Tensor, present: Tensor | None = None) -> float:
    """The mean over classes of ``cos(a_c, b_c)``: how well class means line up with their targets."""
    if a.shape != b.shape:
        raise ValueError(f"shapes {tuple(a.shape)} and {tuple(b.shape)} differ")
    a, b = a.double(), b.double()
    cosines = (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp(min=1e-12)
    if present is not None:
        cosines = cosines[present]
    return float(cosines.mean())
