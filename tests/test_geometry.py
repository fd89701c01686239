"""fedhpro.metrics.geometry against hand-computed values and slow loops."""

import math

import pytest
import torch

from fedhpro.metrics import geometry


def test_per_class_accuracy_by_hand():
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    predictions = torch.tensor([0, 0, 1, 2, 1, 0, 2])
    accuracy = geometry.per_class_accuracy(predictions, labels, 4)
    assert accuracy[:3].tolist() == [50.0, 50.0, 100.0]
    assert math.isnan(float(accuracy[3]))  # class 3 has no sample


def test_per_class_accuracy_matches_a_loop():
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 5, (200,), generator=generator)
    predictions = torch.randint(0, 5, (200,), generator=generator)
    accuracy = geometry.per_class_accuracy(predictions, labels, 5)
    for c in range(5):
        rows = [i for i in range(200) if labels[i] == c]
        expected = 100.0 * sum(int(predictions[i] == c) for i in rows) / len(rows)
        assert float(accuracy[c]) == pytest.approx(expected, abs=1e-12)


def test_per_class_accuracy_refuses_mismatched_sizes():
    with pytest.raises(ValueError, match="differ in size"):
        geometry.per_class_accuracy(torch.zeros(3), torch.zeros(4), 2)


def test_offdiagonal_cosine_of_a_regular_simplex_and_orthogonal_rows():
    num_classes = 4
    simplex = torch.eye(num_classes) - 1.0 / num_classes  # centred basis: a regular simplex
    assert geometry.mean_offdiagonal_cosine(simplex) == pytest.approx(-1.0 / (num_classes - 1), abs=1e-12)
    assert geometry.max_offdiagonal_cosine(simplex) == pytest.approx(-1.0 / (num_classes - 1), abs=1e-12)
    assert geometry.mean_offdiagonal_cosine(torch.eye(3) * 5.0) == pytest.approx(0.0, abs=1e-15)


def test_offdiagonal_cosine_matches_a_loop_and_respects_present():
    generator = torch.Generator().manual_seed(1)
    vectors = torch.randn(5, 7, generator=generator, dtype=torch.float64)
    present = torch.tensor([True, False, True, True, False])
    kept = [i for i in range(5) if present[i]]
    pairs = [(i, j) for i in kept for j in kept if i != j]

    def cos(i, j):
        return float(vectors[i] @ vectors[j] / (vectors[i].norm() * vectors[j].norm()))

    expected = sum(cos(i, j) for i, j in pairs) / len(pairs)
    assert geometry.mean_offdiagonal_cosine(vectors, present) == pytest.approx(expected, abs=1e-12)
    assert geometry.max_offdiagonal_cosine(vectors, present) == pytest.approx(max(cos(i, j) for i, j in pairs))
    with pytest.raises(ValueError, match="at least two"):
        geometry.mean_offdiagonal_cosine(vectors[:1])


def test_within_class_cosine_by_hand():
    # class 0: (1, 0) and (0, 1), mean (0.5, 0.5): each at 45 degrees; class 1: one sample, cosine 1
    features = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 4.0]])
    labels = torch.tensor([0, 0, 1])
    expected = (2 * math.cos(math.pi / 4) + 1.0) / 3
    assert geometry.within_class_cosine(features, labels, 2) == pytest.approx(expected, abs=1e-12)


def test_matched_cosine_by_hand():
    a = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    b = torch.tensor([[2.0, 0.0], [1.0, 0.0], [-1.0, -1.0]])
    assert geometry.matched_cosine(a, b) == pytest.approx((1.0 + 0.0 - 1.0) / 3, abs=1e-12)
    assert geometry.matched_cosine(a, b, torch.tensor([True, True, False])) == pytest.approx(0.5, abs=1e-12)
    with pytest.raises(ValueError, match="differ"):
        geometry.matched_cosine(a, b[:2])
