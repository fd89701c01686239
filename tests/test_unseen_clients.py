"""Unseen clients (``unseen_clients=``, ``unseen_domain=``): held out of training entirely, tested as their own
figures with the global model, and after a stated number of fine-tuning epochs."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import FEATURE_DIM, TinyNet, make_federation

import fedhpro
from fedhpro.data.matched_tests import matched_positions
from fedhpro.data.unseen import hold_out_clients, unseen_indices
from fedhpro.errors import ConfigError

SETTINGS = dict(model=TinyNet, method="fedavg", rounds=2, local_epochs=1, batch_size=8, lr=0.05, progress=False,
                device="cpu", feature_dim=FEATURE_DIM, seed=3)


def domains_federation():
    """Six clients of domains "a" and "b" (the names of the two test sets), three each."""
    federation = make_federation([20, 16, 18, 14, 12, 22], seed=5)
    federation.client_domains = ["a", "b", "a", "b", "a", "b"]
    return federation


def test_unseen_indices_count_by_hand_and_repeat():
    assert len(unseen_indices(10, 0.25, seed=0)) == 3  # round half up of 2.5
    assert len(unseen_indices(10, 0.01, seed=0)) == 1  # at least one
    assert len(unseen_indices(2, 0.5, seed=0)) == 1  # at most K - 1
    assert unseen_indices(10, 0.3, seed=4) == unseen_indices(10, 0.3, seed=4)
    assert len({tuple(unseen_indices(10, 0.3, seed=s)) for s in range(5)}) > 1


def test_leave_one_domain_out_moves_the_domain_and_its_test_set_out():
    federation = domains_federation()
    split = hold_out_clients(federation, 0.0, "b", seed=0)
    assert split.unseen is not None and split.num_clients == 3 and split.client_domains == ["a", "a", "a"]
    assert [len(c) for c in split.clients] == [20, 18, 12]
    assert [len(c) for c in split.unseen.clients] == [16, 14, 22] and split.unseen.groups == ["b", "b", "b"]
    assert set(split.test_sets) == {"a"}  # the held-out domain leaves the headline
    assert all(torch.equal(y, federation.test_sets["b"][1]) for _, y in split.unseen.tests)
    assert split.partition["unseen"]["clients"] == [1, 3, 5]
    assert hold_out_clients(federation, 0.0, None, seed=0) is federation


@pytest.mark.parametrize("share, domain, words", [
    (0.3, "a", "not both"),
    (0.0, "c", "no client belongs to it; the domains are a, b"),
])
def test_impossible_hold_outs_are_refused_in_one_line(share, domain, words):
    with pytest.raises(ConfigError, match=words):
        hold_out_clients(domains_federation(), share, domain, seed=0)
    with pytest.raises(ConfigError, match="every client belongs to it"):
        one = domains_federation()
        one.client_domains = ["a"] * 6
        hold_out_clients(one, 0.0, "a", seed=0)


@pytest.mark.slow
def test_unseen_clients_never_train_and_are_tested_with_the_global_model(tmp_path):
    federation = domains_federation()
    held = unseen_indices(6, 0.34, seed=3)  # 2 of 6
    result = fedhpro.run(federation=federation, out=str(tmp_path / "unseen"), unseen_clients=0.34, **SETTINGS)
    # the same run on a federation that never had them gives the same training to the byte
    kept = [k for k in range(6) if k not in held]
    without = dataclasses.replace(federation, clients=[federation.clients[k] for k in kept],
                                  client_domains=[federation.client_domains[k] for k in kept])
    reference = fedhpro.run(federation=without, out=str(tmp_path / "without"), **SETTINGS)
    rows = [json.loads(line) for line in (result.out / "metrics.jsonl").read_text().splitlines()]
    expected = [json.loads(line) for line in (reference.out / "metrics.jsonl").read_text().splitlines()]
    for row, other in zip(rows, expected):
        assert {k: row[k] for k in ("participants", "train", "server", "accuracy")} == \
               {k: other[k] for k in ("participants", "train", "server", "accuracy")}
    assert (result.out / "model.pt").read_bytes() == (reference.out / "model.pt").read_bytes()
    # their figure: the global model on test samples following each one's labels, counted here by hand
    model = fedhpro.load_model(result.out, model=TinyNet).eval()
    correct: dict[str, int] = {}
    total: dict[str, int] = {}
    with torch.no_grad():
        for k in held:
            name = federation.client_domains[k]
            x, y = federation.test_sets[name]
            where = torch.from_numpy(matched_positions(federation.clients[k].y, y, 4, 3, k))
            correct[name] = correct.get(name, 0) + int((model(x[where]).argmax(1) == y[where]).sum())
            total[name] = total.get(name, 0) + len(where)
    by_hand = {name: 100.0 * correct[name] / total[name] for name in correct}
    assert {k: v for k, v in rows[-1]["unseen"].items() if k != "AVG"} == pytest.approx(by_hand, abs=1e-9)
    assert result.summary["unseen"]["accuracy"]["AVG"] == rows[-1]["unseen"]["AVG"]
    assert "unseen_finetuned" not in rows[-1]


@pytest.mark.slow
def test_fine_tuning_happens_at_the_last_round_only_and_changes_the_figure(tmp_path):
    settings = {**SETTINGS, "lr": 0.005}  # the global model far from perfect on domain b
    result = fedhpro.run(federation=domains_federation(), out=str(tmp_path / "tuned"), unseen_domain="b",
                         unseen_finetune=3, **settings)
    rows = [json.loads(line) for line in (result.out / "metrics.jsonl").read_text().splitlines()]
    assert "unseen_finetuned" not in rows[0] and set(rows[-1]["unseen_finetuned"]) == {"b", "AVG"}
    assert set(rows[-1]["accuracy"]) == {"a", "AVG"}  # domain b left the headline
    assert rows[-1]["unseen_finetuned"]["AVG"] != rows[-1]["unseen"]["AVG"]  # 3 epochs on their own data
    assert result.summary["unseen"]["finetuned"] == rows[-1]["unseen_finetuned"]
    again = fedhpro.run(federation=domains_federation(), out=str(tmp_path / "again"), unseen_domain="b",
                        unseen_finetune=3, **settings)
    assert again.summary["unseen"] == result.summary["unseen"]  # seeded: the same figures


@pytest.mark.slow
def test_personal_models_are_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="personal models"):
        fedhpro.run(federation=domains_federation(), out=str(tmp_path / "p"), unseen_domain="b",
                    **{**SETTINGS, "method": "fedproto", "fedproto.protocol": "proto-only"})


def test_a_class_only_the_held_out_clients_train_is_named():
    """Held out of training, domain b's clients take the only training samples of the last class with them:
    its test samples (in domain a's test set) count as errors, and the run says so; nothing is said when the
    training clients keep every tested class."""
    federation = domains_federation()
    last = federation.num_classes - 1
    assert (federation.test_sets["a"][1] == last).any()
    plain = hold_out_clients(federation, 0.0, "b", seed=0)
    assert not any("no training client holds" in note for note in plain.notes)
    for k, client in enumerate(federation.clients):
        client.y[:] = torch.where(client.y == last, 0, client.y) if k % 2 == 0 else last
    split = hold_out_clients(federation, 0.0, "b", seed=0)
    (warning,) = [note for note in split.notes if "no training client holds" in note]
    assert warning.startswith(f"warning: unseen: class {last}: no training client holds it once the unseen clients "
                              "are held out")
