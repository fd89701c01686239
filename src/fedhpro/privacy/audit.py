"""Attacks of an honest-but-curious server on what one client uploads, as pure functions.

The server follows the protocol but reads every reply it is handed. These
functions are what it can compute from one reply (and the weights it sent),
and how close that gets to the client's truth; ``bench/privacy_audit.py``
plays the server on real runs and reports them.

(a) Label set and label distribution. Prototype methods upload one row per
class and the class counts: a class is held when its count is positive (or,
without counts, when its row is longer than ``threshold``: zero rows are the
classes a client does not hold). FedAvg-family methods upload weights: the
update of the classifier's bias ``Delta b_c`` sums ``-(p_ic - 1[y_i = c])``
over the local steps, positive for a class the client holds often enough and
negative for one it does not hold (its softmax mass is only pushed down), so
``Delta b_c > 0`` is the inferred label set and its positive part the inferred
distribution (the row sums of ``Delta W`` when the head has no bias).

(b) Class-mean features. Prototypes are the class means. A linear head's class
gradient (Eq. 5) is ``g_c = W^T (pbar_c - e_c)`` with ``pbar_c`` the class's
mean softmax: solving for ``pbar_c`` and then for a feature ``z`` with
``softmax(W z + b) = pbar_c`` (minimum norm, logits matched up to their common
shift) recovers the part of the class mean that the head sees
(:func:`class_means_from_class_gradients`). A FedAvg update's classifier row
``Delta W_c`` sums ``(1[y_i = c] - p_ic) z_i``: for a held class it leans
towards the class's features; the row itself is the estimate.

(c) Membership: a loss-threshold attack on the model a client returns (its
training samples have lower loss than held-out ones when it overfits); its
advantage is the best ``TPR - FPR`` over thresholds, with the ROC AUC beside it
(:func:`membership_advantage`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class LabelInference(NamedTuple):
    """What the server infers about one client's labels: which classes it holds and their shares."""

    present: Tensor  # C bool
    distribution: Tensor  # C float64, sums to 1


class LabelScore(NamedTuple):
    """How well an inferred label set matches the true one (presence per class as a binary decision)."""

    accuracy: float  # fraction of the C classes whose presence is inferred right
    precision: float
    recall: float
    f1: float


class MembershipScore(NamedTuple):
    """A loss-threshold membership attack: ``advantage = max over thresholds of TPR - FPR`` (members are
    predicted when their loss is at most the threshold), ``auc`` the ROC AUC (0.5: chance)."""

    advantage: float
    auc: float
    threshold: float


def _uniform_over(present: Tensor) -> Tensor:
    share = present.to(torch.float64)
    total = share.sum()
    return share / total if total > 0 else torch.full_like(share, 1.0 / max(share.numel(), 1))


def labels_from_class_rows(rows: Tensor | None, counts: Tensor | None, threshold: float = 0.0) -> LabelInference:
    """The label set and distribution a server reads from a prototype-style upload.

    ``counts`` (the uploaded ``class_counts``, possibly noised) decide when given: a class is held when its
    count rounds to at least 1, and the distribution is the clamped counts normalised. Otherwise ``rows``
    (``C x ...``, one row per class) decide: a class is held when its row's L2 norm exceeds ``threshold``
    (0 for clean uploads, whose absent rows are zero; the expected norm of pure noise for noised ones), the
    distribution uniform over the held classes (rows carry no counts)."""
    if counts is not None:
        values = counts.detach().to(torch.float64).reshape(-1)
        present = values.round() >= 1
        clamped = values.clamp(min=0.0)
        total = clamped.sum()
        distribution = clamped / total if total > 0 else _uniform_over(present)
        return LabelInference(present, distribution)
    if rows is None:
        raise ValueError("labels_from_class_rows needs rows or counts")
    norms = rows.detach().to(torch.float64).reshape(rows.shape[0], -1).norm(dim=1)
    present = norms > threshold
    return LabelInference(present, _uniform_over(present))


