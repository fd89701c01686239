"""8-bit client images kept as uint8 (a quarter of float32's memory), decoded exactly at each access.

References: ``normalize_images`` applied up front (the floats must be the same, to the bit), the tensors'
own byte counts, and a digits-offline run's bytes against a federation rebuilt with float clients.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION

from fedhpro.data.federation import ClientData, CompactClientData, normalize_images
from fedhpro.errors import DataError


def test_compact_data_decodes_to_the_same_floats_in_a_quarter_of_the_memory():
    pixels = torch.randint(0, 256, (7, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    y = torch.arange(7) % 3
    compact = CompactClientData(pixels, y, 3, normalize_images)
    eager = ClientData(normalize_images(pixels.clone()), y, 3)
    assert torch.equal(compact.x, eager.x) and compact.x.dtype == torch.float32
    assert compact.pixels.nbytes * 4 == eager.x.nbytes
    index = torch.tensor([5, 0, 3])
    assert torch.equal(compact.select(index).x, eager.select(index).x)
    assert isinstance(compact.select(index), CompactClientData)
    moved = compact.to(torch.device("cpu"))
    assert isinstance(moved, CompactClientData) and torch.equal(moved.x, eager.x) and len(moved) == 7
    with pytest.raises(AttributeError, match="read-only"):
        compact.x = eager.x
    with pytest.raises(DataError, match="uint8"):
        CompactClientData(eager.x, y, 3, normalize_images)


@pytest.mark.slow
def test_digits_offline_clients_are_compact_and_train_as_before(digits_data_dir, tmp_path, monkeypatch):
    from fedhpro import api
    from fedhpro.data import digits_federation

    settings = dict(method="fedavg", rounds=1, clients=4, local_epochs=1, feature_dim=16, progress=False,
                    threads=1, data_dir=str(digits_data_dir), **{"data.fraction": 0.02,
                                                                  "data.syn_size": DIGITS_SYN_SIZE,
                                                                  "data.test_fraction": DIGITS_TEST_FRACTION,
                                                                  "validation": 0.2})
    compact = api.run(out=str(tmp_path / "compact"), **settings)
    eager_client = digits_federation._client

    def float_client(data, index):  # the federation as before: every client's images decoded up front
        client, counts = eager_client(data, index)
        assert isinstance(client, CompactClientData)
        return ClientData(client.x.clone(), client.y, client.num_classes), counts

    monkeypatch.setattr(digits_federation, "_client", float_client)
    eager = api.run(out=str(tmp_path / "eager"), **settings)
    for name in ("metrics.jsonl", "model.pt"):
        assert (tmp_path / "compact" / name).read_bytes() == (tmp_path / "eager" / name).read_bytes(), name
    assert json.loads((tmp_path / "compact" / "summary.json").read_text())["accuracy"] == eager.accuracy
    assert compact.accuracy == eager.accuracy
