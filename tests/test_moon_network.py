"""MOON's network: the common one by default, the authors' projection head as an option for MOON
(``moon.projection_head=authors``) or for every method (the run key ``projection_head=true``).

References are independent of the code under test: parameter counts by hand, the
contrastive loss by a per-sample loop over Python floats, FedAvg's own update.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import (
    DIGITS_SYN_SIZE,
    DIGITS_TEST_FRACTION,
    NUM_CLASSES,
    TinyBNNet,
    TinyNet,
    make_client,
    make_federation,
)
from torch import nn

from fedhpro.config import load_config
from fedhpro.engines.simulator import Simulator
from fedhpro.errors import ConfigError
from fedhpro.experiment import model_factories
from fedhpro.methods import fedavg, get_method, moon
from fedhpro.methods.base import Client, MethodContext, clone_weights
from fedhpro.methods.fedavg import FedAvgOptions
from fedhpro.methods.moon import MoonClient, MoonOptions
from fedhpro.methods.training import TrainSettings
from fedhpro.models.projection import AUTHORS_PROJECTION_DIM, ProjectionHeadNet

D = 32  # feature_dim of the networks built through the config
C = 10
INPUT = (3, 28, 28)


def network(**settings) -> nn.Module:
    """The global model a run of ``settings`` builds (seed 0), through the engine's own factories."""
    config = load_config({"model": "cnn", "feature_dim": D, **settings})
    factory = model_factories(config, get_method(config.run.method), C, INPUT, num_clients=2)[0]
    torch.manual_seed(0)
    return factory()


def layout(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(parameter.shape)) for name, parameter in model.named_parameters()]


def count(module: nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    first, second = a.state_dict(), b.state_dict()
    assert list(first) == list(second)
    for name in first:
        assert torch.equal(first[name], second[name]), name


# ---------------------------------------------------------------------------- the network


def test_default_moon_network_is_fedavgs_parameter_for_parameter():
    assert MoonOptions().projection_head == "none"
    moon_net, fedavg_net = network(method="moon"), network(method="fedavg")
    assert not isinstance(moon_net, ProjectionHeadNet)
    assert layout(moon_net) == layout(fedavg_net)
    assert ("classifier.weight", (C, D)) in layout(moon_net)
    assert_same_state(moon_net, fedavg_net)  # same seed, same network: the same weights too


def test_authors_head_adds_the_parameters_counted_by_hand():
    plain = network(method="moon")
    headed = network(method="moon", **{"moon.projection_head": "authors"})
    assert isinstance(headed, ProjectionHeadNet)
    p = AUTHORS_PROJECTION_DIM
    head = headed.features[1:]  # l1, ReLU, l2 after the common feature extractor
    assert [type(layer) for layer in head] == [nn.Linear, nn.ReLU, nn.Linear]
    assert (head[0].in_features, head[0].out_features, head[2].in_features, head[2].out_features) == (D, D, D, p)
    assert count(head) == D * D + D + D * p + p
    assert (headed.classifier.in_features, headed.classifier.out_features) == (p, C)
    assert count(headed) == count(plain.features) + (D * D + D + D * p + p) + (p * C + C)
    x = torch.randn(2, *INPUT)
    assert headed.features(x).shape == (2, p)
    assert torch.equal(headed(x), headed.classifier(headed.features(x)))


def test_switch_gives_fedavg_the_head_and_moon_the_same_network_as_its_own_option():
    fedavg_headed = network(method="fedavg", projection_head=True)
    moon_switch = network(method="moon", projection_head=True)
    moon_authors = network(method="moon", **{"moon.projection_head": "authors"})
    assert isinstance(fedavg_headed, ProjectionHeadNet)
    assert layout(fedavg_headed) == layout(moon_authors)
    assert_same_state(moon_switch, moon_authors)
    assert_same_state(fedavg_headed, moon_authors)
    both = network(method="moon", projection_head=True, **{"moon.projection_head": "authors"})
    assert_same_state(both, moon_authors)  # one head, never two
    assert not isinstance(both.features[0], ProjectionHeadNet) and len(both.features) == 4


def test_switch_with_another_moon_projection_width_is_refused_in_one_line():
    with pytest.raises(ConfigError) as error:
        network(method="moon", projection_head=True, **{"moon.projection_dim": 128})
    message = str(error.value)
    assert "\n" not in message and "moon.projection_dim=128" in message and "256" in message


def test_model_dot_projection_head_points_to_the_run_key():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["model.projection_head=true"])
    assert "did you mean" in str(error.value) and " 'projection_head'" in str(error.value)
    assert load_config(None, ["projection_head=true"]).run.projection_head is True
    assert load_config(None).run.projection_head is False


# ---------------------------------------------------------------------------- the loss, on z


def slow_moon_loss(z, z_glob, z_prev, tau: float) -> float:
    """mean over samples of -log(e^{cos(z, zg)/tau} / (e^{cos(z, zg)/tau} + e^{cos(z, zp)/tau})), one by one."""

    def cos(u, v):
        dot = sum(a * b for a, b in zip(u, v))
        return dot / (math.sqrt(sum(a * a for a in u)) * math.sqrt(sum(b * b for b in v)))

    total = 0.0
    for a, g, p in zip(z.tolist(), z_glob.tolist(), z_prev.tolist()):
        positive, negative = math.exp(cos(a, g) / tau), math.exp(cos(a, p) / tau)
        total += -math.log(positive / (positive + negative))
    return total / len(z)