def labels_from_classifier_update(delta_weight: Tensor, delta_bias: Tensor | None = None) -> LabelInference:
    """The label set and distribution read from a classifier update ``Delta W`` (``C x d``) and ``Delta b``
    (``C``): the score of class c is ``Delta b_c`` (the row sum of ``Delta W`` without a bias); held are the
    classes with a positive score (the best-scoring one if none is), the distribution is the positive part
    of the scores normalised."""
    if delta_bias is not None:
        score = delta_bias.detach().to(torch.float64).reshape(-1)
    else:
        score = delta_weight.detach().to(torch.float64).reshape(delta_weight.shape[0], -1).sum(dim=1)
    present = score > 0
    if not bool(present.any()):
        present = torch.zeros_like(present)
        present[int(score.argmax())] = True
    positive = score.clamp(min=0.0)
    total = positive.sum()
    distribution = positive / total if total > 0 else _uniform_over(present)
    return LabelInference(present, distribution)


def label_set_score(present: Tensor, true_counts: Tensor) -> LabelScore:
    """Accuracy, precision, recall and F1 of the inferred ``present`` (C bool) against the classes the
    client really holds (``true_counts > 0``). Precision (recall) is 1 when nothing is inferred (held)."""
    truth = true_counts.reshape(-1) > 0
    guess = present.reshape(-1).bool()
    if guess.shape != truth.shape:
        raise ValueError(f"inferred {tuple(guess.shape)} classes, true counts of {tuple(truth.shape)}")
    hits = int((guess & truth).sum())
    predicted, actual = int(guess.sum()), int(truth.sum())
    precision = hits / predicted if predicted else 1.0
    recall = hits / actual if actual else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    accuracy = float((guess == truth).to(torch.float64).mean())
    return LabelScore(accuracy, precision, recall, f1)


def total_variation(distribution: Tensor, true_counts: Tensor) -> float:
    """``1/2 sum_c |q_c - p_c|`` between an inferred distribution and the true label distribution
    (``true_counts`` normalised): 0 when equal, 1 when disjoint."""
    q = distribution.detach().to(torch.float64).reshape(-1)
    p = true_counts.detach().to(torch.float64).reshape(-1)
    if q.shape != p.shape:
        raise ValueError(f"distribution over {q.numel()} classes, true counts over {p.numel()}")
    if p.sum() <= 0:
        raise ValueError("the true counts are all zero")
    q = q / q.sum() if q.sum() > 0 else torch.full_like(q, 1.0 / q.numel())
    return float(0.5 * (q - p / p.sum()).abs().sum())


def class_means_from_class_gradients(gradients: Tensor, weight: Tensor, bias: Tensor | None = None,
                                     floor: float = 1e-6) -> Tensor:
    """Estimates (``C x d``) of the class-mean features behind class gradients ``g_c = W^T (pbar_c - e_c)``
    (Eq. 5 through a linear head ``W`` (``C x d``), ``b``).

    Per class: ``u = argmin ||W^T u - g_c||`` gives ``pbar_c = u + e_c`` (clamped to ``[floor, 1]``); then the
    minimum-norm ``z`` whose softmax ``softmax(W z + b)`` is ``pbar_c`` (logits matched up to their common
    shift) is the estimate. Needs ``d >= C`` (else ``pbar_c`` is not determined). When ``pbar_c`` is the
    softmax of one feature, the estimate has that softmax, and is that feature when it lies in the row space
    of the centred head ``(I - 11^T/C) W``; of a class mean it keeps the part the head sees."""
    W = weight.detach().to(torch.float64)
    C, d = W.shape
    if d < C:
        raise ValueError(f"class gradients of a head with d={d} < C={C} classes do not determine the class softmax")
    g = gradients.detach().to(torch.float64).reshape(C, d)
    b = torch.zeros(C, dtype=torch.float64) if bias is None else bias.detach().to(torch.float64).reshape(C)
    u = torch.linalg.lstsq(W.T, g.T).solution.T  # C x C: row c is pbar_c - e_c
    pbar = (u + torch.eye(C, dtype=torch.float64)).clamp(min=floor, max=1.0)
    # softmax ignores a common shift of the logits: match them centred, P (W z + b) = P log pbar_c
    centre = torch.eye(C, dtype=torch.float64) - 1.0 / C
    solution = torch.linalg.pinv(centre @ W) @ (centre @ (pbar.log() - b).T)  # d x C
    return solution.T.to(gradients.dtype)


