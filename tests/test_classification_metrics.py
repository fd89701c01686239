"""Balanced accuracy, macro-F1, AUROC and the confusion matrix against scikit-learn on the same predictions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn import metrics as sk

from fedhpro.metrics.classification import (
    auroc,
    balanced_accuracy,
    classification_figures,
    confusion_matrix,
    macro_f1,
)


def draw(n: int, classes: int, seed: int, ties: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    labels[:classes] = torch.arange(classes)  # every class present
    logits = torch.randn(n, classes, generator=g) + 1.5 * torch.nn.functional.one_hot(labels, classes)
    if ties:
        logits = (logits * 2).round() / 2  # many equal scores
    scores = logits.softmax(1)
    return labels, scores.argmax(1), scores


@pytest.mark.parametrize("classes, seed, ties", [(2, 0, False), (2, 1, True), (3, 2, False), (10, 3, False),
                                                 (10, 4, True), (5, 5, True)])
def test_against_scikit_learn(classes, seed, ties):
    labels, predicted, scores = draw(300, classes, seed, ties)
    y, p, s = labels.numpy(), predicted.numpy(), scores.double().numpy()
    matrix = confusion_matrix(labels, predicted, classes)
    assert matrix.tolist() == sk.confusion_matrix(y, p, labels=list(range(classes))).tolist()
    assert balanced_accuracy(matrix) == pytest.approx(sk.balanced_accuracy_score(y, p), abs=1e-12)
    assert macro_f1(matrix) == pytest.approx(sk.f1_score(y, p, labels=list(range(classes)), average="macro",
                                                         zero_division=0), abs=1e-12)
    expected = (sk.roc_auc_score(y, s[:, 1]) if classes == 2
                else sk.roc_auc_score(y, s, multi_class="ovr", average="macro"))
    assert auroc(labels, scores) == pytest.approx(expected, abs=1e-9)


def test_a_class_absent_from_the_labels():
    labels, predicted, scores = draw(200, 4, 6)
    keep = labels != 3
    labels, predicted, scores = labels[keep], predicted[keep], scores[keep]
    y, p, s = labels.numpy(), predicted.numpy(), scores.double().numpy()
    matrix = confusion_matrix(labels, predicted, 4)
    # balanced accuracy over the classes present; macro-F1 over all four (class 3: predicted only, F1 0)
    assert balanced_accuracy(matrix) == pytest.approx(sk.balanced_accuracy_score(y, p), abs=1e-12)
    assert macro_f1(matrix) == pytest.approx(sk.f1_score(y, p, labels=[0, 1, 2, 3], average="macro",
                                                         zero_division=0), abs=1e-12)
    # AUROC: the mean of the present classes' one-vs-rest areas (scikit-learn refuses the absent class)
    by_class = [sk.roc_auc_score(y == c, s[:, c]) for c in range(3)]
    assert auroc(labels, scores) == pytest.approx(np.mean(by_class), abs=1e-9)


def test_hand_computed_binary_case_and_undefined_values():
    labels = torch.tensor([0, 0, 1, 1])
    scores = torch.tensor([[0.9, 0.1], [0.4, 0.6], [0.65, 0.35], [0.2, 0.8]])
    # by hand: positives score 0.35, 0.8; negatives 0.1, 0.6; pairs won: (0.35>0.1), (0.8>0.1), (0.8>0.6) = 3 / 4
    assert auroc(labels, scores) == 0.75
    matrix = confusion_matrix(labels, scores.argmax(1), 2)
    assert matrix.tolist() == [[1, 1], [1, 1]]
    assert balanced_accuracy(matrix) == 0.5 and macro_f1(matrix) == 0.5
    assert math.isnan(auroc(torch.tensor([1, 1]), torch.tensor([[0.2, 0.8], [0.6, 0.4]])))
    figures = classification_figures(torch.tensor([1, 1]), torch.tensor([1, 0]), torch.tensor([[0.2, 0.8],
                                                                                                [0.6, 0.4]]), 2)
    assert figures["auroc"] is None and figures["balanced_accuracy"] == 50.0
    assert figures["confusion_matrix"] == [[0, 0], [1, 1]]