def fit(client_cls, options, model, data, train, *, state=None, payload=None):
    context = MethodContext(model=TinyNet(), num_classes=NUM_CLASSES, options=options, train=train, seed=0)
    state = {} if state is None else state
    payload = payload if payload is not None else {"weights": clone_weights(model)}
    reply, metrics = client_cls(context).fit(model, payload, data, state, torch.Generator().manual_seed(5))
    return reply, metrics, state


def test_contrastive_loss_is_on_the_feature_z_of_the_common_network():
    # one full-batch step: the reported term is mu * the loss at the received weights
    data = make_client(6, [0, 1, 2, 3], seed=3, dtype=torch.float64)
    train = TrainSettings(epochs=1, batch_size=8, lr=0.1, momentum=0.9, weight_decay=0.0)
    options = MoonOptions(mu=2.0, tau=0.5)
    torch.manual_seed(1)
    model = moon.wrap_model(TinyNet(), options, NUM_CLASSES).double()
    torch.manual_seed(2)
    previous = TinyNet().double()
    assert type(model) is TinyNet  # projection_head=none: the network as given
    with torch.no_grad():
        z, z_prev = model.features(data.x), previous.features(data.x)
        logits, logits_prev = model(data.x), previous(data.x)
    expected = 2.0 * slow_moon_loss(z, z, z_prev, 0.5)  # the global model is the received one
    on_logits = 2.0 * slow_moon_loss(logits, logits, logits_prev, 0.5)
    assert abs(expected - on_logits) > 1e-3  # the check tells z from the logits
    payload = {"weights": clone_weights(model)}
    twin = TinyNet().double()
    twin.load_state_dict(payload["weights"])
    reply, metrics, _ = fit(MoonClient, options, model, data, train, payload=payload,
                            state={"previous_weights": clone_weights(previous)})
    assert metrics["moon"] == pytest.approx(expected, rel=1e-9)
    # the term pulls on the feature extractor only: the classifier's one step is FedAvg's
    plain = fit(Client, FedAvgOptions(), twin, data, train, payload=payload)[0]["weights"]
    assert not torch.allclose(reply["weights"]["features.1.weight"], plain["features.1.weight"])
    assert torch.allclose(reply["weights"]["classifier.weight"], plain["classifier.weight"], atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------- round 0


def simulate(spec, rounds: int):
    federation = make_federation([10, 12, 9], classes=[[0, 1], [1, 2, 3], [0, 3]])

    def factory():
        torch.manual_seed(7)
        return spec.model_wrapper(TinyBNNet(), spec.options(), NUM_CLASSES) if spec.model_wrapper else TinyBNNet()

    train = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-5)
    sim = Simulator(spec, spec.options(), federation, factory, train, rounds=rounds)
    assert all("previous_weights" not in state for state in sim.client_states)  # the pool starts empty
    return sim, [sim.run_round(r) for r in range(rounds)]


def test_round_zero_has_no_contrastive_term_so_moon_equals_fedavg_there():
    moon_sim, moon_records = simulate(moon.METHOD, rounds=1)
    fedavg_sim, _ = simulate(fedavg.METHOD, rounds=1)
    assert "moon" not in moon_records[0].train
    first, second = moon_sim.server.global_weights(), fedavg_sim.server.global_weights()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert all("previous_weights" in state for state in moon_sim.client_states)
    _, records = simulate(moon.METHOD, rounds=2)
    assert "moon" in records[1].train and records[1].train["moon"] > 0


# ---------------------------------------------------------------------------- the command line


def run_cli(out, *extra) -> int:
    from fedhpro.cli import main

    return main(["run", "method=moon", "dataset=digits-offline", "data.domains=[mnist]",
                 f"data.syn_size={DIGITS_SYN_SIZE}", f"data.test_fraction={DIGITS_TEST_FRACTION}",
                 "data.fraction=0.02", "rounds=2", "local_epochs=1", f"feature_dim={D}", "batch_size=128", "device=cpu",
                 "progress=false", "checkpoint_every=0", f"out={out}", *extra])


@pytest.mark.slow
def test_cli_runs_moon_on_both_networks(digits_data_dir, tmp_path, capsys):
    rows = {}
    for name, extra in [("none", []), ("authors", ["moon.projection_head=authors"])]:
        out = tmp_path / name
        assert run_cli(out, f"data_dir={digits_data_dir}", *extra) == 0, capsys.readouterr().err
        rows[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert "moon" not in rows[name][0]["train"] and "moon" in rows[name][1]["train"]
        assert f"projection_head: {name}" in (out / "config.yaml").read_text()
    clients = len(rows["none"][0]["participants"])
    p = AUTHORS_PROJECTION_DIM
    extra_per_client = (D * D + D + D * p + p) + (p * C + C) - (D * C + C)  # the head, the wider classifier
    assert rows["authors"][0]["params_up"] - rows["none"][0]["params_up"] == clients * extra_per_client