def class_means_from_classifier_update(delta_weight: Tensor) -> Tensor:
    """Estimates (``C x d``) of the class-mean features behind a FedAvg classifier update: its rows."""
    return delta_weight.detach().reshape(delta_weight.shape[0], -1).clone()


def cosine_rows(estimate: Tensor, truth: Tensor, classes: Tensor) -> Tensor:
    """The cosine of each estimated row to the true row, over the ``classes`` (C bool) selected (0 where
    either row is zero)."""
    e = estimate.detach().to(torch.float64).reshape(estimate.shape[0], -1)[classes]
    t = truth.detach().to(torch.float64).reshape(truth.shape[0], -1)[classes]
    norms = e.norm(dim=1) * t.norm(dim=1)
    dots = (e * t).sum(dim=1)
    return torch.where(norms > 0, dots / norms.clamp(min=1e-300), torch.zeros_like(dots))


def cosine_to_other_classes(estimate: Tensor, truth: Tensor, classes: Tensor) -> Tensor:
    """The reference for :func:`cosine_rows`: each selected estimated row's cosine to the mean of the OTHER
    selected classes' true rows. Features after a ReLU are non-negative, so any two of them have a positive
    cosine; how much the cosine to the right class exceeds this is what the estimate knows about that
    class. NaN for a class with no other selected class."""
    index = classes.nonzero().squeeze(1)
    out = torch.full((index.numel(),), float("nan"), dtype=torch.float64)
    t = truth.detach().to(torch.float64).reshape(truth.shape[0], -1)
    for position, c in enumerate(index.tolist()):
        others = index[index != c]
        if others.numel():
            reference = t[others].mean(dim=0, keepdim=True)
            mask = torch.ones(1, dtype=torch.bool)
            out[position] = cosine_rows(estimate[c:c + 1], reference, mask)[0]
    return out


def membership_advantage(member_losses: Tensor, nonmember_losses: Tensor) -> MembershipScore:
    """The loss-threshold membership attack: predict "member" when a sample's loss is at most ``t``.

    ``advantage = max_t TPR(t) - FPR(t)`` over every threshold (including none: 0), ``auc`` the probability
    that a random member has a lower loss than a random non-member (ties count half)."""
    members = member_losses.detach().to(torch.float64).reshape(-1)
    others = nonmember_losses.detach().to(torch.float64).reshape(-1)
    if members.numel() == 0 or others.numel() == 0:
        raise ValueError("membership_advantage needs at least one member and one non-member loss")
    losses = torch.cat([members, others])
    is_member = torch.cat([torch.ones_like(members), torch.zeros_like(others)])
    order = torch.argsort(losses, stable=True)
    losses, is_member = losses[order], is_member[order]
    tpr = torch.cumsum(is_member, 0) / members.numel()
    fpr = torch.cumsum(1 - is_member, 0) / others.numel()
    last_of_tie = torch.ones_like(losses, dtype=torch.bool)
    last_of_tie[:-1] = losses[1:] != losses[:-1]  # a threshold takes every sample of equal loss at once
    gap = torch.where(last_of_tie, tpr - fpr, torch.full_like(tpr, -1.0))
    best = int(gap.argmax())
    advantage = max(float(gap[best]), 0.0)
    threshold = float(losses[best]) if float(gap[best]) > 0 else float("-inf")
    # AUC by ranks (Mann-Whitney U), ties at their average rank
    _, counts = torch.unique_consecutive(losses, return_counts=True)
    ends = torch.cumsum(counts, 0).to(torch.float64)
    ranks = torch.repeat_interleave(ends - (counts.to(torch.float64) - 1) / 2, counts)
    # rank 1 = lowest loss; members should rank low, so AUC = P(member loss < non-member loss)
    member_rank_sum = float((ranks * is_member).sum())
    m, n = members.numel(), others.numel()
    u_members_above = member_rank_sum - m * (m + 1) / 2  # pairs where the member's loss is higher
    auc = 1.0 - u_members_above / (m * n)
    return MembershipScore(advantage, auc, threshold)
