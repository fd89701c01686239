"""The run key ``max_grad_norm`` (one gradient cap for every method) and the divergence stop.

``max_grad_norm``: unset, the method's own default (FedRCL 10, the others none); 0, off; > 0, the local gradient's
global L2 norm is capped at it before each SGD step. Checked against a hand computation of one SGD step of a
one-parameter model, where the gradient, its norm and the clipped step are written out. ``fedrcl.max_grad_norm``
is the old spelling: it warns, and beside ``max_grad_norm`` set to another value it is refused.

A local round whose mean cross-entropy is non-finite or above 100x its first batch's stops an in-process run with
one line naming the client, the round, the lr and the cap; the same run with a cap trains on."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION
from torch import nn

from fedhpro import cli
from fedhpro.config import load_config
from fedhpro.data.federation import ClientData
from fedhpro.errors import ConfigError, TrainingDiverged
from fedhpro.experiment import model_factories
from fedhpro.methods import METHODS
from fedhpro.methods.base import Client, MethodContext
from fedhpro.methods.training import DIVERGENCE_FACTOR, TrainSettings, divergence, train_epochs

#: the input of the one-parameter model: its gradient at w = 0 is -X (below)
X = 20.0


class OneWeight(nn.Module):
    """``features``: z = w x (one weight w, from 0); ``classifier``: fixed logits (z, -z). For a batch of
    samples x = X, label 0: CE = log(1 + e^{-2wX}), so dCE/dw = -2X / (1 + e^{2wX}) = -X at w = 0."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Linear(1, 1, bias=False)
        self.classifier = nn.Linear(1, 2, bias=False)
        with torch.no_grad():
            self.features.weight.zero_()
            self.classifier.weight.copy_(torch.tensor([[1.0], [-1.0]]))
        self.classifier.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def one_step(cap: float | None) -> float:
    """w after one plain SGD step (lr 1, no momentum, no weight decay) from w = 0 with the cap as given."""
    model = OneWeight()
    data = ClientData(torch.full((2, 1), X), torch.zeros(2, dtype=torch.long), 2)
    train = TrainSettings(epochs=1, batch_size=2, lr=1.0, momentum=0.0, weight_decay=0.0, max_grad_norm=cap)
    train_epochs(model, data, train, torch.Generator().manual_seed(0))
    return float(model.features.weight.detach())


def by_hand(cap: float | None) -> float:
    """One SGD step by hand: the gradient is -X, its norm X; a cap c < X scales it by c / (X + 1e-6) (torch's
    clip_grad_norm_, with its epsilon), so w = X x min(1, c / (X + 1e-6))."""
    if not cap:
        return X
    return X * min(1.0, cap / (X + 1e-6))


@pytest.mark.parametrize("cap", [None, 0.0, 5.0, 10.0, 50.0])
def test_the_cap_clips_one_sgd_step_as_by_hand(cap):
    assert one_step(cap) == pytest.approx(by_hand(cap), rel=1e-6)
    assert by_hand(5.0) == pytest.approx(5.0, rel=1e-6) and by_hand(None) == by_hand(0.0) == X


class AuthorsClip(Client):
    """A plug-in method whose authors clip at 10: it says so once, in its client."""

    def default_max_grad_norm(self) -> float | None:
        return 10.0


def settings_of(*overrides: str) -> TrainSettings:
    """The TrainSettings a run of these settings builds (before its method's default joins)."""
    config = load_config(None, list(overrides))
    return model_factories(config, METHODS[config.run.method], 2, (1,), 2)[4]


def fitted(client_class: type, train: TrainSettings, options=None) -> float:
    """w after ``client_class``'s local round (one step from w = 0) with the run's settings ``train``."""
    model = OneWeight()
    client = client_class(MethodContext(model=model, num_classes=2, options=options, train=train))
    data = ClientData(torch.full((2, 1), X), torch.zeros(2, dtype=torch.long), 2)
    weights = {key: value.clone() for key, value in model.state_dict().items()}
    client.fit(model, {"weights": weights}, data, {}, torch.Generator().manual_seed(0))
    return float(model.features.weight.detach())


@pytest.mark.parametrize(("overrides", "plain", "authors"), [
    ((), X, by_hand(10.0)),  # unset: no cap for FedAvg, the method's own 10 for a method that declares one
    (("max_grad_norm=0",), X, X),  # 0: off, for every method
    (("max_grad_norm=5",), by_hand(5.0), by_hand(5.0)),  # > 0: that cap, for every method
])
def test_the_run_key_unset_off_or_set_against_the_hand_step(overrides, plain, authors):
    train = dict(lr=1.0, momentum=0.0, weight_decay=0.0, local_epochs=1, batch_size=2)
    settings = settings_of(*overrides, *(f"{key}={value}" for key, value in train.items()))
    assert fitted(Client, settings) == pytest.approx(plain, rel=1e-6)
    assert fitted(AuthorsClip, settings) == pytest.approx(authors, rel=1e-6)


