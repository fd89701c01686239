"""data.standardize=federated end to end: the shared scaling equals scikit-learn's StandardScaler fitted on every
site's training rows pooled, in the simulator and on Flower nodes (the real ClientApp on each site's own folder),
a label-skewed real table trains to within 2 points of a pooled logistic regression (per-site scaling cannot),
a hostile node's sums are left out, privacy refuses or avoids the release, and predict scales as training did."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from flwr.app import Message, RecordDict
from sklearn.datasets import load_wine
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from test_flower import CORE_KEYS, core, read_rows, reference

import fedhpro
from fedhpro.config import load_config
from fedhpro.data.clients import ClientsOptions, build
from fedhpro.errors import ConfigError
from fedhpro.flower import records
from fedhpro.flower.answers import SUMS_KEYS
from fedhpro.flower.local_grid import LocalGrid, inside_a_run
from fedhpro.flower.server import run_server


def write_sites(root: Path, seed: int = 0) -> list[Path]:
    """scikit-learn's wine table as three sites, as the rows come when sorted by class: site-0 holds one
    class, site-1 two, site-2 two; 70 % of each site's rows train, the rest test (train.csv, test.csv)."""
    data = load_wine(as_frame=True)
    rng = np.random.default_rng(seed)
    order = np.argsort(data.target.to_numpy(), kind="stable")
    folders = []
    for k, part in enumerate(np.array_split(order, 3)):
        part = rng.permutation(part)
        cut = int(0.7 * len(part))
        folder = root / f"site-{k}"
        folder.mkdir(parents=True)
        for split, rows in (("train", part[:cut]), ("test", part[cut:])):
            frame = data.data.iloc[rows].copy()
            frame["label"] = data.target.iloc[rows].to_numpy()
            frame.to_csv(folder / f"{split}.csv", index=False)
        folders.append(folder)
    return folders


def raw(folders: list[Path], split: str) -> list[pd.DataFrame]:
    return [pd.read_csv(folder / f"{split}.csv") for folder in folders]


@pytest.fixture(scope="module")
def sites(tmp_path_factory) -> list[Path]:
    return write_sites(tmp_path_factory.mktemp("wine"))


@pytest.fixture(scope="module")
def pooled_scaler(sites) -> StandardScaler:
    rows = pd.concat(raw(sites, "train")).drop(columns="label").to_numpy(dtype=np.float64)
    return StandardScaler().fit(rows.astype(np.float32).astype(np.float64))  # the features as read: float32


def test_simulator_scales_every_site_by_the_pooled_standard_scaler(sites, pooled_scaler):
    federation = build(ClientsOptions(), None, 0, data_dir=str(sites[0].parent))
    scaling = federation.partition["scaling"]
    assert federation.partition["standardize"] == "federated"
    np.testing.assert_allclose(scaling["mean"], pooled_scaler.mean_, rtol=1e-12)
    np.testing.assert_allclose(scaling["std"], pooled_scaler.scale_, rtol=1e-10)
    for client, frame in zip(federation.clients, raw(sites, "train")):
        expected = pooled_scaler.transform(frame.drop(columns="label").to_numpy(dtype=np.float32).astype(np.float64))
        np.testing.assert_allclose(client.x.numpy(), expected, rtol=1e-5, atol=1e-5)
    # per-site scaling of these sites is named for what it does to them
    client_level = build(ClientsOptions(standardize="client"), None, 0, data_dir=str(sites[0].parent))
    assert any(note.startswith("warning: data.standardize=client") and "site-0" in note
               for note in client_level.notes)
    assert not any("warning" in note for note in federation.notes)


def run(sites: list[Path], out: Path, **settings: Any) -> dict[str, Any]:
    result = fedhpro.run({"dataset": "clients", "data_dir": str(sites[0].parent), "model": "mlp",
                          "method": "fedavg", "rounds": 10, "local_epochs": 2, "feature_dim": 16, "seed": 0,
                          "batch_size": 16,
                          "progress": False, "device": "cpu", **settings}, out=str(out))
    return result.summary


