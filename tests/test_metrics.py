"""Tests of ``fedhpro.metrics`` and of the measurements the simulator writes, against hand-computed values.

References: hand arithmetic (fairness, R_acc, distances), numpy's ``nbytes`` of every tensor leaf of a
payload found by ``torch.utils._pytree`` (bytes), closed-form FLOPs of linear layers, and a slow per-class
loop (class means).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import NUM_CLASSES, TinyNet, make_federation
from torch import nn
from torch.utils import _pytree

from fedhpro.engines.simulator import Simulator
from fedhpro.methods import METHODS, TrainSettings
from fedhpro.methods.fedavg import FedAvgOptions
from fedhpro.methods.fedhpro import FedHProOptions
from fedhpro.metrics import (
    FlopCounter,
    class_means,
    fairness_statistics,
    mean_client_prototypes,
    payload_bytes,
    payload_parameters,
    prototype_distance,
    rounds_to_accuracy,
    speedup,
)

TRAIN = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-4)


# ----------------------------------------------------------------------------
# fairness (Table A8)
# ----------------------------------------------------------------------------


def test_fairness_statistics_of_a_hand_computed_example():
    stats = fairness_statistics([50.0, 70.0, 90.0, 60.0])
    # 4 clients: 10 % rounds up to one client; mean 67.5; deviations -17.5, 2.5, 22.5, -7.5
    assert stats["worst_10"] == 50.0
    assert stats["best_10"] == 90.0
    assert stats["mean"] == 67.5
    assert stats["variance"] == pytest.approx((17.5 ** 2 + 2.5 ** 2 + 22.5 ** 2 + 7.5 ** 2) / 4)  # 218.75
    assert stats["std"] == pytest.approx(math.sqrt(218.75))


def test_fairness_worst_and_best_ten_percent_of_twenty_clients_are_two_clients_each():
    accuracies = [float(v) for v in range(20, 0, -1)]  # 20 .. 1
    stats = fairness_statistics(accuracies)
    assert stats["worst_10"] == 1.5  # mean of 1 and 2
    assert stats["best_10"] == 19.5  # mean of 19 and 20
    assert stats["mean"] == 10.5


def test_fairness_rejects_no_clients():
    with pytest.raises(ValueError, match="at least one"):
        fairness_statistics([])


# ----------------------------------------------------------------------------
# bytes and parameters of payloads (Table 4)
# ----------------------------------------------------------------------------


def leaves_reference(payload) -> tuple[int, int]:
    """(bytes, floating parameters) from the payload's pytree leaves: numpy nbytes, 8 per plain number."""
    nbytes = params = 0
    for leaf in _pytree.tree_leaves(payload):
        if isinstance(leaf, torch.Tensor):
            nbytes += leaf.detach().cpu().numpy().nbytes if leaf.dtype != torch.bfloat16 else leaf.numel() * 2
            params += leaf.numel() if leaf.is_floating_point() else 0
        elif isinstance(leaf, (int, float, bool)):
            nbytes += 8
    return nbytes, params


def test_payload_bytes_and_parameters_of_a_hand_built_payload():
    payload = {"weights": {"a": torch.zeros(2, 3), "b": torch.zeros(5, dtype=torch.int64)},
               "g": torch.zeros(4, dtype=torch.float64), "n": 7, "extra": [torch.zeros(3, dtype=torch.float16)]}
    # 2*3*4 + 5*8 + 4*8 + 8 + 3*2 bytes; floating elements 6 + 4 + 3
    assert payload_bytes(payload) == 24 + 40 + 32 + 8 + 6 == leaves_reference(payload)[0]
    assert payload_parameters(payload) == 13 == leaves_reference(payload)[1]


@pytest.mark.parametrize("method", ["fedavg", "fedhpro"])
def test_simulator_counts_the_bytes_of_the_actual_payload_tensors(method):
    federation = make_federation([10, 12, 14], seed=4)
    options = FedAvgOptions() if method == "fedavg" else FedHProOptions(match_steps=2)
    sim = Simulator(METHODS[method], options, federation, TinyNet, TRAIN, rounds=1, participation=0.67, seed=1)
    sent, replied = [], []
    broadcast, fit = sim.server.broadcast, sim.client.fit

    def spy_broadcast(round):
        payload = broadcast(round)
        sent.append(payload)
        return payload

    def spy_fit(model, payload, data, state, generator):
        reply, metrics = fit(model, payload, data, state, generator)
        replied.append(reply)
        return reply, metrics

    sim.server.broadcast, sim.client.fit = spy_broadcast, spy_fit
    record = sim.run_round(0).to_json()
    participants = len(record["participants"])
    assert participants == 2 and len(replied) == 2
    down_bytes, down_params = leaves_reference(sent[0])
    assert record["bytes_down"] == participants * down_bytes
    assert record["params_down"] == participants * down_params
    assert record["bytes_up"] == sum(leaves_reference(reply)[0] for reply in replied)
    assert record["params_up"] == sum(leaves_reference(reply)[1] for reply in replied)
    weights = sum(t.numel() for t in TinyNet().state_dict().values())
    assert record["params_up"] >= participants * weights  # at least the model travels up


