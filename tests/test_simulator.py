"""Tests of the in-process simulator (``fedhpro.engines.simulator``) against independent references.

References used: clients trained by hand with the method's ``Client.fit`` and
the engine's documented generator seeds, averaged in a Python loop in float64;
hand byte counts; a model whose predictions are fixed by construction.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools

import numpy as np
import pytest
import torch
from conftest import FEATURE_DIM, NUM_CLASSES, TinyBNNet, TinyNet, make_federation
from torch import nn

from fedhpro.config import AggregationOptions
from fedhpro.engines.client_tests import evaluate
from fedhpro.engines.simulator import Simulator, derive_seed
from fedhpro.methods import METHODS, MethodContext, TrainSettings
from fedhpro.methods.fedavg import FedAvgOptions
from fedhpro.methods.fedhpro import FedHProOptions

TRAIN_STREAM = 3  # derive_seed(seed, 3, round, client): the engine's per-client batch-order stream
TRAIN = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-4)


def simulator(federation, method="fedavg", options=None, *, model=TinyNet, train=TRAIN, rounds=2, seed=0,
              participation=1.0, eval_every=1) -> Simulator:
    if options is None:
        options = FedAvgOptions() if method == "fedavg" else FedHProOptions(match_steps=3)
    return Simulator(METHODS[method], options, federation, model, train, rounds=rounds,
                     participation=participation, seed=seed, eval_every=eval_every)


def spy_on_fit(sim: Simulator) -> list[dict]:
    """Record every (client data, reply) the simulator's client part produces."""
    calls: list[dict] = []
    original = sim.client.fit

    def fit(model, payload, data, state, generator):
        reply, metrics = original(model, payload, data, state, generator)
        calls.append({"data": data, "reply": reply, "metrics": metrics})
        return reply, metrics

    sim.client.fit = fit
    return calls


def snapshot(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in weights.items()}


def assert_weights_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def hand_weighted_mean(states: list[dict[str, torch.Tensor]], sizes: list[int]) -> dict[str, torch.Tensor]:
    """sum_k n_k w_k / N, accumulated entry by entry in float64."""
    total = float(sum(sizes))
    out = {}
    for name in states[0]:
        acc = torch.zeros_like(states[0][name], dtype=torch.float64)
        for state, n in zip(states, sizes):
            acc = acc + state[name].double() * (n / total)
        out[name] = acc
    return out


def hand_client_replies(sim_seed: int, federation, initial: dict, round: int, clients: list[int],
                        model=TinyNet, method="fedavg", options=None, train=TRAIN) -> list[dict]:
    """Train each client myself: a fresh model, the method's Client.fit, the engine's generator seed."""
    options = FedAvgOptions() if options is None else options
    context = MethodContext(model=model(), num_classes=federation.num_classes, options=options, train=train)
    client = METHODS[method].client(context)
    replies = []
    for k in clients:
        generator = torch.Generator().manual_seed(derive_seed(sim_seed, TRAIN_STREAM, round, k))
        reply, _ = client.fit(model(), {"weights": copy.deepcopy(initial)}, federation.clients[k], {}, generator)
        replies.append(reply)
    return replies


# ----------------------------------------------------------------------------
# FedAvg aggregation
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [[20, 20, 20], [9, 27, 50]], ids=["equal", "unequal"])
def test_fedavg_round_is_weighted_mean_of_hand_trained_clients(sizes):
    federation = make_federation(sizes, shifts=[0.0, 0.8, -0.8], seed=1)
    sim = simulator(federation, seed=5)
    initial = snapshot(sim.server.global_weights())
    sim.run_round(0)
    result = sim.server.global_weights()

    replies = hand_client_replies(5, federation, initial, 0, [0, 1, 2])
    expected = hand_weighted_mean([r["weights"] for r in replies], sizes)
    for name, value in expected.items():
        assert result[name].dtype == initial[name].dtype
        torch.testing.assert_close(result[name].double(), value, rtol=0, atol=1e-6, msg=name)
    # the round did train: the global model moved
    assert any(not torch.equal(result[name], initial[name]) for name in initial)

    unweighted = hand_weighted_mean([r["weights"] for r in replies], [1, 1, 1])
    gap = max(float((result[name].double() - unweighted[name]).abs().max()) for name in result)
    if len(set(sizes)) == 1:
        assert gap < 1e-6  # equal sizes: weighted == unweighted
    else:
        assert gap > 1e-3  # unequal sizes: the n_k weights matter