def test_fedrcl_keeps_its_cap_of_10_and_its_old_key_is_an_alias():
    def fedrcl_cap(*overrides: str) -> float | None:
        config = load_config(None, ["method=fedrcl", *overrides])
        train = model_factories(config, METHODS["fedrcl"], 2, (1,), 2)[4]
        client = METHODS["fedrcl"].client(MethodContext(model=OneWeight(), num_classes=2,
                                                        options=config.method_options, train=train))
        return client.train.max_grad_norm

    assert fedrcl_cap() == 10.0  # unchanged: FedRCL runs keep their bytes
    assert fedrcl_cap("max_grad_norm=0") == 0.0 and fedrcl_cap("max_grad_norm=3") == 3.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for the new key, nor for the old one at its default
        assert settings_of("method=fedrcl", "max_grad_norm=3").max_grad_norm == 3.0
        load_config(None, ["method=fedrcl", "fedrcl.max_grad_norm=10"])
    with pytest.warns(FutureWarning, match=r"^fedrcl.max_grad_norm is the old spelling of max_grad_norm: "
                                           r"write max_grad_norm=5.0$"):
        assert fedrcl_cap("fedrcl.max_grad_norm=5") == 5.0
    with pytest.warns(FutureWarning):
        assert fedrcl_cap("fedrcl.max_grad_norm=5", "max_grad_norm=5") == 5.0  # the same value: warned, run
    with pytest.raises(ConfigError, match=r"^fedrcl.max_grad_norm=5.0 and max_grad_norm=3.0 disagree: "
                                          r"fedrcl.max_grad_norm is the old spelling of max_grad_norm; set only "
                                          r"max_grad_norm$"):
        load_config(None, ["method=fedrcl", "fedrcl.max_grad_norm=5", "max_grad_norm=3"])
    load_config(None, ["method=fedavg", "fedrcl.max_grad_norm=5", "max_grad_norm=3"])  # not the run's method


def test_the_check_against_hand_values():
    train = TrainSettings(lr=0.05)
    assert divergence(2.31, 2.31 * DIVERGENCE_FACTOR, 10, train) is None  # at 100x: not yet
    error = divergence(2.31, 2200.0, 10, train)
    assert str(error) == ("local training diverged: its mean cross-entropy rose to 2.2e+03, 952x its first "
                          "batch's 2.31 (lr=0.05, max_grad_norm off); lower lr or set max_grad_norm=10")
    assert str(error.at(7, 1)).startswith("client 7 diverged in round 1: its mean cross-entropy rose to 2.2e+03")
    assert "max_grad_norm=10); lower lr or max_grad_norm" in str(divergence(2.31, math.nan, 10,
                                                                           TrainSettings(max_grad_norm=10.0)))
    # a first batch below the chance level ln(10) = 2.30 is measured against the chance level: no false stop
    assert divergence(0.001, 0.5, 10, train) is None and divergence(0.001, 229.0, 10, train) is None
    assert divergence(0.001, 231.0, 10, train) is not None


@pytest.mark.slow
def test_an_exploding_run_stops_with_one_line_and_the_cap_keeps_it_training(digits_data_dir, tmp_path, capsys):
    tiny = ["run", "method=fedavg", "lr=50", "rounds=2", "clients=2", "local_epochs=1", "data.fraction=0.02",
            f"data.syn_size={DIGITS_SYN_SIZE}", f"data.test_fraction={DIGITS_TEST_FRACTION}", "feature_dim=16",
            "progress=false", "threads=1", "device=cpu", f"data_dir={digits_data_dir}"]
    assert cli.main([*tiny, f"out={tmp_path / 'off'}"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("fedhpro: error: client ") and " diverged in round 1: its mean cross-entropy rose to " in err
    assert err.rstrip().endswith("(lr=50, max_grad_norm off); lower lr or set max_grad_norm=10")
    assert cli.main([*tiny, "max_grad_norm=0.01", f"out={tmp_path / 'capped'}"]) == 0
    assert (tmp_path / "capped" / "summary.json").exists()


def test_a_diverging_client_raises_the_line_itself():
    """The client raises (privacy=client keeps its metrics on it; a Flower node sends the line as its error)."""
    model = OneWeight()
    data = ClientData(torch.full((4, 1), X), torch.tensor([0, 1, 0, 1]), 2)
    train = TrainSettings(epochs=3, batch_size=2, lr=1e4, momentum=0.0, weight_decay=0.0)
    with pytest.raises(TrainingDiverged, match=r"^local training diverged: its mean cross-entropy rose to .*"
                                               r"\(lr=10000, max_grad_norm off\); lower lr or set max_grad_norm=10$"):
        train_epochs(model, data, train, torch.Generator().manual_seed(0))