# ----------------------------------------------------------------------------
# per-client accuracy and fairness in the simulator
# ----------------------------------------------------------------------------


def test_simulator_writes_each_clients_accuracy_on_its_domain_and_the_fairness_of_them():
    federation = make_federation([10, 12, 14, 16], seed=5)  # domains d0, d1, d0, d1; test sets a, b
    federation.client_domains = ["a", "b", "a", "b"]
    sim = Simulator(METHODS["fedavg"], FedAvgOptions(), federation, TinyNet, TRAIN, rounds=1, seed=2)
    row = sim.run_round(0).to_json()
    accuracy = row["accuracy"]
    assert row["client_accuracy"] == [accuracy["a"], accuracy["b"], accuracy["a"], accuracy["b"]]
    assert row["fairness"] == fairness_statistics(row["client_accuracy"])


# ----------------------------------------------------------------------------
# convergence (Table A4)
# ----------------------------------------------------------------------------


def test_rounds_to_accuracy_counts_from_one_and_skips_unevaluated_rounds():
    rows = [{"round": 0, "accuracy": {"AVG": 40.0}}, {"round": 1, "accuracy": {"AVG": 55.0}},
            {"round": 2, "accuracy": {"AVG": 52.0}}, {"round": 3}, {"round": 4, "accuracy": {"AVG": 61.0}},
            {"round": 5, "accuracy": {"AVG": 76.0}}]
    assert rounds_to_accuracy(rows, 50) == 2
    assert rounds_to_accuracy(rows, 60) == 5  # round index 4, counted from one
    assert rounds_to_accuracy(rows, 75) == 6
    assert rounds_to_accuracy(rows, 80) is None


def test_speedup_reproduces_the_papers_table_a4_percentages():
    assert speedup(14, 27) == pytest.approx(0.481, abs=5e-4)  # FedHPro: up 48.1 %
    assert speedup(30, 27) == pytest.approx(-0.111, abs=5e-4)  # FedProx: down 11.1 %
    assert speedup(None, 27) is None and speedup(5, None) is None


# ----------------------------------------------------------------------------
# prototypes (Figure 2)
# ----------------------------------------------------------------------------


def test_class_means_equal_a_slow_loop_and_mark_absent_classes():
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(30, 5, generator=generator)
    labels = torch.tensor([0, 2, 2, 3] * 7 + [0, 3])
    means, present = class_means(features, labels, 5)
    for c in range(5):
        rows = [features[i] for i in range(30) if int(labels[i]) == c]
        if rows:
            torch.testing.assert_close(means[c], torch.stack(rows).mean(0), rtol=0, atol=1e-6)
        else:
            assert not present[c] and bool((means[c] == 0).all())
    assert present.tolist() == [True, False, True, True, False]


def test_prototype_distance_of_a_hand_computed_example():
    p = torch.tensor([[3.0, 4.0], [0.0, 2.0]])
    q = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    both = torch.tensor([True, True])
    distance = prototype_distance(p, both, q, both)
    assert distance["l2"] == pytest.approx((math.sqrt(18) + math.sqrt(8)) / 2)
    # unit vectors: (0.6, 0.8) vs (0, 1) and (0, 1) vs (1, 0)
    assert distance["l2_normalized"] == pytest.approx((math.sqrt(0.36 + 0.04) + math.sqrt(2)) / 2)
    only_first = prototype_distance(p, torch.tensor([True, False]), q, both)
    assert only_first["l2"] == pytest.approx(math.sqrt(18))
    assert math.isnan(prototype_distance(p, torch.tensor([False, True]), q, torch.tensor([True, False]))["l2"])