def test_fedavg_second_round_starts_from_the_first_rounds_average():
    sizes = [12, 30, 18]
    federation = make_federation(sizes, seed=2)
    sim = simulator(federation, seed=3, rounds=2)
    initial = snapshot(sim.server.global_weights())
    sim.run_round(0)
    after_first = {n: t.float() for n, t in hand_weighted_mean(
        [r["weights"] for r in hand_client_replies(3, federation, initial, 0, [0, 1, 2])], sizes).items()}
    sim.run_round(1)
    replies = hand_client_replies(3, federation, after_first, 1, [0, 1, 2])
    expected = hand_weighted_mean([r["weights"] for r in replies], sizes)
    for name, value in expected.items():
        torch.testing.assert_close(sim.server.global_weights()[name].double(), value, rtol=0, atol=1e-5, msg=name)


def test_replies_do_not_alias_each_other_the_working_model_or_the_global_weights():
    federation = make_federation([16, 20, 24], seed=3)
    sim = simulator(federation)
    calls = spy_on_fit(sim)
    sim.run_round(0)
    assert len(calls) == 3

    def storages(weights):
        return {name: t.untyped_storage().data_ptr() for name, t in weights.items()}

    working = set(storages(sim.working_model.state_dict()).values())
    global_ptrs = set(storages(sim.server.global_weights()).values())
    reply_ptrs = [set(storages(call["reply"]["weights"]).values()) for call in calls]
    for a, b in itertools.combinations(reply_ptrs, 2):
        assert not a & b, "two clients' replies share storage"
    for ptrs in reply_ptrs:
        assert not ptrs & working, "a reply shares storage with the reused working model"
        assert not ptrs & global_ptrs, "a reply shares storage with the global weights"
    assert not global_ptrs & working

    # the replies really differ (each client trained from the same start on its own data)
    first, second = calls[0]["reply"]["weights"], calls[1]["reply"]["weights"]
    assert any(not torch.equal(first[n], second[n]) for n in first)

    before = snapshot(sim.server.global_weights())
    for call in calls:
        for tensor in call["reply"]["weights"].values():
            tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor.add_(7)
    with torch.no_grad():
        for parameter in sim.working_model.parameters():
            parameter.add_(1.0)
    assert_weights_equal(sim.server.global_weights(), before)
    assert_weights_equal(sim.server.broadcast(1)["weights"], before)


def test_batchnorm_running_stats_are_weighted_by_n_k_and_counter_stays_integer():
    sizes = [10, 26, 44]
    # different input shifts give clearly different running means per client
    federation = make_federation(sizes, shifts=[-1.5, 0.0, 2.0], seed=4)
    sim = simulator(federation, model=TinyBNNet, seed=1)
    calls = spy_on_fit(sim)
    sim.run_round(0)
    result = sim.server.global_weights()
    replies = [call["reply"] for call in calls]
    assert [r["num_examples"] for r in replies] == sizes

    bn_keys = [n for n in result if "running_mean" in n or "running_var" in n]
    assert len(bn_keys) == 2
    expected = hand_weighted_mean([r["weights"] for r in replies], sizes)
    unweighted = hand_weighted_mean([r["weights"] for r in replies], [1, 1, 1])
    for name in bn_keys:
        assert result[name].dtype == torch.float32
        torch.testing.assert_close(result[name].double(), expected[name], rtol=0, atol=1e-6, msg=name)
        assert float((result[name].double() - unweighted[name]).abs().max()) > 1e-3, name

    (counter,) = [n for n in result if n.endswith("num_batches_tracked")]
    assert result[counter].dtype == torch.long and result[counter].shape == ()
    counts = [int(r["weights"][counter]) for r in replies]
    # each client counted its own SGD steps: ceil(n_k / 8), minus a trailing batch of one
    assert counts == [2, 4, 6]
    assert min(counts) <= int(result[counter]) <= max(counts)
    # and the global model still loads into a model and runs
    model = TinyBNNet()
    model.load_state_dict(result)
    model.eval()
    assert torch.isfinite(model(federation.clients[0].x)).all()