@pytest.mark.slow
def test_a_label_skewed_table_trains_to_within_two_points_of_a_pooled_logistic_regression(sites, tmp_path):
    train, test = pd.concat(raw(sites, "train")), pd.concat(raw(sites, "test"))
    pooled = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    pooled.fit(train.drop(columns="label"), train.label)
    reference_accuracy = 100.0 * pooled.score(test.drop(columns="label"), test.label)
    federated = run(sites, tmp_path / "federated")
    client = run(sites, tmp_path / "client", **{"data.standardize": "client"})
    final = {name: summary["accuracy"] for name, summary in
             (("federated", federated), ("client", client))}
    assert final["federated"] >= reference_accuracy - 2.0, (final, reference_accuracy)
    assert final["client"] < reference_accuracy - 20.0, (final, reference_accuracy)  # as found: sites mapped apart
    # predict scales new rows with the training scaling: the run's own test rows get the run's accuracy
    rows = tmp_path / "rows.csv"
    test.to_csv(rows, index=False)
    fedhpro.predict(tmp_path / "federated", [rows], out=tmp_path / "predicted.csv")
    predicted = pd.read_csv(tmp_path / "predicted.csv")
    assert 100.0 * (predicted.predicted.astype(int) == predicted.label).mean() == pytest.approx(final["federated"])
    saved = json.loads((tmp_path / "federated" / "standardize.json").read_text())
    assert saved["standardize"] == "federated" and saved["pooled"] == saved["sites"]["site-0"]


@pytest.mark.slow
def test_privacy_avoids_or_refuses_the_release(sites, tmp_path):
    common = {"dataset": "clients", "data_dir": str(sites[0].parent), "model": "mlp", "rounds": 1,
              "local_epochs": 1, "progress": False, "privacy": "client", "privacy.noise_multiplier": 0.5}
    with pytest.raises(ConfigError, match=r"data.standardize=federated is not available under privacy"):
        fedhpro.run({**common, "data.standardize": "federated"}, out=str(tmp_path / "refused"))
    fedhpro.run(common, out=str(tmp_path / "auto"))
    partition = json.loads((tmp_path / "auto" / "partition.json").read_text())
    assert partition["standardize"] == "client" and "scaling" not in partition


# --------------------------------------------------------------------------- Flower: each node its own folder


@pytest.fixture(autouse=True)
def _inside_a_run(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):  # put back after the test
        monkeypatch.setattr(TaskIdentity, name, getattr(TaskIdentity, name, None))
    inside_a_run()


FLOWER = {"dataset": "clients", "model": "mlp", "method": "fedavg", "rounds": 2, "local_epochs": 1, "clients": 3,
          "feature_dim": 8, "device": "cpu", "progress": False, "seed": 3, "flower.node-wait": 2}


def flower_run(sites: list[Path], tmp: Path, forge=None, **settings: Any) -> Path:
    out = tmp / "out"
    grid = LocalGrid({100 + k: folder for k, folder in enumerate(sites)}, tmp / "state", forge)
    run_server(grid, {**FLOWER, "out": str(out), **settings})
    return out


def forged_sums(change):
    """A node that sends ``change(count, sum, sum_squares)`` as its feature sums, and trains honestly."""

    def forge(kind: str, header: Any, reply: Message, message: Message) -> Message:
        answer = reply.content.config_records.get(records.NODE_RECORD)
        if header is None or header.get("query") != "data" or answer is None or SUMS_KEYS[0] not in answer:
            return reply
        values = change(*(answer[key] for key in SUMS_KEYS))
        content = RecordDict({records.NODE_RECORD: type(answer)({**dict(answer), **dict(zip(SUMS_KEYS, values))})})
        return Message(content, reply_to=message)

    return forge


@pytest.mark.slow
def test_flower_nodes_share_the_simulators_scaling_and_numbers(sites, pooled_scaler, tmp_path):
    out = flower_run(sites, tmp_path)
    partition = json.loads((out / "partition.json").read_text())
    np.testing.assert_allclose(partition["scaling"]["mean"], pooled_scaler.mean_, rtol=1e-12)
    np.testing.assert_allclose(partition["scaling"]["std"], pooled_scaler.scale_, rtol=1e-10)
    assert partition["scaling"]["sites"] == ["site-0", "site-1", "site-2"]
    saved = load_config(out / "config.yaml")  # what a resumed run and a late node scale with: never recomputed
    assert saved.data.standardize == "federated" and saved.data.feature_mean == partition["scaling"]["mean"]
    simulated = {key: value for key, value in FLOWER.items() if not key.startswith("flower.")}
    expected_rows, _ = reference({**simulated, "data_dir": str(sites[0].parent), "aggregation.update_bound": "on"},
                                 tmp_path / "reference")
    rows = read_rows(out / "metrics.jsonl")
    # the headline weighs the sites' test counts as claims on Flower; every other figure is the simulator's
    for row in (*rows, *expected_rows):
        row.get("accuracy", {}).pop("AVG", None)
    assert core(rows) == core(expected_rows), CORE_KEYS
    assert (out / "standardize.json").is_file()


