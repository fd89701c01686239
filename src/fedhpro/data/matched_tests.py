"""Per-client test sets that follow each client's training label distribution (``client_test=matched``).

Under label skew every client of a domain is tested on the same shared test set, so its "own" accuracy is
that set's, the same number for all of them, and the worst 10 % of clients equals the average: fairness
figures that measure nothing. With ``client_test=matched`` each client also gets a test set of its own,
drawn from its domain's test set (all test sets for a client whose domain names none; never from
training data) so that its class proportions are the client's
training proportions ``p_c``: as many samples ``M`` as the test set allows (``M = min(|T|, min_c
floor(a_c / p_c))`` over the classes the client holds, ``a_c`` the test samples of class ``c``), of each class
``round(p_c M)`` (half up, at most ``a_c``), drawn without replacement from a generator of the client's own
(the run's seed and its index). The headline accuracy (per domain and AVG) stays the paper's protocol on the
shared test sets; the per-client accuracies, their fairness statistics and the summary's ``site_accuracy``
come from the matched sets.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import Tensor

from fedhpro.data.client_tests import CLIENT_TESTS  # noqa: F401 (kept importable here: declared torch-free there)
from fedhpro.data.federation import Federation
from fedhpro.errors import ConfigError

#: the generator stream of the matched draw (any fixed number apart from the run's other streams)
MATCHED_STREAM = 0x6D7463


def matched_counts(train_counts: np.ndarray, available: np.ndarray) -> np.ndarray:
    """Test samples per class for a client with training class counts ``train_counts``, given ``available``
    test samples per class: ``round(p_c M)`` (half up, at most ``a_c``) with the largest ``M`` at which every
    held class fits, ``M = min(sum a, min_c floor(a_c / p_c))``; ``p`` over the classes the test set holds (a
    class it lacks cannot be matched); zeros for a client without any of them."""
    testable = np.where(available > 0, train_counts, 0)  # a class the test set lacks cannot be matched
    total = int(testable.sum())
    if total == 0:
        return np.zeros_like(available)
    share = testable / total
    held = share > 0
    size = int(available.sum())
    with np.errstate(divide="ignore"):
        size = min(size, int(np.floor(np.min(available[held] / share[held]))))
    return np.minimum(np.floor(share * size + 0.5).astype(np.int64), available)


def matched_positions(train_labels: Tensor, test_labels: Tensor, num_classes: int, seed: int,
                      client: int) -> np.ndarray:
    """Positions in ``test_labels`` of the client's matched test set (:func:`matched_counts` per class), drawn
    without replacement by ``numpy.random.default_rng([seed, MATCHED_STREAM, client])`` class by class in
    label order; sorted."""
    train = np.bincount(train_labels.detach().cpu().numpy(), minlength=num_classes)[:num_classes]
    y = test_labels.detach().cpu().numpy()
    available = np.bincount(y, minlength=num_classes)[:num_classes]
    counts = matched_counts(train, available)
    rng = np.random.default_rng([seed, MATCHED_STREAM, client])
    picked = [rng.choice(np.flatnonzero(y == c), size=int(n), replace=False) for c, n in enumerate(counts) if n]
    return np.sort(np.concatenate(picked)) if picked else np.empty(0, dtype=np.int64)


def match_client_tests(federation: Federation, seed: int) -> Federation:
    """``federation`` with ``client_matched_tests``: each client's matched test set drawn from its domain's
    shared test set (:meth:`~fedhpro.data.federation.Federation.client_test_name`), and a note saying so.
    A federation that arrives split already tests each client on its own data: refused in one line."""
    if federation.client_tests is not None:
        raise ConfigError("client_test=matched: this federation's clients hold their own test splits already "
                          "(each client is tested on its own data); leave client_test=shared")
    matched: list[tuple[Tensor, Tensor]] = []
    every = (torch.cat([x for x, _ in federation.test_sets.values()]),
             torch.cat([y for _, y in federation.test_sets.values()]))
    for k, data in enumerate(federation.clients):
        # its domain's test set; a client whose domain names none draws from all of them
        x, y = federation.test_sets.get(federation.client_test_name(k), every)
        where = torch.from_numpy(matched_positions(data.y, y, federation.num_classes, seed, k)).to(y.device)
        matched.append((x[where], y[where]))
    sizes = [int(y.shape[0]) for _, y in matched]
    note = (f"client_test=matched: each client's accuracy (client_accuracy, fairness, site_accuracy) is on test "
            f"samples drawn to follow its training labels ({min(sizes)}-{max(sizes)} a client); the accuracy per "
            "domain and AVG stay on the shared test sets")
    return dataclasses.replace(federation, client_matched_tests=matched, notes=[*federation.notes, note])


__all__ = ["CLIENT_TESTS", "match_client_tests", "matched_counts", "matched_positions"]