# ----------------------------------------------------------------------------
# client sampling
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("clients,participation,expected_count", [(6, 0.5, 3), (4, 0.5, 2), (10, 0.3, 3),
                                                                   (10, 0.04, 1)])
def test_participation_samples_distinct_sorted_clients(clients, participation, expected_count):
    federation = make_federation([6] * clients, seed=5)
    sim = simulator(federation, participation=participation, seed=11)
    seen = []
    for r in range(12):
        chosen = sim.sample_clients(r)
        assert len(chosen) == expected_count
        assert len(set(chosen)) == expected_count
        assert chosen == sorted(chosen)
        assert all(isinstance(k, int) and 0 <= k < clients for k in chosen)
        seen.append(tuple(chosen))
    assert len(set(seen)) > 1, "every round drew the same participants"

    # the same seed gives the same participants round by round, whatever was asked before
    again = simulator(federation, participation=participation, seed=11)
    assert [tuple(again.sample_clients(r)) for r in reversed(range(12))] == list(reversed(seen))
    other = simulator(federation, participation=participation, seed=12)
    assert [tuple(other.sample_clients(r)) for r in range(12)] != seen


def test_full_participation_picks_everyone():
    federation = make_federation([6] * 5, seed=5)
    sim = simulator(federation, participation=1.0, seed=3)
    assert all(sim.sample_clients(r) == [0, 1, 2, 3, 4] for r in range(5))


def test_only_sampled_clients_train_and_the_record_lists_them():
    federation = make_federation([8, 10, 12, 14], seed=6)
    sim = simulator(federation, participation=0.5, seed=2)
    calls = spy_on_fit(sim)
    for r in range(3):
        calls.clear()
        record = sim.run_round(r)
        assert record.participants == sim.sample_clients(r)
        trained = [next(k for k, c in enumerate(federation.clients) if c is call["data"]) for call in calls]
        assert trained == record.participants
        # FedAvg over the two participants only, weighted by their sizes
        sizes = [len(federation.clients[k]) for k in trained]
        expected = hand_weighted_mean([call["reply"]["weights"] for call in calls], sizes)
        for name, value in expected.items():
            torch.testing.assert_close(sim.server.global_weights()[name].double(), value, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------
# determinism
# ----------------------------------------------------------------------------


def _records_without_seconds(sim: Simulator) -> list[dict]:
    """Every field of every RoundRecord except the wall times (and the JSON form without them)."""
    out = []
    for record in sim.history:
        assert set(record.seconds) == {"clients", "server", "eval"}
        fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.name != "seconds"}
        row = {key: value for key, value in record.to_json().items() if key != "seconds"}
        out.append({"fields": fields, "json": row})
    return out


def _run(sim: Simulator, rounds: int, between=None) -> Simulator:
    for r in range(rounds):
        sim.run_round(r)
        if between is not None:
            between()
    return sim


@pytest.mark.parametrize("method", ["fedavg", "fedhpro"])
def test_same_seed_is_bit_identical_and_other_seed_differs(method):
    federation = make_federation([10, 14, 18, 6], classes=[[0, 1, 2], [1, 2, 3], [0, 3], [0, 1, 2, 3]], seed=7)
    a = _run(simulator(federation, method, seed=21, participation=0.75, rounds=3), 3)
    b = _run(simulator(federation, method, seed=21, participation=0.75, rounds=3), 3)
    assert_weights_equal(a.server.global_weights(), b.server.global_weights())
    assert _records_without_seconds(a) == _records_without_seconds(b)
    if method == "fedhpro":
        assert torch.equal(a.server.hyper, b.server.hyper)

    c = _run(simulator(federation, method, seed=22, participation=0.75, rounds=3), 3)
    assert any(not torch.equal(a.server.global_weights()[n], c.server.global_weights()[n])
               for n in a.server.global_weights())
    assert _records_without_seconds(a) != _records_without_seconds(c)


