"""``client_test=matched``: each client's own accuracy on test samples drawn to follow its training labels."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import FEATURE_DIM, TinyNet, make_federation

import fedhpro
from fedhpro.data.federation import Federation
from fedhpro.data.matched_tests import match_client_tests, matched_counts, matched_positions
from fedhpro.errors import ConfigError


def test_matched_counts_by_hand():
    # shares 3/4 and 1/4; M = min(20, floor(5 / 0.75) = 6, floor(5 / 0.25) = 20) = 6: round(4.5) = 5, round(1.5) = 2
    assert matched_counts(np.array([30, 10, 0, 0]), np.array([5, 5, 5, 5])).tolist() == [5, 2, 0, 0]
    # balanced training, enough of everything: the whole test set
    assert matched_counts(np.array([4, 4, 4, 4]), np.array([6, 6, 6, 6])).tolist() == [6, 6, 6, 6]
    # a class the test set lacks cannot be matched: the others keep their proportions (1:1)
    assert matched_counts(np.array([10, 10, 10, 0]), np.array([0, 3, 8, 2])).tolist() == [0, 3, 3, 0]
    assert matched_counts(np.array([0, 0, 0, 0]), np.array([3, 3, 3, 3])).tolist() == [0, 0, 0, 0]


def skewed() -> Federation:
    """Four clients under label skew, of domains "a" and "b" (the names of the two test sets)."""
    federation = make_federation([30, 24, 18, 12], classes=[[0, 0, 0, 1], [1, 2], [2, 3, 3], [0, 1, 2, 3]],
                                 seed=4, test_size=80)
    federation.client_domains = ["a", "b", "a", "b"]
    return federation


def test_each_matched_set_follows_its_clients_labels_and_comes_from_the_test_set():
    federation = skewed()
    matched = match_client_tests(federation, seed=3)
    assert federation.client_matched_tests is None and matched.client_matched_tests is not None
    training_rows = {tuple(r.flatten().tolist()) for c in federation.clients for r in c.x}
    for k, (client, (x, y)) in enumerate(zip(federation.clients, matched.client_matched_tests)):
        test_x, test_y = federation.test_sets[federation.client_test_name(k)]
        train = np.bincount(client.y.numpy(), minlength=4)
        expected = matched_counts(train, np.bincount(test_y.numpy(), minlength=4))
        assert np.bincount(y.numpy(), minlength=4).tolist() == expected.tolist()  # counted directly
        assert expected.sum() > 0
        # the proportions follow training's: within the rounding of one sample a class
        assert np.all(np.abs(expected - train / train.sum() * expected.sum()) <= 1.0)
        positions = matched_positions(client.y, test_y, 4, 3, k)
        assert len(set(positions.tolist())) == len(positions)  # without replacement
        where = torch.from_numpy(positions)
        assert torch.equal(x, test_x[where]) and torch.equal(y, test_y[where])
        assert not any(tuple(r.flatten().tolist()) in training_rows for r in x)  # never a training sample
    assert any(note.startswith("client_test=matched") for note in matched.notes)


def test_a_federation_with_its_own_test_splits_is_refused():
    own = Federation.from_tensors([(torch.randn(6, 3), torch.tensor([0, 1, 0, 1, 0, 1]))] * 2,
                                  [(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))] * 2)
    with pytest.raises(ConfigError, match="hold their own test splits already"):
        match_client_tests(own, seed=0)


@pytest.mark.slow
def test_a_run_measures_each_client_on_its_matched_set_and_keeps_the_headline(tmp_path):
    settings = dict(model=TinyNet, method="fedavg", rounds=2, local_epochs=1, batch_size=8, lr=0.05,
                    progress=False, device="cpu", feature_dim=FEATURE_DIM, seed=2)
    shared = fedhpro.run(federation=skewed(), out=str(tmp_path / "shared"), **settings)
    matched = fedhpro.run(federation=skewed(), out=str(tmp_path / "matched"), client_test="matched", **settings)
    rows = [json.loads(line) for line in (matched.out / "metrics.jsonl").read_text().splitlines()]
    shared_rows = [json.loads(line) for line in (shared.out / "metrics.jsonl").read_text().splitlines()]
    # training and the headline are the paper's protocol either way
    assert [r["accuracy"] for r in rows] == [r["accuracy"] for r in shared_rows]
    assert [r["train"] for r in rows] == [r["train"] for r in shared_rows]
    # shared: the clients of a domain share one number; matched: each its own, counted here by hand
    assert len(set(shared_rows[-1]["client_accuracy"])) <= 2
    model = fedhpro.load_model(matched.out, model=TinyNet).eval()
    sets = match_client_tests(skewed(), seed=2).client_matched_tests
    assert sets is not None
    with torch.no_grad():
        by_hand = [100.0 * int((model(x).argmax(1) == y).sum()) / len(y) for x, y in sets]
    assert rows[-1]["client_accuracy"] == pytest.approx(by_hand, abs=1e-9)
    assert matched.summary["site_accuracy"]["mean"] == pytest.approx(sum(by_hand) / len(by_hand), abs=1e-9)
