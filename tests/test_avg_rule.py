"""AVG has one rule, whatever the sites are called (issue 42, part 6).

A client is tested on one test set: its domain's (``domain.txt``, else a folder name's prefix before
``-<digits>``), else ``all``. A test set's accuracy pools the test counts of the clients tested on it; AVG is
the unweighted mean over the test sets. So three sites ``hospital-0..2`` are one test set (AVG pools their
test rows), three sites ``north``, ``south``, ``west`` without ``domain.txt`` are one too (``all``), and
the same three with a ``domain.txt`` naming each its own domain are three test sets (AVG is the unweighted
mean of the three sites' accuracies). Where the test sets are made of the sites' own test splits and more
than one site is tested, the run says which in a ``note:`` line, the same from ``dataset=clients``,
``Federation.from_tensors`` and a Flower server's view of its nodes (:func:`client_notes`); shared test sets
(built-in data, ``dataset=imagefolder``) give the paper's AVG over domains and no note.

The reference is counted here by hand: the run's saved global model on each site's raw ``test.npz`` (read
with numpy, not the loader), then the unweighted mean of the three accuracies or the pooled count.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedhpro import cli
from fedhpro.config import load_config
from fedhpro.data import get_dataset
from fedhpro.data.clients import ClientsOptions, client_folders, client_notes, scan_client
from fedhpro.data.federation import Federation, avg_note

#: test rows of the three sites: different sizes, so pooling and the unweighted mean differ
TEST_ROWS = (6, 24, 50)
POOLED_TAIL = "each test sample counts alike, so a site with more test data weighs more"
RULE_TAIL = "; a site's test set is its domain, else all"


def _sites(root: Path, names: tuple[str, str, str], own_domain: bool = False) -> Path:
    """Three tensor sites of 4 float features and 2 classes (the class is the sign of feature 0), 30 training
    rows each and ``TEST_ROWS`` test rows; the last site's test labels are flipped, so its accuracy is low and
    a pooled AVG (weighted to the largest site) is far from the unweighted mean."""
    rng = np.random.default_rng(42)
    for k, name in enumerate(names):
        folder = root / name
        folder.mkdir(parents=True)
        x = rng.normal(size=(30, 4)).astype(np.float32)
        np.savez(folder / "train.npz", x=x, y=(x[:, 0] > 0).astype(np.int64))
        x = rng.normal(size=(TEST_ROWS[k], 4)).astype(np.float32)
        y = (x[:, 0] > 0).astype(np.int64)
        np.savez(folder / "test.npz", x=x, y=1 - y if k == 2 else y)
        if own_domain:
            (folder / "domain.txt").write_text(name)
    return root


def _run(root: Path, out: Path, capsys) -> tuple[dict, list[str]]:
    args = ["run", "dataset=clients", f"data_dir={root}", "data.standardize=none", "method=fedavg", "model=mlp",
            "rounds=2", "local_epochs=2", "batch_size=10", "feature_dim=8", "progress=false", "threads=1",
            "device=cpu", f"out={out}"]
    capsys.readouterr()
    assert cli.main(args) == 0
    printed = capsys.readouterr().out.splitlines()
    return json.loads((out / "summary.json").read_text()), printed


def _site_counts(run: Path, root: Path, names: tuple[str, ...]) -> list[tuple[int, int]]:
    """``(correct, total)`` of the run's saved global model on each site's raw test.npz."""
    import fedhpro

    model = fedhpro.load_model(run).eval()
    counts = []
    for name in names:
        with np.load(root / name / "test.npz") as data:
            x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
        with torch.no_grad():
            counts.append((int((model(x).argmax(dim=1) == y).sum()), int(y.numel())))
    return counts


@pytest.mark.slow
def test_sites_each_their_own_domain_make_avg_the_unweighted_mean_over_sites(tmp_path, capsys):
    names = ("north", "south", "west")
    root = _sites(tmp_path / "sites", names, own_domain=True)
    summary, printed = _run(root, tmp_path / "run", capsys)
    counts = _site_counts(tmp_path / "run", root, names)
    accuracies = [100.0 * correct / total for correct, total in counts]
    unweighted = sum(accuracies) / 3
    pooled = 100.0 * sum(c for c, _ in counts) / sum(t for _, t in counts)
    assert abs(unweighted - pooled) > 5  # the data tells the two apart
    assert summary["per_domain"] == pytest.approx(dict(zip(names, accuracies)), abs=1e-9)
    assert summary["accuracy"] == pytest.approx(unweighted, abs=1e-9)
    note = ("AVG is the unweighted mean over 3 test sets, one per site: north, south, west; each site counts "
            "alike, whatever the size of its test data" + RULE_TAIL)
    assert f"note: {note}" in printed and note in summary["notes"]
    assert summary["notes"].count(note) == 1


@pytest.mark.slow
@pytest.mark.parametrize(("names", "test_set"), [(("hospital-0", "hospital-1", "hospital-2"), "hospital"),
                                                 (("north", "south", "west"), "all")])
def test_sites_of_one_test_set_make_avg_the_pooled_accuracy(tmp_path, capsys, names, test_set):
    root = _sites(tmp_path / "sites", names)
    summary, printed = _run(root, tmp_path / "run", capsys)
    counts = _site_counts(tmp_path / "run", root, names)
    pooled = 100.0 * sum(c for c, _ in counts) / sum(t for _, t in counts)
    unweighted = sum(100.0 * c / t for c, t in counts) / 3
    assert abs(unweighted - pooled) > 5
    assert summary["per_domain"] == pytest.approx({test_set: pooled}, abs=1e-9)
    assert summary["accuracy"] == pytest.approx(pooled, abs=1e-9)
    note = (f"AVG is the accuracy on one test set, {test_set} ({', '.join(names)}), which pools the sites' test "
            f"counts: {POOLED_TAIL}" + RULE_TAIL)
    assert f"note: {note}" in printed and note in summary["notes"]


def test_several_test_sets_some_of_several_sites(tmp_path):
    """Image sites: clinic-0 and clinic-1 are one test set (pooled), lab another; the note names both."""
    rng = np.random.default_rng(3)
    for site in ("clinic-0", "clinic-1", "lab"):
        for split, n in (("train", 3), ("test", 2)):
            for name, colour in (("cat", (200, 40, 40)), ("dog", (40, 200, 40))):
                (tmp_path / site / split / name).mkdir(parents=True)
                for i in range(n):
                    pixels = np.clip(rng.normal(colour, 20, (6, 6, 3)), 0, 255).astype(np.uint8)
                    Image.fromarray(pixels).save(tmp_path / site / split / name / f"{i}.png")
    config = load_config(None, ["dataset=clients", f"data_dir={tmp_path}", "data.cache=false"])
    federation = get_dataset("clients").build(config.data, None, 0, data_dir=tmp_path, partition=config.partition)
    assert list(federation.test_sets) == ["clinic", "all"]
    note = ("AVG is the unweighted mean over 2 test sets: clinic (clinic-0, clinic-1), all (lab); each test set "
            f"counts alike, whatever its size, and one of several sites pools their test counts ({POOLED_TAIL})"
            + RULE_TAIL)
    assert note in federation.notes and federation.notes.count(note) == 1
    # a Flower server knows the sites by their descriptions alone: the same note
    infos = [scan_client(folder, ClientsOptions()) for folder in client_folders(tmp_path)]
    assert note in client_notes(infos)


def test_from_tensors_says_the_same_and_nothing_where_avg_is_obvious():
    pairs = [(torch.randn(4, 3), torch.tensor([0, 1, 0, 1])) for _ in range(3)]
    given = Federation.from_tensors(pairs, pairs, domains=["x", "x", "y"], names=["a", "b", "c"])
    assert given.notes == [avg_note([("a", "x"), ("b", "x"), ("c", "y")])]
    assert given.notes[0].startswith("AVG is the unweighted mean over 2 test sets: x (a, b), y (c); ")
    # one site tested: AVG is its accuracy
    assert Federation.from_tensors(pairs, [pairs[0], None, None]).notes[-1].startswith("clients without a test")
    assert not any(note.startswith("AVG") for note in Federation.from_tensors(pairs, [pairs[0], None, None]).notes)
    # shared test sets (as the built-in data sets and dataset=imagefolder have): the paper's AVG over domains
    shared = Federation.from_tensors(pairs, {"x": pairs[0], "y": pairs[1]}, domains=["x", "x", "y"])
    assert shared.notes == []
    assert avg_note([]) is None and avg_note([("a", "all")]) is None


def test_imagefolder_domains_give_no_note(tmp_path):
    rng = np.random.default_rng(4)
    for domain in ("photos", "sketches"):
        for name, colour in (("cat", (200, 40, 40)), ("dog", (40, 200, 40))):
            (tmp_path / domain / name).mkdir(parents=True)
            for i in range(5):
                pixels = np.clip(rng.normal(colour, 20, (6, 6, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(tmp_path / domain / name / f"{i}.png")
    config = load_config(None, ["dataset=imagefolder", f"data_dir={tmp_path}", "clients=4", "partition=iid",
                                "data.cache=false"])
    federation = get_dataset("imagefolder").build(config.data, config.run.clients, config.run.seed,
                                                  data_dir=tmp_path, partition=config.partition)
    assert list(federation.test_sets) == ["photos", "sketches"] and federation.client_tests is None
    assert not any(note.startswith("AVG") for note in federation.notes)


def test_long_lists_are_cut():
    note = avg_note([(f"site-{k:02d}", f"site-{k:02d}") for k in range(12)])
    assert note is not None and "site-09, ... (12 test sets); each site counts alike" in note
    assert "site-10" not in note


def test_a_flower_server_of_own_data_nodes_says_the_same(monkeypatch):
    """The Flower server knows its own-data sites only by what they declare: its notes carry the same line."""
    pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")
    import dataclasses

    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedhpro.data.clients import ClientInfo
    from fedhpro.flower.records import NODE_RECORD
    from fedhpro.flower.server import _federation
    from fedhpro.flower.settings import FlowerSettings

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # outside a run, flwr refuses to address a Message
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    infos = {10 + k: ClientInfo(name=name, domain=None, kind="tensors", class_names=None, declared_classes=None,
                                max_label=1, input_shape=[4], train_size=30, test_size=size)
             for k, (name, size) in enumerate(zip(("west", "north", "south"), TEST_ROWS))}

    class Grid:
        def get_node_ids(self):
            return list(infos)

        def send_and_receive(self, messages, timeout=None):
            return [Message(RecordDict({NODE_RECORD: ConfigRecord(
                {"info": json.dumps(dataclasses.asdict(infos[m.metadata.dst_node_id]))})}), reply_to=m)
                for m in messages]

    config = load_config({"dataset": "clients", "clients": 3, "model": "mlp", "device": "cpu"})
    notes = _federation(Grid(), config, FlowerSettings(node_wait=1))[-1]
    note = (f"AVG is the accuracy on one test set, all (north, south, west), which pools the sites' test counts: "
            f"{POOLED_TAIL}" + RULE_TAIL)
    assert note in notes