def test_unrelated_global_randomness_between_rounds_changes_nothing():
    federation = make_federation([10, 14, 18], seed=8)
    a = _run(simulator(federation, "fedhpro", seed=4, rounds=3), 3)

    def noise():
        torch.randn(1000)
        torch.manual_seed(987654)
        torch.rand(17)
        np.random.seed(3)
        np.random.rand(5)

    noise()
    b = _run(simulator(federation, "fedhpro", seed=4, rounds=3), 3, between=noise)
    assert_weights_equal(a.server.global_weights(), b.server.global_weights())
    assert torch.equal(a.server.hyper, b.server.hyper)
    assert _records_without_seconds(a) == _records_without_seconds(b)


def test_building_a_simulator_leaves_the_callers_torch_rng_alone():
    federation = make_federation([6, 6], seed=9)
    torch.manual_seed(1234)
    expected = torch.rand(5)
    torch.manual_seed(1234)
    simulator(federation, "fedhpro", seed=0)
    assert torch.equal(torch.rand(5), expected)


def test_initial_weights_depend_on_the_seed_only():
    federation = make_federation([6, 6], seed=9)
    torch.manual_seed(1)
    a = simulator(federation, seed=3).server.global_weights()
    torch.manual_seed(2)
    b = simulator(federation, seed=3).server.global_weights()
    c = simulator(federation, seed=4).server.global_weights()
    assert_weights_equal(a, b)
    assert not torch.equal(a["classifier.weight"], c["classifier.weight"])


# ----------------------------------------------------------------------------
# evaluation
# ----------------------------------------------------------------------------


