"""Flower nodes that hold only their own data (``dataset=clients``), and a server that holds none.

* a real deployment on loopback: a SuperLink and 3 SuperNodes, each pointed
  at its own folder (written by the test into a folder of its own: no node
  has another's files, and the ServerApp gets no data directory); the run must
  finish ``finished:completed`` and give exactly the numbers the in-process
  simulator gives for ``dataset=clients`` on the same folders and seed
  (the same code, seeds and bytes on both sides: see test_flower.py);
* node discovery with mocked replies: nodes ordered by name, the class list
  resolved over all nodes, one-line errors naming the nodes when they disagree.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")

from flwr.app import ConfigRecord, Message, RecordDict  # noqa: E402
from PIL import Image  # noqa: E402

from test_flower import CORE_KEYS, assert_same_state, core, read_rows, reference  # noqa: E402
from test_flower_deployment import loopback_run  # noqa: E402

from fedhpro.config import load_config  # noqa: E402
from fedhpro.data.clients import ClientInfo  # noqa: E402
from fedhpro.errors import ConfigError  # noqa: E402
from fedhpro.flower.nodes import discover_own_data  # noqa: E402
from fedhpro.flower.records import NODE_RECORD  # noqa: E402
from fedhpro.flower.settings import FlowerSettings  # noqa: E402

#: three sites with different classes; two share the domain "clinic" (folder-name prefix), one is "lab"
SITES = {"clinic-0": ["cat", "dog"], "clinic-1": ["dog", "fox"], "lab-0": ["cat", "fox", "owl"]}
COLOURS = {"cat": (200, 40, 40), "dog": (40, 200, 40), "fox": (40, 40, 200), "owl": (200, 200, 40)}


def write_site(folder: Path, classes: list[str], seed: int, train: int = 8, test: int = 4) -> None:
    """``folder/{train,test}/<class>/*.png``: 12x12 images, a class colour plus noise (learnable)."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", train), ("test", test)):
        for name in classes:
            (folder / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = np.clip(np.array(COLOURS[name]) + rng.normal(0, 40, (12, 12, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / split / name / f"{i}.png")


def settings(**extra):
    return {"dataset": "clients", "rounds": 2, "clients": 3, "feature_dim": 16, "local_epochs": 1,
            "data.image_size": 16, "device": "cpu", "progress": False, "seed": 3, **extra}


@pytest.mark.deploy
def test_three_supernodes_with_their_own_folders_equal_the_simulator(tmp_path):
    everything = tmp_path / "all-sites"  # the simulator's view: one folder of client folders
    for k, (site, classes) in enumerate(SITES.items()):
        write_site(everything / site, classes, seed=k)
    homes = {}
    for site in SITES:  # each node's own disk: a copy of its site only
        homes[site] = tmp_path / f"node-{site}" / site
        shutil.copytree(everything / site, homes[site])

    out = tmp_path / "out"
    loopback_run(tmp_path, [f'data-dir="{folder}" dataset="clients"' for folder in homes.values()],
                 {**settings(), "out": str(out)})

    saved = load_config(out / "config.yaml")
    assert saved.run.data_dir is None  # the server was never given data
    assert saved.data.classes == ["cat", "dog", "fox", "owl"]  # the union over the nodes, sorted
    partition = json.loads((out / "partition.json").read_text())
    assert [c["name"] for c in partition["clients"]] == sorted(SITES)
    rows = read_rows(out / "metrics.jsonl")
    # the nodes' content is a claim on Flower, so the bound on each reply's pull is on there by default; the
    # simulator knows its clients and runs it only when asked: asked here, the two give the same numbers
    expected_rows, expected_state = reference({**settings(), "data_dir": str(everything),
                                               "aggregation.update_bound": "on"}, tmp_path / "reference")
    assert len(rows) == 2 and all(row["participants"] == [0, 1, 2] for row in rows)
    assert set(rows[-1]["accuracy"]) == {"clinic", "lab", "AVG"}
    # no roster vouches for the sites: the headline weighs "lab" (one site) 1/2 against "clinic" (two), where
    # the simulator, which knows its clients, keeps the unweighted mean; every other figure is the same
    for row, expected in zip(rows, expected_rows):
        if row.get("accuracy"):
            accuracy, reference_avg = row["accuracy"], expected["accuracy"]["AVG"]
            assert accuracy["AVG"] == pytest.approx((accuracy["clinic"] + accuracy["lab"] / 2) / 1.5, rel=1e-12)
            assert reference_avg == pytest.approx((accuracy["clinic"] + accuracy["lab"]) / 2, rel=1e-12)
            accuracy["AVG"] = reference_avg
    assert core(rows) == core(expected_rows), CORE_KEYS
    assert [row["client_accuracy"] for row in rows] == [row["client_accuracy"] for row in expected_rows]
    assert_same_state(torch.load(out / "server_state.pt", weights_only=True)["server"], expected_state)


# --------------------------------------------------------------------------- discovery, with mocked replies


class DataGrid:
    """Just enough of flwr's Grid: each node answers a data query with the ClientInfo it is given."""

    def __init__(self, infos: dict[int, ClientInfo]):
        self.infos = infos

    def get_node_ids(self):
        return list(self.infos)

    def send_and_receive(self, messages, timeout=None):
        return [Message(RecordDict({NODE_RECORD: ConfigRecord(
            {"info": json.dumps(dataclasses.asdict(self.infos[m.metadata.dst_node_id]))})}), reply_to=m)
            for m in messages]


def info(name, classes=None, declared=None, shape=(3, 16, 16), domain=None, kind="images", max_label=None):
    return ClientInfo(name=name, domain=domain, kind=kind, class_names=classes, declared_classes=declared,
                      max_label=max_label, input_shape=list(shape), train_size=10, test_size=4)


@pytest.fixture(autouse=True)
def _inside_a_run(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # outside a run, flwr refuses to address a Message
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


def discover(infos, **extra):
    config = load_config(settings(**extra))
    return discover_own_data(DataGrid(infos), config, FlowerSettings(node_wait=1))


def test_nodes_are_ordered_by_name_and_share_one_class_list():
    nodes, infos, classes = discover({7: info("site-b", ["dog"]), 3: info("site-c", ["cat"]),
                                      9: info("site-a", ["ant", "dog"])})
    assert nodes == {0: 9, 1: 7, 2: 3}  # client k = the k-th name, as the simulator orders folders
    assert [i.name for i in infos] == ["site-a", "site-b", "site-c"]
    assert classes == ["ant", "cat", "dog"]


@pytest.mark.parametrize("infos, words", [
    ({1: info("a", ["x"], declared=["x", "y"]), 2: info("b", ["z"], declared=["x", "y", "z"])}, ["a", "b"]),
    # input shapes with no strict majority (one node of another shape than a majority's is refused alone:
    # test_node_fit.py)
    ({1: info("a", ["x"], shape=(3, 12, 12)), 2: info("b", ["y"], shape=(3, 8, 8))}, ["a", "b", "no strict majority"]),
    # a second node with a name already held is refused (an impostor), so the run waits for a third in vain
    ({1: info("a", ["x"]), 2: info("a", ["y"])}, ["node 2: node 1 already holds the client named 'a'"]),
])
def test_nodes_that_disagree_are_one_line_naming_them(infos, words):
    infos = {**infos, 5: info("c", ["x"])}
    with pytest.raises(ConfigError) as caught:
        discover(infos)
    message = str(caught.value)
    assert "\n" not in message and all(word in message for word in words), message


def test_waiting_for_missing_nodes_names_the_fix():
    with pytest.raises(ConfigError, match="only 1 of 3 data-holding SuperNodes answered"):
        discover({1: info("a", ["x"])})
    with pytest.raises(ConfigError, match="needs clients=K"):
        discover({1: info("a", ["x"])}, clients=None)