def test_mean_client_prototypes_is_the_unweighted_mean_over_holders():
    prototypes = torch.tensor([[[1.0], [5.0]], [[3.0], [0.0]], [[8.0], [7.0]]])  # 3 clients, 2 classes, d=1
    present = torch.tensor([[True, True], [True, False], [False, True]])
    mean, held = mean_client_prototypes(prototypes, present)
    assert mean.squeeze(1).tolist() == [2.0, 6.0] and held.tolist() == [True, True]


def test_simulator_centralized_prototypes_are_the_class_means_of_all_training_data():
    federation = make_federation([10, 12, 14], classes=[[0, 1], [1, 2], [0, 3]], seed=6)
    sim = Simulator(METHODS["fedhpro"], FedHProOptions(match_steps=2), federation, TinyNet, TRAIN, rounds=1,
                    seed=3, prototype_distance=True)
    row = sim.run_round(0).to_json()
    model = TinyNet()
    model.load_state_dict(sim.server.global_weights())
    model.eval()
    with torch.no_grad():
        features = torch.cat([model.features(c.x) for c in federation.clients])
    labels = torch.cat([c.y for c in federation.clients])
    reference = torch.stack([features[labels == c].mean(0) for c in range(NUM_CLASSES)])
    centralized, mask = sim.centralized_prototypes()
    torch.testing.assert_close(centralized, reference, rtol=0, atol=1e-5)
    hyper = sim.server.bank.averaged
    expected = float((hyper.double() - reference.double()).norm(dim=1).mean())
    assert row["prototype_distance"]["server"]["kind"] == "hyper"
    assert row["prototype_distance"]["server"]["l2"] == pytest.approx(expected, rel=1e-5)
    assert "clients_mean" in row["prototype_distance"]


def test_prototype_distance_is_refused_without_one_shared_model():
    federation = make_federation([10, 12], seed=7)
    with pytest.raises(Exception, match="prototype_distance"):
        Simulator(METHODS["fedavg"], FedAvgOptions(), federation, TinyNet, TRAIN, rounds=1, shared="none",
                  prototype_distance=True)


# ----------------------------------------------------------------------------
# FLOPs (Table 4)
# ----------------------------------------------------------------------------


def test_flop_counter_of_a_linear_layer_matches_the_closed_form():
    layer = nn.Linear(10, 5)
    x = torch.randn(4, 10)
    with FlopCounter() as counter:
        layer(x).sum().backward()
    # forward 2*B*in*out; backward: the weight gradient only (x needs no gradient), 2*B*in*out
    assert counter.total == 2 * (2 * 4 * 10 * 5)


def test_simulator_flops_are_the_closed_form_and_counting_changes_no_number():
    sizes = [10, 12]  # batches of 8: no trailing single sample is skipped
    federation = make_federation(sizes, seed=8)
    runs = []
    for count in (False, True):
        sim = Simulator(METHODS["fedavg"], FedAvgOptions(), federation, TinyNet, TRAIN, rounds=2, seed=4,
                        count_flops=count)
        runs.append([sim.run_round(r).to_json() for r in range(2)])
    plain, counted = runs
    for a, b in zip(plain, counted):
        assert a == {k: v for k, v in b.items() if not k.startswith("flops")}
    d_in, d, c = 3 * 8 * 8, 16, NUM_CLASSES  # TinyNet: Linear(d_in, d) -> tanh -> Linear(d, c)
    per_sample = 2 * (d_in * d + d * c) + 2 * d_in * d + 2 * 2 * d * c  # forward + backward (no input grad)
    for row in counted:
        assert row["flops_train"] == per_sample * sum(sizes) * TRAIN.epochs
        # FedAvg's weighted mean is a running element-wise sum (folded as the replies arrive): element-wise
        # operations are outside the counter, as in the usual FLOP tables, so the server counts nothing
        assert row["flops_server"] == 0


def test_flop_counter_allows_autograd_grad_with_inputs_as_fedhpro_class_gradients_use():
    # FlopCounterMode's module hooks made torch.autograd.grad(..., inputs) fail inside it
    from fedhpro.methods.fedhpro import equations
    from fedhpro.metrics.flops import FlopCounter

    classifier = torch.nn.Linear(8, 4)
    z, y = torch.randn(5, 8), torch.tensor([0, 1, 2, 3, 0])
    expected, _ = equations.class_gradients(z, y, classifier, 4)
    with FlopCounter() as counter:
        gradients, _ = equations.class_gradients(z, y, classifier, 4)
    torch.testing.assert_close(gradients, expected)
    # forward addmm 2*5*8*4 plus the backward mm for the input gradient 2*5*4*8 (no weight gradient)
    assert counter.total == 2 * 5 * 8 * 4 * 2
