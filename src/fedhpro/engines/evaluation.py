"""What a round measures of its clients: their training metrics, n_k-weighted (:func:`weighted_mean`), and their
evaluation counts pooled into per-test-set accuracy and AVG (:class:`TestCount`, :func:`pool_accuracy`), with a
client's test count bounded as a claim like its training size (``aggregation.max_share`` / ``max_ratio``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedhpro.aggregation import claim_cap


def weighted_mean(metrics: Sequence[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Mean of each client metric, weighted by the clients' sample counts."""
    total = sum(n for n, _ in metrics) or 1
    names = sorted({name for _, m in metrics for name in m})
    return {name: sum(n * m.get(name, 0.0) for n, m in metrics) / total for name in names}


@dataclass(frozen=True)
class TestCount:
    """One evaluation: ``correct`` of ``total`` test samples of test set ``name`` (a domain, or ``"all"``)."""

    name: str
    correct: int
    total: int

    @property
    def accuracy(self) -> float:
        return 100.0 * self.correct / max(self.total, 1)


def pool_accuracy(counts: Sequence[TestCount], order: Sequence[str] | None = None,
                  max_share: float = 1.0, max_ratio: float = 0.0) -> dict[str, float]:
    """Accuracy in percent per test set, pooling the counts of every client tested on it
    (``100 * sum correct / sum total``, i.e. weighted by test samples), plus ``AVG``: the
    unweighted mean over test sets (the paper's AVG over domains).

    ``order``: the test sets' order in the result (default: first appearance);
    test sets without any counted sample are left out. ``max_share`` (``aggregation.max_share``): a
    client's test count is a claim too, so within a test set no client weighs more than this share of
    the pooled count (:func:`~fedhpro.aggregation.share_cap` over the test set's counts, one a client): a
    client above the cap counts with its own accuracy at the cap's weight. ``max_ratio`` (where test sizes
    are claims: ``aggregation.max_ratio``): nor more than that many times the median count of the test set's
    clients (:func:`~fedhpro.aggregation.claim_cap`). Where no cap binds the result is the plain pooled
    ratio, to the bit.

    Where test sets are claims too (``max_ratio > 0``: nobody vouches for the sites, who name their own test
    set), ``AVG`` weighs each test set by its number of tested clients, up to the median client's test set's
    (:func:`headline_weights`): one site naming a test set of its own weighs in ``AVG`` as one site of the
    typical test set, not as much as all the others. Where every test set has as many clients (one each, or
    the same number) that is the unweighted mean, to the bit.
    """
    correct: dict[str, float] = {}
    total: dict[str, float] = {}
    caps = {name: claim_cap([c.total for c in counts if c.name == name], max_share, max_ratio)
            for name in {c.name for c in counts}} if max_share < 1.0 or max_ratio > 0 else {}
    for count in counts:
        cap = caps.get(count.name, math.inf)
        if count.total > cap:  # the client's own accuracy, at the capped weight
            weight = float(math.floor(cap)) or 1.0
            hits, size = count.correct * weight / count.total, weight
        else:
            hits, size = int(count.correct), int(count.total)
        correct[count.name] = correct.get(count.name, 0) + hits
        total[count.name] = total.get(count.name, 0) + size
    names = [name for name in (order if order is not None else correct) if total.get(name, 0) > 0]
    accuracy = {name: 100.0 * correct[name] / total[name] for name in names}
    if not names:
        accuracy["AVG"] = float("nan")
    elif max_ratio > 0:
        weights = headline_weights([c.name for c in counts])
        if all(weights[name] == 1.0 for name in names):
            accuracy["AVG"] = float(np.mean([accuracy[name] for name in names]))
        else:
            mass = sum(weights[name] for name in names)
            accuracy["AVG"] = float(sum(weights[name] * accuracy[name] for name in names) / mass)
    else:
        accuracy["AVG"] = float(np.mean([accuracy[name] for name in names]))
    return accuracy


def headline_weights(names: Sequence[str]) -> dict[str, float]:
    """Each test set's weight in ``AVG`` where test sets are claims: ``min(1, n_d / m)``, ``n_d`` the clients
    tested on test set ``d`` (``names``: one entry a client) and ``m`` the median over clients of their test
    set's ``n_d``. Examples: ``[all] x 9 + [lab]`` gives ``all`` 1 and ``lab`` 1/9; one test set a client, or
    the same number each, gives 1 each."""
    sizes: dict[str, int] = {}
    for name in names:
        sizes[name] = sizes.get(name, 0) + 1
    typical = float(np.median([sizes[name] for name in names])) if names else 1.0
    return {name: min(1.0, size / typical) for name, size in sizes.items()}


__all__ = ["TestCount", "pool_accuracy", "headline_weights", "weighted_mean"]
