"""Krum (``aggregation=krum``, Blanchard et al. 2017): the update whose summed squared distance to its
``K - f - 2`` nearest others is the smallest becomes every reply's, against scores computed by hand in the
comments; class-tensor rows likewise per class over its holders; on the simulator a x100 hostile client is
never the one chosen, and Flower's real ServerApp and ClientApp give the same numbers to the bit.

References: the scores written out by hand below, and an independent float64 numpy reading of the clients'
own replies (captured from ``fit``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_robust_aggregation import SIZES, _hostile_round, fault_draws, float_weights

from fedhpro.aggregation import AGGREGATION_RULES, krum_choice, krum_scores
from fedhpro.config import AggregationOptions, load_config
from fedhpro.engines.protocol import RoundProtocol
from fedhpro.engines.robust import robust_replies
from fedhpro.errors import ConfigError
from fedhpro.privacy import check_combinations
from fedhpro.robust import REGISTRY, RobustRule
from fedhpro.robust.krum import Krum, krum_neighbours, squared_distances

# five 2-D updates (reference 0): four honest near the origin, one far away
POINTS = [(0.0, 0.0), (1.0, 0.0), (0.0, 2.0), (2.0, 2.0), (10.0, 10.0)]
# squared distances, by hand:
#   a-b 1   a-c 4   a-d 8   a-e 200
#   b-c 5   b-d 5   b-e 181
#   c-d 4   c-e 164
#   d-e 128
DISTANCES = [[0, 1, 4, 8, 200], [1, 0, 5, 5, 181], [4, 5, 0, 4, 164], [8, 5, 4, 0, 128],
             [200, 181, 164, 128, 0]]


def test_squared_distances_of_the_hand_example():
    updates = [[torch.tensor(p)] for p in POINTS]
    assert squared_distances(updates) == DISTANCES


def test_krum_scores_and_choice_by_hand():
    # f = 1, K = 5 > 2f + 2: n = K - f - 2 = 2 nearest others
    #   a: 1 + 4 = 5   b: 1 + 5 = 6   c: 4 + 4 = 8   d: 4 + 5 = 9   e: 128 + 164 = 292  -> a
    assert krum_neighbours(5, 1) == 2
    assert krum_scores(DISTANCES, 1) == [5, 6, 8, 9, 292]
    assert krum_choice(DISTANCES, 1) == 0
    # f = 0: n = 3
    #   a: 1 + 4 + 8 = 13   b: 1 + 5 + 5 = 11   c: 4 + 4 + 5 = 13   d: 4 + 5 + 8 = 17   e: 128 + 164 + 181 = 473  -> b
    assert krum_scores(DISTANCES, 0) == [13, 11, 13, 17, 473]
    assert krum_choice(DISTANCES, 0) == 1
    # K <= 2f + 2 (f = 2, K = 5): no guarantee; max(1, K - f - 2) = 1 neighbour
    #   a: 1   b: 1   c: 4   d: 4   e: 128  -> a and b tie: the earlier, a
    assert krum_neighbours(5, 2) == 1 and krum_scores(DISTANCES, 2) == [1, 1, 4, 4, 128]
    assert krum_choice(DISTANCES, 2) == 0
    # a lone update is chosen as it is; two updates: one neighbour each, equal scores, the first
    assert krum_neighbours(1, 1) == 0 and krum_choice([[0.0]], 1) == 0
    assert krum_choice([[0.0, 3.0], [3.0, 0.0]], 0) == 0


def test_every_reply_gets_the_chosen_weights_and_the_holders_krum_row():
    # class 0, held by all five (f = 1, n = 2), 3-D rows:
    #   r0 (0,0,0)  r1 (1,1,0)  r2 (0,0,3)  r3 (1,0,0)  r4 (5,5,5)
    #   squared distances: 0-1 2, 0-2 9, 0-3 1, 0-4 75, 1-2 11, 1-3 1, 1-4 57, 2-3 10, 2-4 54, 3-4 66
    #   scores: r0 1+2=3, r1 1+2=3, r2 9+10=19, r3 1+1=2, r4 54+57=111  -> r3
    # class 1, held by replies 0, 2, 4 only (H = 3 <= 2f + 2: one neighbour):
    #   h0 (2,0,0)  h2 (0,0,0)  h4 (0,3,0): 0-2 4, 0-4 13, 2-4 9; scores 4, 4, 9 -> h0 (the earlier of a tie)
    class0 = [(0, 0, 0), (1, 1, 0), (0, 0, 3), (1, 0, 0), (5, 5, 5)]
    class1 = [(2, 0, 0), (7, 7, 7), (0, 0, 0), (-7, -7, -7), (0, 3, 0)]
    counts = [[3, 1], [4, 0], [2, 2], [4, 0], [1, 3]]
    replies = [{"weights": {"w": torch.tensor(POINTS[k]), "steps": torch.tensor(k)}, "num_examples": 4,
                "prototypes": torch.tensor([class0[k], class1[k]], dtype=torch.float32),
                "class_counts": torch.tensor(counts[k])} for k in range(5)]
    reference = {"w": torch.zeros(2), "steps": torch.tensor(0)}
    out, metrics = robust_replies(replies, reference, AggregationOptions("krum"), num_classes=2,
                                  clients=[10, 11, 12, 13, 14])
    assert metrics == {"robust_updates": 5.0, "robust_krum_chosen": 10.0, "robust_krum_neighbours": 2.0}
    for k in range(5):
        assert torch.equal(out[k]["weights"]["w"], torch.tensor([0.0, 0.0]))  # a's
        assert torch.equal(out[k]["weights"]["steps"], torch.tensor(k))  # a counter: each reply's own
        assert torch.equal(out[k]["prototypes"][0], torch.tensor([1.0, 0.0, 0.0]))
    for k in (0, 2, 4):
        assert torch.equal(out[k]["prototypes"][1], torch.tensor([2.0, 0.0, 0.0]))
    for k in (1, 3):  # a class the reply does not hold: its row as it was
        assert torch.equal(out[k]["prototypes"][1], torch.tensor(class1[k], dtype=torch.float32))
    assert torch.equal(replies[4]["weights"]["w"], torch.tensor([10.0, 10.0]))  # the inputs are not changed
    # f = 0 (the rule's option): b is chosen (scores 13, 11, 13, 17, 473)
    _, metrics = robust_replies(replies, reference, Krum(SimpleNamespace(byzantine=0)), num_classes=2)
    assert metrics["robust_krum_chosen"] == 1.0 and metrics["robust_krum_neighbours"] == 3.0


def test_krum_is_a_registered_rule_named_by_the_config_and_refused_where_only_sums_are_seen():
    assert "krum" in REGISTRY and issubclass(REGISTRY["krum"], RobustRule)
    assert list(AGGREGATION_RULES) == ["mean", "median", "trimmed-mean", "norm-clip", "krum", "geometric-median"]
    assert AGGREGATION_RULES["krum"] == "pairwise distances" and AGGREGATION_RULES["mean"] == ""
    assert load_config(None, ["aggregation=krum"]).aggregation.rule == "krum"
    with pytest.raises(ConfigError, match="aggregation=krum: krum needs pairwise distances of each client's own"):
        check_combinations(load_config(None, ["aggregation=krum", "privacy=client"]))
    with pytest.raises(ConfigError, match="aggregation.byzantine=-1"):
        Krum(SimpleNamespace(byzantine=-1))


def test_a_rule_is_one_class_and_one_registry_line():
    """A new rule: one RobustRule subclass and one line; the protocol applies it and AGGREGATION_RULES lists it."""

    class Zero(RobustRule):
        needs = "each update"

        def weights(self, weights, reference, clients):
            return [{key: torch.zeros_like(value) for key, value in w.items()} for w in weights], {"zeroed": 1.0}

    REGISTRY.register("zero-test", Zero)
    try:
        assert AGGREGATION_RULES["zero-test"] == "each update"
        server = SimpleNamespace(new_replies=list, broadcast=lambda round: {"weights": {"w": torch.ones(2)}},
                                 validate_reply=lambda reply: None,
                                 aggregate=lambda round, replies: {"got": float(replies[0]["weights"]["w"].sum())})
        protocol = RoundProtocol(server, 2, rounds=1, aggregation=AggregationOptions(rule="zero-test"))
        current = protocol.open(0)
        for k in (0, 1):
            assert current.receive(k, {"weights": {"w": torch.full((2,), 5.0)}, "num_examples": 3}, {}, 3)
        assert current.close() == {"got": 0.0, "robust_updates": 2.0, "zeroed": 1.0}
        with pytest.raises(ConfigError, match="choose one of: mean, median, trimmed-mean, norm-clip, krum"):
            RoundProtocol(server, 2, rounds=1, aggregation=AggregationOptions(rule="krun"))
    finally:
        REGISTRY.unregister("zero-test")
    assert "zero-test" not in AGGREGATION_RULES


# ----------------------------------------------------------------------------- the simulator


def test_simulator_krum_never_chooses_the_scaled_client_and_takes_the_hand_computed_choice():
    initial, result, computed, bad, record = _hostile_round(AggregationOptions("krum"))
    w0 = float_weights(initial)
    sent = []
    for k in range(5):  # the replies as sent: the hostile one is w0 + 100 * delta
        weights = {n: computed[k]["weights"][n].double() for n in w0}
        if k == bad:
            weights = {n: w0[n] + 100.0 * (weights[n] - w0[n]) for n in w0}
        sent.append(np.concatenate([weights[n].numpy().ravel() for n in sorted(w0)]))
    distances = np.array([[float(((a - b) ** 2).sum()) for b in sent] for a in sent])
    scores = [np.sort(np.delete(distances[i], i))[:2].sum() for i in range(5)]  # f = 1: K - f - 2 = 2
    chosen = int(np.argmin(scores))
    assert chosen != bad and scores[bad] == max(scores)
    assert record.server["robust_krum_chosen"] == float(chosen)
    assert record.server["robust_updates"] == 5.0 and record.server["robust_krum_neighbours"] == 2.0
    # the method's n_k-weighted mean of five equal replies: the chosen client's weights (to float rounding)
    for name in w0:
        torch.testing.assert_close(result[name].double(), computed[chosen]["weights"][name].double(),
                                   rtol=0, atol=1e-6)
    assert sum(SIZES) == 160  # the mean above weighed the five copies by these sizes


# ----------------------------------------------------------------------------- both engines

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")


def _seed_with_one_hostile(clients: int, scale: float) -> tuple[int, int]:
    for seed in range(200):
        hostile = [k for k in range(clients) if fault_draws(seed, 0, k)[2] < scale]
        if len(hostile) == 1:
            return seed, hostile[0]
    raise AssertionError("no seed found")


@pytest.mark.slow
def test_flower_and_the_simulator_give_krum_the_same_numbers(digits_data_dir, tmp_path, monkeypatch):
    """The real ServerApp (run_server) over a grid whose five nodes run the real ClientApp (partition mode), and
    fedhpro.run: metrics.jsonl equal to the byte under aggregation=krum with a x100 hostile client, which is not
    the one chosen."""
    from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION
    from flwr.app import Context, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    import fedhpro
    from fedhpro.flower.local_grid import LocalGrid, inside_a_run
    from fedhpro.flower.server import run_server

    for name in ("_run_id", "_node_id", "_task_id"):  # put back after the test
        monkeypatch.setattr(TaskIdentity, name, getattr(TaskIdentity, name, None))
    inside_a_run()
    clients = 5
    seed, bad = _seed_with_one_hostile(clients, 0.2)
    settings = {"rounds": 2, "clients": clients, "data.fraction": 0.02, "data.syn_size": DIGITS_SYN_SIZE,
                "data.test_fraction": DIGITS_TEST_FRACTION, "feature_dim": 16, "local_epochs": 1,
                "device": "cpu", "data_dir": str(digits_data_dir), "progress": False, "seed": seed,
                "method": "fedavg", "aggregation": "krum", "faults.scale": 0.2}
    grid = LocalGrid({}, tmp_path / "state")
    grid.contexts = {100 + k: Context(run_id=1, node_id=100 + k, state=RecordDict(), run_config={},
                                      node_config={"partition-id": k, "num-partitions": clients,
                                                   "state-dir": str(tmp_path / "state" / str(k))})
                     for k in range(clients)}
    flower_out, simulator_out = tmp_path / "flower", tmp_path / "simulator"
    run_server(grid, {}, {**settings, "out": str(flower_out)})
    fedhpro.run(settings, out=str(simulator_out))
    assert (flower_out / "metrics.jsonl").read_bytes() == (simulator_out / "metrics.jsonl").read_bytes()
    rows = [json.loads(line) for line in Path(flower_out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["participants"] == list(range(clients)) and "dropped" not in rows[0]
    assert all(row["server"]["robust_updates"] == clients for row in rows)
    assert rows[0]["server"]["robust_krum_chosen"] != bad  # the x100 client of round 0 is not the one chosen
    flower_model = torch.load(flower_out / "model.pt", weights_only=True)
    simulator_model = torch.load(simulator_out / "model.pt", weights_only=True)
    assert all(torch.equal(flower_model[key], simulator_model[key]) for key in simulator_model)