class IdentityHead(nn.Module):
    """logits = x @ I (fixed weights): the prediction is the argmax of the input row."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.linear = nn.Linear(classes, classes)
        with torch.no_grad():
            self.linear.weight.copy_(torch.eye(classes))
            self.linear.bias.zero_()

    def forward(self, x):
        return self.linear(x)


def _inputs_predicting(predictions: list[int], classes: int = 3) -> torch.Tensor:
    return torch.eye(classes)[torch.tensor(predictions)] * 2.0 - 0.5


def test_evaluate_reports_percent_per_test_set_and_unweighted_avg():
    # set "a": 4 samples, 3 right (75 %); set "b": 10 samples, 1 right (10 %); set "c": 5 samples, 5 right
    a_pred, a_true = [0, 1, 2, 0], [0, 1, 2, 1]
    b_pred, b_true = [0] * 10, [0] + [1] * 9
    c_pred = [2, 1, 0, 2, 2]
    test_sets = {
        "a": (_inputs_predicting(a_pred), torch.tensor(a_true)),
        "b": (_inputs_predicting(b_pred), torch.tensor(b_true)),
        "c": (_inputs_predicting(c_pred), torch.tensor(c_pred)),
    }
    for batch_size in (1024, 3):  # also across several batches
        accuracy = evaluate(IdentityHead(), test_sets, batch_size=batch_size)
        assert list(accuracy) == ["a", "b", "c", "AVG"]
        assert accuracy["a"] == pytest.approx(75.0)
        assert accuracy["b"] == pytest.approx(10.0)
        assert accuracy["c"] == pytest.approx(100.0)
        assert accuracy["AVG"] == pytest.approx((75.0 + 10.0 + 100.0) / 3)  # not the pooled 12/19
        assert accuracy["AVG"] != pytest.approx(100.0 * 12 / 19)


def test_round_accuracy_is_that_of_the_global_model():
    federation = make_federation([10, 20], seed=10, test_size=30)
    sim = simulator(federation, seed=1, rounds=1)
    record = sim.run_round(0)
    model = TinyNet()
    model.load_state_dict(sim.server.global_weights())
    model.eval()
    expected = {}
    with torch.no_grad():
        for name, (x, y) in federation.test_sets.items():
            correct = sum(int(model(x[i:i + 1]).argmax(1)) == int(y[i]) for i in range(len(y)))
            expected[name] = 100.0 * correct / len(y)
    assert record.accuracy == pytest.approx({**expected, "AVG": sum(expected.values()) / len(expected)})


@pytest.mark.parametrize("rounds,eval_every,evaluated", [(3, 2, [1, 2]), (4, 2, [1, 3]), (3, 1, [0, 1, 2]),
                                                         (3, 5, [2])])
def test_eval_every_evaluates_those_rounds_and_always_the_last(rounds, eval_every, evaluated):
    federation = make_federation([6, 6], seed=11)
    sim = simulator(federation, rounds=rounds, eval_every=eval_every, train=TrainSettings(batch_size=6))
    records = [sim.run_round(r) for r in range(rounds)]
    assert [r.round for r in records if r.accuracy is not None] == evaluated
    for record in records:
        assert ("accuracy" in record.to_json()) == (record.accuracy is not None)
        if record.accuracy is not None:
            assert set(record.accuracy) == {"a", "b", "AVG"}


# ----------------------------------------------------------------------------
# communication bytes
# ----------------------------------------------------------------------------


def _state_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_fedavg_bytes_are_hand_counted():
    # TinyNet, 3x8x8 inputs, d=16, C=4: linear(192->16) + linear(16->4), float32
    hand = (192 * FEATURE_DIM + FEATURE_DIM + FEATURE_DIM * NUM_CLASSES + NUM_CLASSES) * 4
    assert _state_bytes(TinyNet()) == hand
    federation = make_federation([6, 7, 8, 9], seed=12)
    sim = simulator(federation, participation=0.5, seed=2)
    for r in range(2):
        record = sim.run_round(r)
        assert len(record.participants) == 2
        assert record.bytes_down == 2 * hand
        assert record.bytes_up == 2 * (hand + 8)  # weights + the number num_examples


def test_fedavg_bytes_with_batchnorm_buffers():
    model = TinyBNNet()
    hand = 0
    for tensor in model.state_dict().values():  # includes the int64 num_batches_tracked (8 bytes)
        hand += tensor.numel() * tensor.element_size()
    conv = 4 * 3 * 3 * 3 + 4
    bn = 4 * 4 * 4 + 8  # weight, bias, running_mean, running_var (float32) + int64 counter
    linear = 256 * FEATURE_DIM + FEATURE_DIM + FEATURE_DIM * NUM_CLASSES + NUM_CLASSES
    assert hand == conv * 4 + bn + linear * 4
    federation = make_federation([6, 7, 8], seed=12)
    record = simulator(federation, model=TinyBNNet).run_round(0)
    assert record.bytes_down == 3 * hand
    assert record.bytes_up == 3 * (hand + 8)


def test_fedhpro_bytes_are_hand_counted():
    options = FedHProOptions(num_hyper=3, match_steps=1)
    weights = _state_bytes(TinyNet())
    hyper = NUM_CLASSES * 3 * FEATURE_DIM * 4
    # reply: weights, num_examples (8), class_counts (C int64), class_gradients (C x d float32); no prototypes,
    # which the server reads only under fedhpro.prototypes=global*
    reply = weights + 8 + NUM_CLASSES * 8 + NUM_CLASSES * FEATURE_DIM * 4
    federation = make_federation([6, 7, 8, 9], seed=12)
    sim = simulator(federation, "fedhpro", options, participation=0.75, seed=2)
    record = sim.run_round(0)
    assert len(record.participants) == 3
    assert record.bytes_down == 3 * (weights + hyper)
    assert record.bytes_up == 3 * reply


def test_train_metrics_are_n_k_weighted_means_of_client_metrics():
    federation = make_federation([6, 18, 30], seed=13)
    sim = simulator(federation, "fedhpro", seed=0)
    calls = spy_on_fit(sim)
    record = sim.run_round(0)
    sizes = [len(call["data"]) for call in calls]
    names = set().union(*(call["metrics"] for call in calls))
    assert {"ce", "hpcl", "hpal", "loss", "margin"} <= names
    assert set(record.train) == names
    for name in names:
        expected = sum(n * call["metrics"][name] for n, call in zip(sizes, calls)) / sum(sizes)
        assert record.train[name] == pytest.approx(expected, rel=1e-9, abs=1e-12)


# --- the hot path: one working model, parameters loaded in place, no per-client copies -----------------------


def test_load_in_place_gives_load_state_dicts_bits_without_new_tensors():
    from fedhpro.engines.simulator import load_in_place

    model, source = TinyBNNet(), TinyBNNet()
    with torch.no_grad():
        for parameter in source.parameters():
            parameter.normal_()
    source.features[1].running_mean.add_(3.0)
    source.features[1].num_batches_tracked.add_(5)
    weights = snapshot(source.state_dict())
    pointers = {name: t.data_ptr() for name, t in model.state_dict().items()}
    load_in_place(model, weights)
    assert_weights_equal(model.state_dict(), weights)
    assert {name: t.data_ptr() for name, t in model.state_dict().items()} == pointers
    reference = TinyBNNet()
    reference.load_state_dict(weights)
    assert_weights_equal(model.state_dict(), reference.state_dict())
    # what load_state_dict refuses, load_in_place refuses with its message
    with pytest.raises(RuntimeError, match="Missing key"):
        load_in_place(model, {name: t for name, t in weights.items() if name != next(iter(weights))})
    first = next(iter(weights))
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_in_place(model, {**weights, first: torch.zeros(1, 2, 3)})


def test_a_round_trains_every_client_on_the_one_working_model_without_copying_empty_states(monkeypatch):
    federation = make_federation([16, 20, 24, 12], seed=5)
    sim = simulator(federation)
    models = []
    original = sim.client.fit

    def fit(model, payload, data, state, generator):
        models.append(model)
        return original(model, payload, data, state, generator)

    sim.client.fit = fit
    copies = []
    real_deepcopy = copy.deepcopy
    monkeypatch.setattr(copy, "deepcopy", lambda value, *a: copies.append(value) or real_deepcopy(value, *a))
    sim.run_round(0)
    assert len(models) == 4 and all(model is sim.working_model for model in models)
    assert copies == []  # FedAvg keeps no client state: nothing to roll back, nothing copied


def test_personal_models_load_in_place_and_keep_their_own_weights():
    federation = make_federation([16, 20, 24], seed=6)
    sim = Simulator(METHODS["fedavg"], FedAvgOptions(), federation, TinyNet, TRAIN, rounds=5, seed=0,
                    eval_every=5, shared="classifier")  # round 0 is not evaluated
    working = sim.working_models["model"]
    pointers = [p.data_ptr() for p in working.parameters()]
    before = [snapshot(w) for w in sim.client_weights]
    sim.run_round(0)
    assert [p.data_ptr() for p in working.parameters()] == pointers  # the working model's own tensors
    after = sim.client_weights
    for k in range(3):
        assert any(not torch.equal(before[k][n], after[k][n]) for n in before[k])
        assert all(not torch.equal(after[k][n], after[(k + 1) % 3][n]) for n in after[k] if n.endswith("weight"))
    model = sim.models.model_for(1)
    assert model is working
    assert_weights_equal(model.state_dict(), after[1])


def copying_fit(sim: Simulator) -> None:
    """The client's fit wrapped on the instance: the engine then asks for copies (the path before the views)."""
    original = sim.client.fit
    sim.client.fit = lambda model, payload, data, state, generator: original(model, payload, data, state, generator)