@pytest.mark.parametrize(("change", "why"), [
    (lambda n, s, q: (n, s, [v * 1e8 for v in q]), "pooled std of feature"),  # squashes every site's inputs
    (lambda n, s, q: (n + 5, s, q), "declares"),  # more rows than it holds
    (lambda n, s, q: (n, [v * 100 for v in s], q), "not those of any rows"),  # a mean no rows can have
    (lambda n, s, q: (n, s[:3], q), "malformed"),
])
def test_flower_a_nodes_false_sums_are_left_out(sites, pooled_scaler, tmp_path, change, why, caplog):
    out = flower_run(sites, tmp_path, {102: forged_sums(change)}, rounds=1)
    scaling = json.loads((out / "partition.json").read_text())["scaling"]
    assert scaling["sites"] == ["site-0", "site-1"] and why in scaling["left_out"]["site-2"]
    honest = pd.concat(raw(sites[:2], "train")).drop(columns="label").to_numpy(dtype=np.float32)
    np.testing.assert_allclose(scaling["std"], StandardScaler().fit(honest.astype(np.float64)).scale_, rtol=1e-10)
    assert any("site-2's feature sums are left out" in record.getMessage() for record in caplog.records)


def test_flower_under_privacy_nothing_is_released(sites, tmp_path):
    seen: list[set[str]] = []

    def watch(kind: str, header: Any, reply: Message, message: Message) -> Message:
        if header is not None and header.get("query") == "data":
            seen.append(set(reply.content.config_records[records.NODE_RECORD]))
        return reply

    out = flower_run(sites, tmp_path, {100: watch}, privacy="client", **{"privacy.noise_multiplier": 0.5,
                                                                         "rounds": 1})
    assert seen and all(keys == {"info"} for keys in seen)  # the node sent no sums
    assert json.loads((out / "partition.json").read_text())["standardize"] == "client"
    assert json.loads((out / "summary.json").read_text())["rounds"] == 1


# --------------------------------------------------------------------------- Flower under SecAgg+


def public_ranges(sites: list[Path]) -> dict[str, list[float]]:
    """Ranges wider than every site's training rows (as public knowledge of the features would give): nothing
    is clipped, so the secure sum's scaling is the pooled one up to quantization."""
    rows = pd.concat(raw(sites, "train")).drop(columns="label")
    return {"data.feature_low": (rows.min() - 1.0).tolist(), "data.feature_high": (rows.max() + 1.0).tolist()}


SECURE = {"flower.secure-aggregation": "secagg+"}


def test_flower_secagg_adds_up_the_sites_sums_within_the_stated_tolerance(sites, pooled_scaler, tmp_path):
    seen: list[set[str]] = []

    def watch(kind: str, header: Any, reply: Message, message: Message) -> Message:
        if header is not None and header.get("query") == "data":
            seen.append(set(reply.content.config_records[records.NODE_RECORD]))
        return reply

    out = flower_run(sites, tmp_path, {101: watch}, rounds=1, **SECURE, **public_ranges(sites))
    assert seen and all(keys == {"info"} for keys in seen)  # no site's own sums in the clear
    scaling = json.loads((out / "partition.json").read_text())["scaling"]
    assert scaling["secure"] is True and scaling["sites"] == ["site-0", "site-1", "site-2"]
    assert 0 < scaling["tolerance"] < 1e-5
    np.testing.assert_allclose(scaling["mean"], pooled_scaler.mean_, rtol=1e-7)
    np.testing.assert_allclose(scaling["std"], pooled_scaler.scale_, rtol=1e-5)


def test_flower_secagg_a_false_secure_sum_falls_back_to_each_sites_own_scaling(sites, tmp_path, monkeypatch, caplog):
    from fedhpro.flower import client as client_app

    honest = client_app.packed_sums

    def doubled(sums, weight, bound, clip):  # every site claims twice its weight: the total cannot be theirs
        return honest(sums, weight, bound, clip) * torch.cat([torch.tensor([2.0]), torch.ones(26)]).double()

    monkeypatch.setattr(client_app, "packed_sums", doubled)
    out = flower_run(sites, tmp_path, rounds=1, **SECURE, **public_ranges(sites))
    partition = json.loads((out / "partition.json").read_text())
    assert partition["standardize"] == "client" and "scaling" not in partition
    assert any("is not that of their sites" in record.getMessage() for record in caplog.records)


def test_flower_secagg_without_ranges_scales_each_site_or_refuses(sites, tmp_path):
    out = flower_run(sites, tmp_path / "auto", rounds=1, **SECURE)
    assert json.loads((out / "partition.json").read_text())["standardize"] == "client"
    with pytest.raises(ConfigError, match="data.feature_low and data.feature_high"):
        flower_run(sites, tmp_path / "refused", **SECURE, **{"data.standardize": "federated"})
