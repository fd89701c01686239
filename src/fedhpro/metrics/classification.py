"""The classification figures papers report besides accuracy, from labels, predicted classes and class scores:
the confusion matrix, balanced accuracy, macro-F1 and AUROC (binary, and one-vs-rest for several classes).

Pure functions on tensors, checked against scikit-learn's definitions in the tests: ``balanced_accuracy``
is sklearn's ``balanced_accuracy_score`` (the mean recall over the classes present in the labels),
``macro_f1`` its ``f1_score(average="macro", labels=range(C))`` with ``zero_division=0`` (a class never
predicted nor present counts 0), ``auroc`` its ``roc_auc_score`` (binary: the positive class's score;
otherwise ``multi_class="ovr", average="macro"`` over the classes present in the labels).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def confusion_matrix(labels: Tensor, predicted: Tensor, num_classes: int) -> Tensor:
    """``C x C`` int64 counts: row = true class, column = predicted class."""
    labels, predicted = labels.long().cpu(), predicted.long().cpu()
    return torch.bincount(labels * num_classes + predicted, minlength=num_classes * num_classes).view(
        num_classes, num_classes)


def balanced_accuracy(matrix: Tensor) -> float:
    """Mean over the classes present (a non-zero row) of their recall, in [0, 1]; NaN with no sample."""
    rows = matrix.sum(1)
    present = rows > 0
    if not bool(present.any()):
        return math.nan
    recall = matrix.diagonal()[present].double() / rows[present].double()
    return float(recall.mean())


def macro_f1(matrix: Tensor) -> float:
    """Unweighted mean over all ``C`` classes of ``2 TP / (2 TP + FP + FN)`` (0 where that is 0 / 0)."""
    tp = matrix.diagonal().double()
    fp = matrix.sum(0).double() - tp
    fn = matrix.sum(1).double() - tp
    denominator = 2 * tp + fp + fn
    f1 = torch.where(denominator > 0, 2 * tp / denominator.clamp(min=1), torch.zeros_like(tp))
    return float(f1.mean())


def _binary_auroc(positive: Tensor, scores: Tensor) -> float:
    """Area under the ROC curve of ``scores`` for the boolean ``positive``: the Mann-Whitney statistic, tied
    scores counting one half (average ranks); NaN where one side is empty."""
    n_pos = int(positive.sum())
    n_neg = int(positive.numel()) - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    scores = scores.double()
    order = torch.argsort(scores, stable=True)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    # average rank of each run of equal scores (1-based)
    unique, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    average = ends - (counts.double() - 1) / 2
    ranks[order] = average[inverse]
    rank_sum = float(ranks[positive].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def auroc(labels: Tensor, scores: Tensor) -> float:
    """AUROC of class scores ``scores`` (N x C, e.g. softmax probabilities) for ``labels``: with 2 classes the
    positive class's (class 1) score; with more, the unweighted mean over the classes present in ``labels``
    (and absent from some sample) of each class's one-vs-rest AUROC. NaN where it is undefined (one class)."""
    labels = labels.long().cpu()
    scores = scores.detach().double().cpu()
    if scores.shape[1] == 2:
        return _binary_auroc(labels == 1, scores[:, 1])
    areas = [_binary_auroc(labels == c, scores[:, c]) for c in torch.unique(labels).tolist()]
    areas = [a for a in areas if not math.isnan(a)]
    return float(sum(areas) / len(areas)) if areas else math.nan


def classification_figures(labels: Tensor, predicted: Tensor, scores: Tensor, num_classes: int) -> dict[str, Any]:
    """JSON-ready figures of one test set (or several pooled): ``balanced_accuracy``, ``macro_f1`` and
    ``auroc`` in percent (None where undefined), and the ``confusion_matrix`` (rows: true class)."""
    matrix = confusion_matrix(labels, predicted, num_classes)

    def percent(value: float) -> float | None:
        return None if math.isnan(value) else 100.0 * value

    return {"balanced_accuracy": percent(balanced_accuracy(matrix)), "macro_f1": percent(macro_f1(matrix)),
            "auroc": percent(auroc(labels, scores)), "confusion_matrix": matrix.tolist()}


__all__ = ["auroc", "balanced_accuracy", "classification_figures", "confusion_matrix", "macro_f1"]
