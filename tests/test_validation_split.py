"""``validation=``: a validation part of each client's training data, held apart from training and test,
stratified by class, and the model selection made on it (the best round by validation, never by test)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import FEATURE_DIM, TinyNet, make_federation

import fedhpro
from fedhpro.config import load_config
from fedhpro.data.validation import held_out_positions, hold_out_validation
from fedhpro.errors import ConfigError
from fedhpro.experiment import build_experiment
from fedhpro.reports.run_data import RunData


def test_held_out_positions_are_stratified_as_counted_by_hand():
    labels = torch.tensor([0] * 10 + [1] * 5 + [2] * 1 + [3] * 3)
    held = held_out_positions(labels, 0.2, seed=0, client=0)
    # by hand: round half up of 0.2 * n per class, never a class's last sample: 2, 1, 0 (1 sample), 1 (0.6)
    assert np.bincount(labels[held].numpy(), minlength=4).tolist() == [2, 1, 0, 1]
    assert len(set(held.tolist())) == len(held) and list(held) == sorted(held)
    assert held_out_positions(labels, 0.2, seed=0, client=0).tolist() == held.tolist()  # the same draw again
    others = {tuple(held_out_positions(labels, 0.2, seed=s, client=k).tolist()) for s in range(3) for k in range(3)}
    assert len(others) > 1  # the seed and the client index choose the draw
    # share 0.5 by hand: 5, 3 (2.5 up), 0 (its only sample), 2 (1.5 up, which leaves one to train on)
    assert np.bincount(labels[held_out_positions(labels, 0.5, 0, 0)].numpy(), minlength=4).tolist() == [5, 3, 0, 2]


def test_hold_out_splits_each_client_into_disjoint_training_and_validation_rows():
    federation = make_federation([20, 13, 7], seed=1)
    before = [(c.x.clone(), c.y.clone()) for c in federation.clients]
    split = hold_out_validation(federation, 0.25, seed=4)
    assert split.client_validation is not None and federation.client_validation is None  # the input is kept
    for k, ((x, y), data, (vx, vy)) in enumerate(zip(before, split.clients, split.client_validation)):
        held = held_out_positions(y, 0.25, 4, k)
        kept = np.setdiff1d(np.arange(len(y)), held)
        assert torch.equal(vx, x[held]) and torch.equal(vy, y[held])
        assert torch.equal(data.x, x[kept]) and torch.equal(data.y, y[kept])
        rows = {tuple(row.flatten().tolist()) for row in data.x}
        assert not any(tuple(row.flatten().tolist()) in rows for row in vx)  # disjoint
        assert len(data) + len(vy) == len(y)
        for c in range(federation.num_classes):  # stratified: round half up, a class's last sample stays
            n = int((y == c).sum())
            assert int((vy == c).sum()) == min(int(np.floor(0.25 * n + 0.5)), max(n - 1, 0))
        assert split.partition["validation"]["clients"][k]["positions"] == held.tolist()
    test_rows = {tuple(row.flatten().tolist()) for x, _ in split.test_sets.values() for row in x}
    assert not any(tuple(row.flatten().tolist()) in test_rows for vx, _ in split.client_validation for row in vx)
    assert split.test_sets is federation.test_sets  # the test sets are not touched
    assert any(note.startswith("validation: 0.25 of each client's training data") for note in split.notes)
    assert hold_out_validation(federation, 0.0, seed=4) is federation


def test_a_share_of_half_or_more_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="validation=0.5 holds out too much"):
        hold_out_validation(make_federation([10, 10]), 0.5, seed=0)
    with pytest.raises(ConfigError, match="too large"):
        load_config(None, ["validation=0.7"])


def test_the_experiment_trains_without_the_validation_part():
    federation = make_federation([16, 12], seed=2)
    config = load_config(None, {"validation": 0.25, "seed": 5, "feature_dim": FEATURE_DIM})
    parts = build_experiment(config, "cpu", federation=federation, model_factory=TinyNet)
    for k, (data, original) in enumerate(zip(parts.federation.clients, federation.clients)):
        held = held_out_positions(original.y, 0.25, 5, k)
        assert len(data) == len(original) - len(held) > 0
    assert parts.federation.client_validation is not None


@pytest.mark.slow
def test_a_run_records_validation_and_selects_the_round_on_it(tmp_path):
    federation = make_federation([24, 20, 16], seed=3)
    result = fedhpro.run(federation=federation, model=TinyNet, method="fedavg", rounds=4, local_epochs=1,
                         batch_size=8, lr=0.05, progress=False, device="cpu", out=str(tmp_path / "run"),
                         feature_dim=FEATURE_DIM, seed=1, validation=0.25)
    rows = [json.loads(line) for line in (result.out / "metrics.jsonl").read_text().splitlines()]
    assert all("validation" in row and set(row["validation"]) == {"d0", "d1", "AVG"} for row in rows)
    # the final global model on the validation parts, counted here by hand: pooled per client domain (the
    # validation parts are the clients'), then averaged
    model = fedhpro.load_model(result.out, model=TinyNet)
    split = hold_out_validation(federation, 0.25, seed=1)
    assert split.client_validation is not None
    correct: dict[str, int] = {}
    total: dict[str, int] = {}
    with torch.no_grad():
        for (x, y), domain in zip(split.client_validation, split.client_domains):
            correct[domain] = correct.get(domain, 0) + int((model(x).argmax(1) == y).sum())
            total[domain] = total.get(domain, 0) + len(y)
    by_hand = {d: 100.0 * correct[d] / total[d] for d in ("d0", "d1")}
    assert rows[-1]["validation"]["AVG"] == pytest.approx(sum(by_hand.values()) / 2, abs=1e-9)
    # the best round by validation (the earliest of equals) and the test accuracy there
    best = max(range(len(rows)), key=lambda r: (rows[r]["validation"]["AVG"], -r))
    summary = result.summary["validation"]
    assert summary["best_round"] == rows[best]["round"] and summary["test_at_best"] == rows[best]["accuracy"]["AVG"]
    assert summary["accuracy"] == rows[-1]["validation"]["AVG"]
    run = RunData(result.out, {}, rows, result.summary)
    assert run.test_at_best_validation() == rows[best]["accuracy"]["AVG"]


@pytest.mark.slow
def test_a_run_without_validation_has_no_validation_keys(tmp_path):
    result = fedhpro.run(federation=make_federation([12, 12]), model=TinyNet, method="fedavg", rounds=1,
                         local_epochs=1, batch_size=8, progress=False, device="cpu", out=str(tmp_path / "run"),
                         feature_dim=FEATURE_DIM)
    row = json.loads((result.out / "metrics.jsonl").read_text().splitlines()[0])
    assert "validation" not in row and "validation" not in result.summary
    assert "validation" not in json.loads((result.out / "partition.json").read_text())
