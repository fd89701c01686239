"""The honest-but-curious server's attacks (fedhpro.privacy.audit) on hand-built uploads with known answers,
and on random uploads, where they must do no better than chance."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhpro import functional
from fedhpro.methods.fedhpro import equations
from fedhpro.privacy.audit import (
    class_means_from_class_gradients,
    class_means_from_classifier_update,
    cosine_rows,
    cosine_to_other_classes,
    label_set_score,
    labels_from_class_rows,
    labels_from_classifier_update,
    membership_advantage,
    total_variation,
)


def test_label_set_score_by_hand():
    # inferred {0, 1}, truth {0, 2}: one hit of two guesses and two held classes; classes 0 and 3 right
    score = label_set_score(torch.tensor([True, True, False, False]), torch.tensor([3, 0, 1, 0]))
    assert score == pytest.approx((0.5, 0.5, 0.5, 0.5))
    perfect = label_set_score(torch.tensor([False, True, True]), torch.tensor([0, 7, 1]))
    assert perfect == pytest.approx((1.0, 1.0, 1.0, 1.0))


def test_total_variation_by_hand():
    assert total_variation(torch.tensor([0.5, 0.5, 0.0]), torch.tensor([1, 0, 1])) == pytest.approx(0.5)
    assert total_variation(torch.tensor([0.0, 1.0]), torch.tensor([4, 0])) == pytest.approx(1.0)
    assert total_variation(torch.tensor([2.0, 6.0]), torch.tensor([1, 3])) == pytest.approx(0.0)


def test_prototype_rows_and_counts_reveal_the_labels_exactly():
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 3, 0, 2])
    features = torch.rand(10, 4)
    labels = torch.tensor([0] * 5 + [2] * 3 + [4] * 2)
    rows, present = functional.local_prototypes(features, labels, 5)  # the clean upload: zero rows for absent classes
    from_counts = labels_from_class_rows(rows, counts)
    assert from_counts.present.tolist() == present.tolist()
    assert total_variation(from_counts.distribution, counts) == pytest.approx(0.0)
    from_rows = labels_from_class_rows(rows, None)
    assert from_rows.present.tolist() == [True, False, True, False, True]
    assert label_set_score(from_rows.present, counts).f1 == 1.0
    # rows alone carry no counts: uniform over the held classes, TV = 1/2 sum |1/3 - n_c / 10|
    assert total_variation(from_rows.distribution, counts) == pytest.approx(0.5 * (abs(1 / 3 - 0.5) + abs(1 / 3 - 0.3)
                                                                                    + abs(1 / 3 - 0.2)))
    # noised counts: rounded; negative ones count as zero share
    noisy = labels_from_class_rows(None, torch.tensor([4.6, 0.4, -1.0, 1.2, 0.0]))
    assert noisy.present.tolist() == [True, False, False, True, False]
    assert noisy.distribution.tolist() == pytest.approx([4.6 / 6.2, 0.4 / 6.2, 0.0, 1.2 / 6.2, 0.0])


def test_one_sgd_step_of_a_head_gives_away_its_label_set_and_shares():
    # a zero-initialised head predicts 1/C for every class, so one SGD step moves b_c by lr * (pi_c - 1/C):
    # positive exactly for the classes held more often than 1/C; computed here by autograd, not by formula
    torch.manual_seed(1)
    head = nn.Linear(6, 5)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    z = torch.rand(40, 6)
    y = torch.tensor([1] * 24 + [3] * 16)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    optimizer = torch.optim.SGD(head.parameters(), lr=0.5)
    F.cross_entropy(head(z), y).backward()
    optimizer.step()
    delta_w, delta_b = head.weight.detach() - before["weight"], head.bias.detach() - before["bias"]
    counts = torch.bincount(y, minlength=5)
    inferred = labels_from_classifier_update(delta_w, delta_b)
    assert inferred.present.tolist() == [False, True, False, True, False]
    # shares of the positive part: (0.6 - 0.2) : (0.4 - 0.2), i.e. 2/3, 1/3 against the true 0.6, 0.4
    assert inferred.distribution.tolist() == pytest.approx([0, 2 / 3, 0, 1 / 3, 0])
    assert total_variation(inferred.distribution, counts) == pytest.approx(0.5 * (abs(2 / 3 - 0.6) + abs(1 / 3 - 0.4)))
    # without the bias, the row sums of Delta W decide (features are non-negative): same set
    assert labels_from_classifier_update(delta_w, None).present.tolist() == [False, True, False, True, False]
    # the row of a held class is lr * mean((1 - 1/C) z_i of that class - 1/C z_j of others): towards its class
    means, present = functional.local_prototypes(z, y, 5)
    cosine = cosine_rows(class_means_from_classifier_update(delta_w), means, present)
    reference = cosine_to_other_classes(class_means_from_classifier_update(delta_w), means, present)
    assert bool((cosine > reference).all())


def test_class_gradients_inverted_to_a_feature_with_the_class_softmax():
    # d = 8 >= C = 5 (the head's W^T has full column rank, so pbar_c is determined); one sample per class:
    # the estimate is a feature the head maps to exactly that sample's softmax (the head sees nothing of
    # the feature outside its row space). The class gradients come from the method's own Eq. 5 code.
    torch.manual_seed(2)
    head = nn.Linear(8, 5).double()
    z = torch.randn(5, 8, dtype=torch.float64)
    y = torch.arange(5)
    gradients, counts = equations.class_gradients(z, y, head, 5)
    estimate = class_means_from_class_gradients(gradients, head.weight, head.bias)
    assert torch.allclose(torch.softmax(head(estimate), dim=1), torch.softmax(head(z), dim=1), atol=1e-6)
    # a feature in the row space of the centred head (I - 11^T/C) W is recovered itself
    centre = torch.eye(5, dtype=torch.float64) - 1.0 / 5
    z_in = (head.weight.detach().T @ centre @ torch.randn(5, 5, dtype=torch.float64)).T
    estimate = class_means_from_class_gradients(equations.class_gradients(z_in, y, head, 5)[0], head.weight, head.bias)
    assert cosine_rows(estimate, z_in, counts > 0).tolist() == pytest.approx([1.0] * 5, abs=1e-6)


def test_cosine_helpers_by_hand():
    estimate = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    truth = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert cosine_rows(estimate, truth, torch.tensor([True, True, False])).tolist() == pytest.approx(
        [1.0, 2 ** -0.5])
    # row 0 against the mean of row 1's truth (0, 1): cosine 0; row 1 against (2, 0): 1/sqrt(2)
    assert cosine_to_other_classes(estimate, truth, torch.tensor([True, True, False])).tolist() == pytest.approx(
        [0.0, 2 ** -0.5])


def test_membership_advantage_by_hand_and_against_a_slow_loop():
    score = membership_advantage(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0]))
    # thresholds 1, 2 (both tied losses), 3, 4: TPR - FPR = 1/3, 2/3 - 1/2, 1 - 1/2, 0 -> 1/2 at 3
    assert score.advantage == pytest.approx(0.5)
    assert score.threshold == 3.0
    # member below non-member in 4 of 6 pairs, one tie (2, 2) counted half: 4.5 / 6
    assert score.auc == pytest.approx(0.75)
    torch.manual_seed(3)
    members = torch.randint(0, 8, (37,)).double()
    others = torch.randint(2, 10, (29,)).double()
    fast = membership_advantage(members, others)
    slow_auc = sum(1.0 if m < o else 0.5 if m == o else 0.0 for m, o in itertools.product(members, others))
    slow_auc /= members.numel() * others.numel()
    slow_advantage = max([0.0] + [float((members <= t).double().mean() - (others <= t).double().mean())
                                  for t in torch.cat([members, others])])
    assert fast.auc == pytest.approx(slow_auc)
    assert fast.advantage == pytest.approx(slow_advantage)


def test_membership_separable_and_reversed():
    separable = membership_advantage(torch.tensor([0.1, 0.2]), torch.tensor([0.5, 0.9, 1.0]))
    assert (separable.advantage, separable.auc) == pytest.approx((1.0, 1.0))
    reversed_ = membership_advantage(torch.tensor([0.5, 0.9]), torch.tensor([0.1, 0.2]))
    assert (reversed_.advantage, reversed_.auc) == pytest.approx((0.0, 0.0))


def test_attacks_on_random_uploads_are_at_chance():
    generator = torch.Generator().manual_seed(4)
    # membership: members and non-members from one distribution
    same = membership_advantage(torch.rand(5000, generator=generator), torch.rand(5000, generator=generator))
    assert same.advantage < 0.05
    assert abs(same.auc - 0.5) < 0.02
    # label sets from random bias updates against random true label sets: accuracy 1/2 per class
    accuracies = []
    for _ in range(400):
        truth = (torch.rand(10, generator=generator) < 0.5).long() * 5
        truth[int(torch.randint(0, 10, (1,), generator=generator))] = 5
        guess = labels_from_classifier_update(torch.zeros(10, 4), torch.randn(10, generator=generator))
        accuracies.append(label_set_score(guess.present, truth).accuracy)
    assert abs(sum(accuracies) / len(accuracies) - 0.5) < 0.03
    # class means from random class gradients: no better than chance against the true (positive) features
    cosines = []
    for _ in range(200):
        weight = torch.randn(10, 16, generator=generator)
        truth = torch.rand(10, 16, generator=generator)
        estimate = class_means_from_class_gradients(torch.randn(10, 16, generator=generator), weight)
        cosines.append(float(cosine_rows(estimate, truth, torch.ones(10, dtype=torch.bool)).mean()))
    assert abs(sum(cosines) / len(cosines)) < 0.05


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="at least one member"):
        membership_advantage(torch.tensor([]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="true counts"):
        label_set_score(torch.tensor([True]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="all zero"):
        total_variation(torch.tensor([1.0]), torch.tensor([0]))
