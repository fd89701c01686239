"""Heterogeneous feature extractors (HtFE): only the classifier is shared, feature extractors persist."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import FEATURE_DIM, IMAGE_SHAPE, NUM_CLASSES, TinyBNNet, TinyNet, make_federation
from fedhpro.engines.client_tests import evaluate
from fedhpro.engines.simulator import Simulator, derive_seed
from fedhpro.methods import METHODS, TrainSettings

TRAIN = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=0.0)
ARCHITECTURES = {"tiny": TinyNet, "tiny-bn": TinyBNNet}


def factory(name: str) -> nn.Module:
    return ARCHITECTURES[name](NUM_CLASSES, IMAGE_SHAPE, FEATURE_DIM)


def federation(sizes=(20, 28, 36, 24)):
    fed = make_federation(list(sizes))
    fed.client_domains = ["a", "b", "a", "b"][: len(sizes)]
    return fed


def simulator(method: str = "fedavg", **kwargs) -> Simulator:
    spec = METHODS[method]
    fed = federation()
    architectures = ["tiny", "tiny-bn"] * (fed.num_clients // 2)
    return Simulator(spec, spec.options(), fed, lambda: factory("tiny"), TRAIN, rounds=3, seed=5,
                     client_architectures=architectures, architecture_factory=factory, **kwargs)


@pytest.mark.parametrize("method", ["fedavg", "fedhpro"])
def test_global_classifier_is_the_weighted_mean_of_uploaded_classifiers(method):
    sim = simulator(method)
    broadcast = sim.server.broadcast(0)
    assert set(broadcast["weights"]) == {"classifier.weight", "classifier.bias"}
    # reference: train every client ourselves from its own persistent model, then average by hand
    uploads, sizes = [], []
    for k in range(sim.federation.num_clients):
        model = factory(sim.client_architectures[k])
        model.load_state_dict(sim.client_weights[k])
        generator = torch.Generator().manual_seed(derive_seed(5, 3, 0, k))
        reply, _ = sim.client.fit(model, copy.deepcopy(broadcast), sim.federation.clients[k], {}, generator)
        assert set(reply["weights"]) == {"classifier.weight", "classifier.bias"}
        uploads.append({name: t.double() for name, t in reply["weights"].items()})
        sizes.append(len(sim.federation.clients[k]))
    sim.run_round(0)
    total = sum(sizes)
    for name in ("classifier.weight", "classifier.bias"):
        expected = sum(u[name] * (n / total) for u, n in zip(uploads, sizes))
        torch.testing.assert_close(sim.server.global_weights()[name].double(), expected, rtol=1e-6, atol=1e-7)
    unweighted = sum(u["classifier.weight"] for u in uploads) / len(uploads)
    assert not torch.allclose(sim.server.global_weights()["classifier.weight"].double(), unweighted, atol=1e-4)


def test_feature_extractors_differ_by_architecture_and_persist_across_rounds():
    sim = simulator()
    assert set(sim.working_models) == {"tiny", "tiny-bn"}
    before = [copy.deepcopy(w) for w in sim.client_weights]
    sim.run_round(0)
    after_first = [copy.deepcopy(w) for w in sim.client_weights]
    # architectures differ: the two kinds of client hold different state keys
    assert set(after_first[0]) != set(after_first[1])
    assert any("features.1.running_mean" in key for key in after_first[1])
    for k in range(sim.federation.num_clients):
        feature_keys = [key for key in before[k] if not key.startswith("classifier.")]
        # trained this round, so the extractor moved ...
        assert any(not torch.equal(before[k][key], after_first[k][key]) for key in feature_keys
                   if before[k][key].is_floating_point())
    global_after_first = copy.deepcopy(sim.server.global_weights())
    sim.run_round(1)
    # ... and round 1 starts from the client's own extractor plus the aggregated classifier: reproduce it
    for k in range(sim.federation.num_clients):
        model = factory(sim.client_architectures[k])
        model.load_state_dict(after_first[k])
        generator = torch.Generator().manual_seed(derive_seed(5, 3, 1, k))
        sim.client.fit(model, {"weights": copy.deepcopy(global_after_first)}, sim.federation.clients[k], {},
                       generator)
        for key, value in model.state_dict().items():
            assert torch.equal(value, sim.client_weights[k][key]), (k, key)
    # two clients of the same architecture keep different extractors
    same_arch = [i for i, name in enumerate(sim.client_architectures) if name == "tiny"]
    a, b = same_arch[:2]
    assert not torch.equal(sim.client_weights[a]["features.1.weight"], sim.client_weights[b]["features.1.weight"])


def test_extractors_persist_exactly_when_a_client_sits_out():
    sim = simulator(participation=0.5)
    for round_index in range(3):
        participants = sim.sample_clients(round_index)
        before = [copy.deepcopy(w) for w in sim.client_weights]
        sim.run_round(round_index)
        for k in range(sim.federation.num_clients):
            if k not in participants:
                assert all(torch.equal(before[k][key], sim.client_weights[k][key]) for key in before[k])


def test_heterogeneous_evaluation_averages_each_clients_model_on_its_own_test_set():
    sim = simulator()
    record = sim.run_round(0)
    global_classifier = sim.server.global_weights()
    per_domain: dict[str, list[float]] = {}
    for k in range(sim.federation.num_clients):
        model = factory(sim.client_architectures[k])
        model.load_state_dict({**sim.client_weights[k], **global_classifier})
        domain = sim.federation.client_domains[k]
        x, y = sim.federation.test_sets[domain]
        with torch.no_grad():
            model.eval()
            accuracy = 100.0 * float((model(x).argmax(1) == y).float().mean())
        per_domain.setdefault(domain, []).append(accuracy)
    expected = {d: sum(v) / len(v) for d, v in per_domain.items()}
    for domain, value in expected.items():
        assert record.accuracy[domain] == pytest.approx(value)
    assert record.accuracy["AVG"] == pytest.approx(sum(expected.values()) / len(expected))


def test_fedhpro_matches_hyper_prototypes_with_the_shared_classifier():
    sim = simulator("fedhpro")
    start = sim.server.hyper.clone()
    record = sim.run_round(0)
    assert record.server["gm_loss_after"] < record.server["gm_loss_before"]
    assert not torch.equal(start, sim.server.hyper)
    # only the classifier travels: bytes up = K x (classifier + FedHPro's per-class tensors)
    classifier_bytes = (NUM_CLASSES * FEATURE_DIM + NUM_CLASSES) * 4
    extra = NUM_CLASSES * FEATURE_DIM * 4 + NUM_CLASSES * 8 + 8  # gradients, counts, n_k (no prototypes: unread)
    assert record.bytes_up == sim.federation.num_clients * (classifier_bytes + extra)


def test_mismatched_classifier_shapes_are_a_clear_error():
    from fedhpro.errors import ConfigError

    def bad_factory(name):
        return TinyNet(NUM_CLASSES, IMAGE_SHAPE, FEATURE_DIM if name == "tiny" else FEATURE_DIM * 2)

    spec = METHODS["fedavg"]
    with pytest.raises(ConfigError, match="feature_dim"):
        Simulator(spec, spec.options(), federation(), lambda: factory("tiny"), TRAIN, rounds=1,
                  client_architectures=["tiny", "other", "tiny", "other"], architecture_factory=bad_factory)


def test_shared_none_keeps_every_client_model_personal():
    """Prototype-only protocols: no weights travel, each client's whole model persists and is evaluated alone."""
    spec = METHODS["fedavg"]
    fed = federation()
    sim = Simulator(spec, spec.options(), fed, lambda: factory("tiny"), TRAIN, rounds=2, seed=5, shared="none")
    assert sim.server.broadcast(0)["weights"] == {}
    record = sim.run_round(0)
    assert record.bytes_down == 0
    # clients trained alone: client k's model equals its own training from its own initial weights
    k = 1
    model = factory("tiny")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(5, 1, k))
        initial = factory("tiny").state_dict()
    model.load_state_dict(initial)
    sim.client.fit(model, {"weights": {}}, fed.clients[k], {}, torch.Generator().manual_seed(derive_seed(5, 3, 0, k)))
    for key, value in model.state_dict().items():
        assert torch.equal(value, sim.client_weights[k][key])
    # evaluation: each client's own model on its own domain's test set, averaged per domain then over domains
    per_domain: dict[str, list[float]] = {}
    for i in range(fed.num_clients):
        m = factory("tiny")
        m.load_state_dict(sim.client_weights[i])
        domain = fed.client_domains[i]
        per_domain.setdefault(domain, []).append(evaluate(m, {domain: fed.test_sets[domain]})[domain])
    for domain, values in per_domain.items():
        assert record.accuracy[domain] == pytest.approx(sum(values) / len(values))