@pytest.mark.parametrize("method,rule", [("fedavg", "mean"), ("fedavg", "median"), ("fedgmkd", "mean")],
                         ids=["folded", "robust-held", "not-folding"])
def test_replies_fold_from_the_working_model_without_copies_and_give_the_copies_bits(monkeypatch, method, rule):
    """The simulator's replies are the working model's own tensors (no clone a client), folded before the next
    client loads; replies the round keeps whole (a robust rule, a method that does not fold) are copied when
    received. Against the copying path (a wrapped fit gets copies, as every reply did before): the same bits."""
    from fedhpro.methods import base

    federation = make_federation([16, 20, 24], shifts=[0.0, 0.8, -0.8], seed=7)

    def build() -> Simulator:
        return Simulator(METHODS[method], METHODS[method].options(), federation, TinyBNNet, TRAIN, rounds=2,
                         seed=4, aggregation=AggregationOptions(rule=rule))

    copying = build()
    copying_fit(copying)
    assert not base.lends_weights(copying.client)
    expected = [_records_without_seconds(_run(copying, 2))]

    lending = build()
    assert base.lends_weights(lending.client)
    clones = []
    real_clone = base.clone_weights
    monkeypatch.setattr(base, "clone_weights", lambda *a, **k: clones.append(a) or real_clone(*a, **k))
    assert [_records_without_seconds(_run(lending, 2))] == expected
    assert_weights_equal(lending.server.global_weights(), copying.server.global_weights())
    assert clones == []  # no client's reply was cloned in fit


