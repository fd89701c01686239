"""The client-side plug-in example (``examples/own_method/fedhpro_feddecorr.py``) through the shared hooks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import NUM_CLASSES, TinyNet, make_client

from fedhpro.methods import Client, MethodContext, TrainSettings
from fedhpro.methods.base import clone_weights
from fedhpro.methods.fedavg import FedAvgOptions
from fedhpro.methods.layout import ClassRows

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TRAIN = TrainSettings(epochs=1, batch_size=8, lr=0.1, momentum=0.9, weight_decay=0.0)


@pytest.fixture
def feddecorr(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "own_method"))
    import fedhpro_feddecorr

    return fedhpro_feddecorr


def fit(client_cls, options, seed=0):
    torch.manual_seed(seed)
    model = TinyNet()
    client = client_cls(MethodContext(model=TinyNet(), num_classes=NUM_CLASSES, options=options, train=TRAIN))
    return client.fit(model, {"weights": clone_weights(model)}, make_client(24, [0, 1, 2], seed=3), {},
                      torch.Generator().manual_seed(1))


def test_feddecorr_without_beta_is_fedavg_and_with_beta_adds_its_term(feddecorr):
    reply, metrics = fit(feddecorr.FedDecorrClient, feddecorr.FedDecorrOptions(beta=0.0))
    ref, _ = fit(Client, FedAvgOptions())
    assert all(torch.equal(reply["weights"][k], ref["weights"][k]) for k in ref["weights"])
    assert "decorr" not in metrics and metrics["feature_dim"] == 16.0
    assert torch.equal(reply["class_counts"], torch.tensor([8, 8, 8, 0]))
    reply, metrics = fit(feddecorr.FedDecorrClient, feddecorr.FedDecorrOptions(beta=1.0))
    assert metrics["decorr"] > 0 and list(metrics) == ["ce", "decorr", "loss", "feature_dim"]
    assert not all(torch.equal(reply["weights"][k], ref["weights"][k]) for k in ref["weights"])


def test_feddecorr_declares_its_upload(feddecorr):
    server = feddecorr.FedDecorrServer(MethodContext(model=TinyNet(), num_classes=NUM_CLASSES,
                                                     options=feddecorr.FedDecorrOptions(), train=TRAIN))
    assert server.reply_layout()["class_counts"] == ClassRows((NUM_CLASSES,), torch.int64)
    replies = [fit(feddecorr.FedDecorrClient, feddecorr.FedDecorrOptions())[0]]
    for reply in replies:
        server.validate_reply(reply)
    assert server.aggregate(0, replies)["classes_seen"] == 3.0


def test_decorrelation_of_independent_features_is_small(feddecorr):
    z = torch.randn(4096, 8, generator=torch.Generator().manual_seed(0))
    assert float(feddecorr.decorrelation_loss(z)) == pytest.approx(1 / 8, abs=0.01)  # only the diagonal
    assert float(feddecorr.decorrelation_loss(torch.cat([z[:, :1]] * 8, 1))) == pytest.approx(1.0, abs=1e-3)
