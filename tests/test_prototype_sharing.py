"""What the prototype methods share, written once: what a server exposes to the diagnostics
(``Server.exposed_prototypes``, read by ``Simulator.server_prototypes``), the one ``derive_seed`` of the
engines and the methods, and the one class-means / mean-over-holders code of ``functional`` and ``metrics``.

References: the payload each server broadcasts (what its clients receive), seeds recorded before
``derive_seed`` moved to ``fedhpro.seeds``, and Python loops over clients and classes.
"""

from __future__ import annotations

import pytest
import torch
from conftest import NUM_CLASSES, TinyNet, make_federation

from fedhpro import functional, metrics
from fedhpro.engines.simulator import Simulator
from fedhpro.methods import METHODS
from fedhpro.methods.training import TrainSettings
from fedhpro.seeds import derive_seed

TRAIN = TrainSettings(epochs=1, batch_size=8, lr=0.05)

#: (method, options); every prototype method, local and hyper, FedHPro and FedAvg
SERVERS = [
    ("fedavg", {}),
    ("fedhpro", {"num_hyper": 2, "match_steps": 2}),
    ("fedproto", {}),
    ("fedproto", {"prototypes": "hyper", "num_hyper": 2, "match_steps": 2}),
    ("fedtgp", {"server_epochs": 2}),
    ("fedgmkd", {"max_components": 2}),
    ("fedgmkd", {"prototypes": "hyper", "num_hyper": 2, "match_steps": 2}),
    ("fedsa", {}),
    ("fedsa", {"prototypes": "hyper", "num_hyper": 2, "match_steps": 2}),
]


def broadcast_prototypes(method: str, options, payload: dict) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    """What the clients receive as the server's prototypes, read from the broadcast payload."""
    everyone = torch.ones(NUM_CLASSES, dtype=torch.bool)
    if method == "fedavg":
        return None
    if method == "fedhpro":
        return payload["hyper_prototypes"].mean(1), everyone, "hyper"
    kind = "hyper" if options.prototypes == "hyper" else "global"
    if method == "fedsa":
        return payload["anchors"], everyone, kind
    return payload["prototypes"], payload["prototype_mask"], kind


@pytest.mark.parametrize("method,knobs", SERVERS, ids=[f"{m}-{k.get('prototypes', 'own')}" for m, k in SERVERS])
def test_every_server_exposes_the_prototypes_it_broadcasts(method, knobs):
    spec = METHODS[method]
    options = spec.options(**knobs)
    federation = make_federation([12, 10, 9], classes=[[0, 1], [1, 2], [0, 2]])  # nobody holds class 3
    sim = Simulator(spec, options, federation, TinyNet, TRAIN, rounds=1, seed=4)
    sim.run_round(0)
    exposed = sim.server_prototypes()
    expected = broadcast_prototypes(method, options, sim.server.broadcast(1))
    if expected is None:
        assert exposed is None
        return
    prototypes, mask, kind = exposed
    assert kind == expected[2]
    assert mask.dtype == torch.bool and mask.tolist() == expected[1].tolist()
    torch.testing.assert_close(prototypes, expected[0], rtol=0, atol=0)
    if kind == "global" and method != "fedsa":  # a method's own prototypes: only the classes someone held
        assert mask.tolist() == [True, True, True, False]


def test_derive_seed_is_one_function_with_the_recorded_values():
    # recorded before derive_seed moved to fedhpro.seeds: every run's randomness depends on these
    assert derive_seed(0) == 7896617691693857887
    assert derive_seed(7, 3, 1, 2) == 8711250018134922203
    assert derive_seed(5, 41) == 6348864052564571326


def test_metrics_class_means_are_the_functional_ones_in_float64():
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(40, 6, generator=generator) * 1e3 + 1e4  # float32 sums would round
    labels = torch.randint(0, 5, (40,), generator=generator)
    labels[labels == 4] = 3  # class 4 absent
    means, present = metrics.class_means(features, labels, 5)
    reference = torch.zeros(5, 6, dtype=torch.float64)
    for c in range(5):
        rows = [features[i].double() for i in range(40) if int(labels[i]) == c]
        if rows:
            reference[c] = sum(rows) / len(rows)
    assert means.dtype == torch.float32 and present.tolist() == [True, True, True, True, False]
    torch.testing.assert_close(means, reference.float(), rtol=0, atol=0)
    in_double, _ = functional.local_prototypes(features.double(), labels, 5)
    assert torch.equal(means, in_double.float())


def test_mean_client_prototypes_is_one_function_and_skips_what_absent_classes_hold():
    assert metrics.mean_client_prototypes is functional.mean_client_prototypes
    prototypes = torch.tensor([[[1.0, 2.0], [float("nan"), 0.0]],
                               [[3.0, 6.0], [5.0, 1.0]],
                               [[float("inf"), 0.0], [7.0, 3.0]]])  # 3 clients, 2 classes, d = 2
    present = torch.tensor([[True, False], [True, True], [False, True]])
    mean, held = functional.mean_client_prototypes(prototypes, present)
    reference = [[sum(float(prototypes[k, c, j]) for k in range(3) if present[k, c])
                  / sum(bool(present[k, c]) for k in range(3)) for j in range(2)] for c in range(2)]
    assert mean.tolist() == reference and held.tolist() == [True, True]
    nobody, held = functional.mean_client_prototypes(prototypes, torch.zeros(3, 2, dtype=torch.bool))
    assert nobody.tolist() == [[0.0, 0.0], [0.0, 0.0]] and held.tolist() == [False, False]