def test_a_borrowed_reply_is_copied_only_when_the_round_keeps_it_whole():
    from fedhpro.engines.protocol import RoundProtocol
    from fedhpro.methods import base

    model = TinyNet()
    context = MethodContext(model=model, num_classes=NUM_CLASSES, options=FedAvgOptions(), train=TRAIN)
    for rule, kept in (("mean", False), ("median", True)):
        server = METHODS["fedavg"].server(context)
        protocol = RoundProtocol(server, 2, rounds=1, aggregation=AggregationOptions(rule=rule))
        current = protocol.open(0)
        views = base.model_weights(model)
        assert all(views[n].data_ptr() == t.data_ptr() for n, t in model.state_dict().items())
        before = snapshot(views)
        current.receive(0, {"weights": views, "num_examples": 5}, {}, 5, borrowed=True)
        if kept:
            held = current.held[0]["weights"]
            assert all(held[n].data_ptr() != views[n].data_ptr() for n in views)
            assert_weights_equal(held, views)
        else:
            assert "weights" not in current.replies[0]  # folded into the sum, nothing kept of the views
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)  # the next client trains on the model: what the round holds does not move
        if kept:
            assert_weights_equal(current.held[0]["weights"], before)


def test_one_optimizer_per_working_model_gives_a_new_optimizers_bits(monkeypatch):
    """Every client trains the working model with its one SGD optimiser, state cleared: the same bits as a
    new optimiser (a fresh copy of the model, as before), and no optimiser built per client."""
    from fedhpro.methods import training
    from fedhpro.methods.training import local_optimizer, train_epochs

    torch.manual_seed(0)
    federation = make_federation([16, 20, 24], seed=8)
    model = TinyBNNet()
    generator = torch.Generator
    train_epochs(model, federation.clients[0], TRAIN, generator().manual_seed(1))
    first = local_optimizer(model, TRAIN, torch.device("cpu"))
    fresh = copy.deepcopy(model)  # not the working model: a new optimiser, as every client had before
    train_epochs(model, federation.clients[1], TRAIN, generator().manual_seed(2))
    train_epochs(fresh, federation.clients[1], TRAIN, generator().manual_seed(2))
    assert local_optimizer(model, TRAIN, torch.device("cpu")) is first
    assert_weights_equal(model.state_dict(), fresh.state_dict())
    other = dataclasses.replace(TRAIN, lr=0.01)  # other settings: another optimiser
    assert local_optimizer(model, other, torch.device("cpu")) is not first
    assert local_optimizer(model, other, torch.device("cpu")).param_groups[0]["lr"] == 0.01

    built = []
    real_sgd = torch.optim.SGD

    class CountingSGD(real_sgd):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(torch.optim, "SGD", CountingSGD)
    assert training.torch.optim.SGD is CountingSGD
    sim = simulator(federation, model=TinyBNNet, rounds=2)
    _run(sim, 2)
    assert len(built) == 1  # one for the working model, reused by 3 clients x 2 rounds
