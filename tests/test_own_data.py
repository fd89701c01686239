"""Your own data by config: ``dataset=clients``, ``dataset=imagefolder``, ``dataset=huggingface`` and ``model=mlp``.

The data is written on the fly in the real on-disk formats (PNG and JPEG
through PIL, ``.npz``, ``.pt``, a Hugging Face data set saved with
``save_to_disk``) and checked against references computed here by hand: the
label of every image is found again from its colour, decoded pixels against
the ``[-1, 1]`` formula, partition sizes against the file counts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedhpro import cli
from fedhpro.config import load_config
from fedhpro.data import clients as clients_data
from fedhpro.data import get_dataset, images
from fedhpro.data.clients import ClientInfo, ClientsOptions, load_client, resolve_classes, scan_client
from fedhpro.errors import ConfigError, DataError
from fedhpro.models import build_model

#: one colour per class, far apart, so a decoded image tells its class
COLOURS = {"cat": (220, 40, 40), "dog": (40, 220, 40), "fox": (40, 40, 220), "owl": (220, 220, 40)}
#: two domains with skewed classes (owl only in sketches, cat only in photos)
DOMAINS = {"photos": {"cat": 10, "dog": 5, "fox": 3}, "sketches": {"dog": 3, "fox": 5, "owl": 10}}
TEST_PER_CLASS = 2
SIDE = 12  # the files' side; runs resize to data.image_size


def _image(path: Path, colour: tuple[int, int, int], rng: np.random.Generator, side: int = SIDE) -> Path:
    """A ``side x side`` image of ``colour`` with a little noise (PNG, or JPEG by the suffix)."""
    pixels = np.clip(np.array(colour) + rng.integers(-20, 21, (side, side, 3)), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return path


def _class_of(x: torch.Tensor) -> str:
    """The class whose colour is nearest the image's mean colour (x normalised to [-1, 1])."""
    mean = ((x.float().mean(dim=(1, 2)) + 1.0) * 127.5).numpy()
    return min(COLOURS, key=lambda c: float(np.abs(mean - np.array(COLOURS[c])).sum()))


def _write_imagefolder(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for domain, counts in DOMAINS.items():
        for name, n in counts.items():
            for i in range(n):
                suffix = ".jpg" if i == 0 else ".png"
                _image(root / domain / "train" / name / f"{i:02d}{suffix}", COLOURS[name], rng)
            for i in range(TEST_PER_CLASS):
                _image(root / domain / "test" / name / f"{i:02d}.png", COLOURS[name], rng)
    return root


def _write_client_folders(source: Path, root: Path) -> Path:
    """The imagefolder's images as a pre-split federation: two clients a domain (odd/even files); the last
    client has no test split."""
    for domain, counts in DOMAINS.items():
        for part in range(2):
            client = root / f"{domain}-{part}"
            for split in ("train", "test"):
                if split == "test" and domain == "sketches" and part == 1:
                    continue
                for name in counts:
                    files = sorted((source / domain / split / name).iterdir())
                    for file in files[part::2]:
                        target = client / split / name / file.name
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.write_bytes(file.read_bytes())
    return root


def _tabular(rng: np.random.Generator, n: int, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = rng.normal(size=(n, weights.shape[0])).astype(np.float32)
    return x, (x @ weights).argmax(axis=1).astype(np.int64)


def _write_tabular(root: Path) -> Path:
    """Three banks/clinics of 6 features, 3 classes: .npz and .pt (a dict), one without test split."""
    rng = np.random.default_rng(1)
    weights = rng.normal(size=(6, 3))
    for name in ("bank-0", "bank-1", "clinic-0"):
        folder = root / name
        folder.mkdir(parents=True)
        (x, y), (xt, yt) = _tabular(rng, 40, weights), _tabular(rng, 12, weights)
        if name == "bank-1":
            torch.save({"x": torch.from_numpy(x), "y": torch.from_numpy(y)}, folder / "train.pt")
            torch.save({"x": torch.from_numpy(xt), "y": torch.from_numpy(yt)}, folder / "test.pt")
        else:
            np.savez(folder / "train.npz", x=x, y=y)
            if name == "bank-0":
                np.savez(folder / "test.npz", x=xt, y=yt)
    (root / "clinic-0" / "domain.txt").write_text("  hospital \n")
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("own")
    folder = _write_imagefolder(base / "imagefolder")
    return {"base": base, "imagefolder": folder, "clients": _write_client_folders(folder, base / "clients"),
            "tabular": _write_tabular(base / "tabular")}


def _cli_run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    common = ["rounds=1", "local_epochs=1", "feature_dim=16", "device=cpu", "progress=false"]
    return subprocess.run([sys.executable, "-m", "fedhpro", "run", *args, *common], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=180)


def _build(dataset: str, *overrides: str):
    config = load_config(None, [f"dataset={dataset}", *overrides])
    return get_dataset(dataset).build(config.data, config.run.clients, config.run.seed, data_dir=config.run.data_dir,
                                      partition=config.partition)


def _files(folder: Path) -> Counter:
    """Images per class folder of ``folder``."""
    return Counter({c.name: len(list(c.iterdir())) for c in folder.iterdir() if c.is_dir()})


# ----------------------------------------------------------------------------------- runs from the command line


@pytest.mark.slow
def test_imagefolder_two_domains_runs_and_reports_each_domain(data, tmp_path):
    out = tmp_path / "run"
    result = _cli_run(["dataset=imagefolder", f"data_dir={data['imagefolder']}", "partition=dirichlet",
                       "partition.min_size=1", "clients=4", "data.image_size=16", f"out={out}"], tmp_path)
    assert result.returncode == 0, result.stderr
    table = result.stdout.splitlines()
    header = next(line for line in table if "AVG" in line)
    assert "photos" in header and "sketches" in header
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["per_domain"]) == {"photos", "sketches"}
    # the partition record: every training image of a domain held by one of its clients, class by class
    record = json.loads((out / "partition.json").read_text())
    classes = record["classes"]
    assert classes == ["cat", "dog", "fox", "owl"]
    for domain, counts in DOMAINS.items():
        held = np.sum([c["class_counts"] for c in record["clients"] if c["domain"] == domain], axis=0)
        assert held.tolist() == [counts.get(name, 0) for name in classes]
        indices = sorted(i for c in record["clients"] if c["domain"] == domain for i in c["indices"])
        assert indices == list(range(sum(counts.values())))
    assert record["test_sizes"] == {d: TEST_PER_CLASS * len(c) for d, c in DOMAINS.items()}


@pytest.mark.slow
def test_clients_folders_run_with_per_client_tests(data, tmp_path):
    out = tmp_path / "run"
    result = _cli_run(["dataset=clients", f"data_dir={data['clients']}", "data.image_size=16", f"out={out}"],
                      tmp_path)
    assert result.returncode == 0, result.stderr
    header = next(line for line in result.stdout.splitlines() if "AVG" in line)
    assert "photos" in header and "sketches" in header
    record = json.loads((out / "partition.json").read_text())
    assert [c["name"] for c in record["clients"]] == ["photos-0", "photos-1", "sketches-0", "sketches-1"]
    assert record["classes"] == ["cat", "dog", "fox", "owl"]
    for entry in record["clients"]:
        on_disk = _files(data["clients"] / entry["name"] / "train")
        assert entry["class_counts"] == [on_disk.get(c, 0) for c in record["classes"]]
        assert entry["domain"] == entry["name"].split("-")[0]
        assert entry["size"] == sum(on_disk.values())
    assert record["clients"][3]["test_size"] == 0


@pytest.mark.slow
def test_huggingface_saved_to_disk_runs(tmp_path):
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(2)
    names = ["cat", "dog", "fox"]

    def split(n: int):
        labels = [i % 3 for i in range(n)]
        pictures = [Image.fromarray(np.clip(np.array(COLOURS[names[y]]) + rng.integers(-20, 21, (10, 10, 3)), 0,
                                            255).astype(np.uint8)) for y in labels]
        features = datasets.Features({"picture": datasets.Image(), "kind": datasets.ClassLabel(names=names)})
        return datasets.Dataset.from_dict({"picture": pictures, "kind": labels}, features=features)

    datasets.DatasetDict(train=split(30), test=split(9)).save_to_disk(str(tmp_path / "hf"))
    out = tmp_path / "run"
    result = _cli_run(["dataset=huggingface", f"data.path={tmp_path / 'hf'}", "data.image_column=picture",
                       "data.label_column=kind", "data.image_size=8", "model=mlp", "clients=3", "partition=iid",
                       f"out={out}"], tmp_path)
    assert result.returncode == 0, result.stderr
    record = json.loads((out / "partition.json").read_text())
    assert record["classes"] == names and record["test_size"] == 9
    assert [sum(c["class_counts"]) for c in record["clients"]] == [10, 10, 10]


@pytest.mark.slow
def test_tabular_clients_run_with_mlp(data, tmp_path):
    out = tmp_path / "run"
    result = _cli_run(["dataset=clients", f"data_dir={data['tabular']}", "model=mlp", f"out={out}"], tmp_path)
    assert result.returncode == 0, result.stderr
    header = next(line for line in result.stdout.splitlines() if "AVG" in line)
    assert "bank" in header  # clinic-0 (domain "hospital") has no test split: no accuracy of its own
    record = json.loads((out / "partition.json").read_text())
    assert [c["domain"] for c in record["clients"]] == ["bank", "bank", "hospital"]
    assert record["classes"] == ["0", "1", "2"]


# ----------------------------------------------------------------------------------- dataset=clients, unit checks


@pytest.mark.parametrize("name,domain_txt,expected", [
    ("mnist-0", None, "mnist"), ("site_12", None, "site"), ("a-b-3", None, "a-b"), ("alpha", None, None),
    ("x-1a", None, None), ("-7", None, None), ("mnist-0", " usps\n", "usps"), ("alpha", "\n", None),
])
def test_domain_rule(tmp_path, name, domain_txt, expected):
    folder = tmp_path / name
    folder.mkdir()
    if domain_txt is not None:
        (folder / "domain.txt").write_text(domain_txt)
    assert clients_data.client_domain(folder) == expected


def _label_clients(root: Path, layout: dict[str, dict[str, dict[str, int]]], declared: dict[str, str] | None = None):
    rng = np.random.default_rng(3)
    for client, splits in layout.items():
        for split, counts in splits.items():
            for name, n in counts.items():
                for i in range(n):
                    _image(root / client / split / name / f"{i}.png", COLOURS[name], rng, side=4)
        if declared and client in declared:
            (root / client / "classes.txt").write_text(declared[client])
    return root


def _labels_match_colours(x: torch.Tensor, y: torch.Tensor, classes: list[str]) -> bool:
    return all(classes[int(label)] == _class_of(image) for image, label in zip(x, y))


def test_labels_are_the_union_of_class_folders(tmp_path):
    root = _label_clients(tmp_path, {"a": {"train": {"cat": 2, "dog": 1}, "test": {"cat": 1}},
                                     "b": {"train": {"dog": 2, "owl": 3}}})
    federation = _build("clients", f"data_dir={root}", "data.image_size=4")
    assert federation.partition["classes"] == ["cat", "dog", "owl"] and federation.num_classes == 3
    assert federation.clients[0].y.tolist() == [0, 0, 1] and federation.clients[1].y.tolist() == [1, 1, 2, 2, 2]
    for k in range(2):
        assert _labels_match_colours(federation.clients[k].x, federation.clients[k].y, ["cat", "dog", "owl"])
    assert federation.client_tests[1][1].numel() == 0 and federation.client_domains == ["", ""]


def test_classes_txt_and_data_classes_set_the_label_order(tmp_path):
    root = _label_clients(tmp_path, {"a": {"train": {"cat": 1, "dog": 1}, "test": {"dog": 1}},
                                     "b": {"train": {"owl": 2}}},
                          declared={"a": "owl\ncat\ndog\n", "b": "owl\ncat\ndog"})
    federation = _build("clients", f"data_dir={root}", "data.image_size=4")
    assert federation.partition["classes"] == ["owl", "cat", "dog"]
    assert federation.clients[0].y.tolist() == [1, 2] and federation.clients[1].y.tolist() == [0, 0]
    assert _labels_match_colours(federation.clients[0].x, federation.clients[0].y, ["owl", "cat", "dog"])
    federation = _build("clients", f"data_dir={root}", "data.image_size=4", "data.classes=[dog,owl,cat,fox]")
    assert federation.num_classes == 4 and federation.clients[0].y.tolist() == [2, 0]
    (root / "b" / "classes.txt").write_text("cat\nowl\ndog\n")
    with pytest.raises(DataError, match="classes.txt files differ.*a.*b"):
        _build("clients", f"data_dir={root}", "data.image_size=4")
    with pytest.raises(DataError, match="client b has class folders \\['owl'\\]"):
        _build("clients", f"data_dir={root}", "data.image_size=4", "data.classes=[cat,dog]")


def test_load_client_gives_the_federation_s_tensors(data):
    options = ClientsOptions(image_size=8)
    folders = clients_data.client_folders(data["clients"])
    infos = [scan_client(folder, options) for folder in folders]
    # what a Flower node sends: each info as JSON; the classes resolve the same from the round trip
    echoed = [ClientInfo(**json.loads(json.dumps(dataclasses.asdict(info)))) for info in infos]
    assert echoed == infos
    classes = resolve_classes(echoed, options)
    assert classes == ["cat", "dog", "fox", "owl"]
    assert infos[0] == ClientInfo("photos-0", "photos", "images", ["cat", "dog", "fox"], None, None, [3, 8, 8],
                                  sum((n + 1) // 2 for n in DOMAINS["photos"].values()), 3,
                                  ["cat", "dog", "fox"], ["cat", "dog", "fox"])  # one test image a class
    federation = _build("clients", f"data_dir={data['clients']}", "data.image_size=8")
    for k, folder in enumerate(folders):
        (train_x, train_y), (test_x, test_y), info = load_client(folder, options, classes)
        assert info == infos[k]
        assert torch.equal(train_x, federation.clients[k].x) and torch.equal(train_y, federation.clients[k].y)
        assert torch.equal(test_x, federation.client_tests[k][0]) and torch.equal(test_y, federation.client_tests[k][1])
        assert _labels_match_colours(train_x, train_y, classes)
        assert train_x.shape[1:] == (3, 8, 8) and train_x.dtype == torch.float32
    assert federation.client_tests[3][0].shape == (0, 3, 8, 8)
    assert set(federation.test_sets) == {"photos", "sketches"}


def test_tensor_clients_labels_and_num_classes(data):
    federation = _build("clients", f"data_dir={data['tabular']}", "data.standardize=none")  # x as saved
    with np.load(data["tabular"] / "bank-0" / "train.npz") as saved:
        x, y = saved["x"], saved["y"]
    assert torch.equal(federation.clients[0].x, torch.from_numpy(x)) and torch.equal(federation.clients[0].y,
                                                                                      torch.from_numpy(y))
    saved = torch.load(data["tabular"] / "bank-1" / "test.pt")
    assert torch.equal(federation.client_tests[1][1], saved["y"])
    assert federation.input_shape == (6,) and federation.num_classes == 3
    assert _build("clients", f"data_dir={data['tabular']}", "data.num_classes=5").num_classes == 5
    with pytest.raises(DataError, match="bank-0/train.npz: label 2 is out of range for 2 classes"):
        _build("clients", f"data_dir={data['tabular']}", "data.num_classes=2")
    infos = [scan_client(folder, ClientsOptions()) for folder in clients_data.client_folders(data["tabular"])]
    assert [i.max_label for i in infos] == [2, 2, 2] and [i.input_shape for i in infos] == [[6]] * 3
    with pytest.raises(DataError, match="client bank-0 .*has label 2.*data.num_classes=2"):  # what a node sees
        resolve_classes(infos, ClientsOptions(num_classes=2))
    with pytest.raises(DataError, match="train.npz: label 2 is out of range for 2 classes"):
        load_client(data["tabular"] / "bank-0", ClientsOptions(), ["0", "1"])


# ----------------------------------------------------------------------------------- decoding by hand


def test_decoded_pixels_match_the_formula(tmp_path):
    constant = tmp_path / "constant.png"
    Image.new("RGB", (16, 16), (255, 0, 51)).save(constant)
    x = images.to_float(images.decode_files([constant], 8))
    expected = torch.tensor([255 / 127.5 - 1, 0 / 127.5 - 1, 51 / 127.5 - 1]).view(3, 1, 1).expand(3, 8, 8)
    assert x.shape == (1, 3, 8, 8)
    torch.testing.assert_close(x[0], expected, rtol=0, atol=1e-6)
    # no resize: every pixel in place, channels in RGB order (CHW)
    small = tmp_path / "small.png"
    pixels = np.array([[[0, 10, 20], [30, 40, 50]], [[60, 70, 80], [255, 128, 1]]], dtype=np.uint8)
    Image.fromarray(pixels).save(small)
    torch.testing.assert_close(images.to_float(images.decode_files([small], 2))[0],
                               torch.from_numpy(pixels.transpose(2, 0, 1).astype(np.float32)) / 127.5 - 1,
                               rtol=0, atol=1e-6)
    grey = tmp_path / "grey.png"
    Image.new("L", (5, 5), 127).save(grey)
    rgba = tmp_path / "rgba.png"
    Image.new("RGBA", (5, 5), (10, 20, 30, 0)).save(rgba)
    x = images.to_float(images.decode_files([grey, rgba], 3))
    torch.testing.assert_close(x[0], torch.full((3, 3, 3), 127 / 127.5 - 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(x[1, :, 0, 0], torch.tensor([10, 20, 30]) / 127.5 - 1, rtol=0, atol=1e-6)


def test_decoded_pixels_are_cached_until_a_file_changes(tmp_path, monkeypatch):
    files = [_image(tmp_path / "data" / f"{i}.png", COLOURS["cat"], np.random.default_rng(i)) for i in range(3)]
    cache = tmp_path / "data" / ".fedhpro-cache"
    first = images.decode_files(files, 8, cache)
    assert len(list(cache.glob("*.npy"))) == 1
    calls = []
    real = images.decode_file
    monkeypatch.setattr(images, "decode_file", lambda path, size: calls.append(path) or real(path, size))
    assert np.array_equal(images.decode_files(files, 8, cache), first) and calls == []
    Image.new("RGB", (SIDE, SIDE), COLOURS["owl"]).save(files[1])
    os.utime(files[1], ns=(1, 1))  # a new modification time, whatever the clock's resolution
    again = images.decode_files(files, 8, cache)
    assert len(calls) == 3 and _class_of(images.to_float(again)[1]) == "owl"
    assert np.array_equal(again[[0, 2]], first[[0, 2]])


# ----------------------------------------------------------------------------------- imagefolder, unit checks


def test_imagefolder_partition_sizes_add_up(data):
    federation = _build("imagefolder", f"data_dir={data['imagefolder']}", "data.image_size=8", "clients=5",
                        "partition.min_size=1")
    # clients=5 round robin over the sorted domains: photos 3, sketches 2
    assert federation.client_domains == ["photos", "photos", "photos", "sketches", "sketches"]
    classes = federation.partition["classes"]
    for domain, counts in DOMAINS.items():
        held = [k for k, d in enumerate(federation.client_domains) if d == domain]
        assert sum(len(federation.clients[k]) for k in held) == sum(counts.values())
        labels = torch.cat([federation.clients[k].y for k in held])
        assert Counter(classes[int(c)] for c in labels) == Counter(counts)
        for k in held:
            assert _labels_match_colours(federation.clients[k].x, federation.clients[k].y, classes)
        x, y = federation.test_sets[domain]
        assert Counter(classes[int(c)] for c in y) == {name: TEST_PER_CLASS for name in counts}
        assert _labels_match_colours(x, y, classes)


def test_imagefolder_one_folder_holds_out_a_seeded_test_split(tmp_path):
    rng = np.random.default_rng(4)
    for name, n in {"cat": 10, "dog": 5, "owl": 8}.items():
        for i in range(n):
            _image(tmp_path / "flat" / name / f"{i}.png", COLOURS[name], rng, side=4)
    args = (f"data_dir={tmp_path / 'flat'}", "data.image_size=4", "clients=2", "partition=iid",
            "data.test_fraction=0.2")
    federation = _build("imagefolder", *args)
    assert list(federation.test_sets) == ["all"] and federation.client_domains == ["", ""]
    _, y = federation.test_sets["all"]
    # round(0.2 * n) of each class: 2 of 10, 1 of 5, 2 of 8 (1.6)
    assert Counter(y.tolist()) == {0: 2, 1: 1, 2: 2}
    assert sorted(len(c) for c in federation.clients) == [9, 9]
    again = _build("imagefolder", *args, "seed=3")  # the split is split_seed's, not the run seed's
    assert torch.equal(again.test_sets["all"][0], federation.test_sets["all"][0])
    assert _labels_match_colours(*federation.test_sets["all"], ["cat", "dog", "owl"])


def test_imagefolder_partition_load_gives_the_same_clients(data, tmp_path):
    args = (f"data_dir={data['imagefolder']}", "data.image_size=4", "clients=4", "partition.min_size=1")
    first = _build("imagefolder", *args)
    saved = tmp_path / "partition.json"
    saved.write_text(json.dumps(first.partition))
    again = _build("imagefolder", *args, "seed=9", f"partition.load={saved}")
    assert again.client_domains == first.client_domains
    for a, b in zip(first.clients, again.clients):
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert _build("imagefolder", *args, "seed=9").partition["clients"] != first.partition["clients"]


def test_imagefolder_clients_per_domain(data):
    federation = _build("imagefolder", f"data_dir={data['imagefolder']}", "data.image_size=4", "partition=iid",
                        "data.clients_per_domain={sketches: 3, photos: 0}")  # 0 leaves a domain out
    assert federation.client_domains == ["sketches"] * 3 and list(federation.test_sets) == ["sketches"]
    with pytest.raises(ConfigError, match="unknown domains \\['paintings'\\].*photos, sketches"):
        _build("imagefolder", f"data_dir={data['imagefolder']}", "data.clients_per_domain={paintings: 1}")


# ----------------------------------------------------------------------------------- huggingface, unit checks


def test_huggingface_text_and_held_out_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = ["b a", "a c", "a a b", "c"] * 5
    labels = ["spam", "ham", "ham", "spam"] * 5
    datasets.Dataset.from_dict({"body": texts, "tag": labels}).save_to_disk(str(tmp_path / "text"))
    federation = _build("huggingface", f"data.path={tmp_path / 'text'}", "data.text_column=body",
                        "data.label_column=tag", "data.max_length=4", "data.test_fraction=0.2", "clients=2",
                        "partition=iid")
    assert federation.partition["classes"] == ["ham", "spam"] and federation.input_shape == (4,)
    x, y = federation.test_sets["all"]
    assert Counter(y.tolist()) == {0: 2, 1: 2}  # round(0.2 * 10) of each class
    # vocabulary of the 16 training texts by count then name: a, b, c -> 2, 3, 4 (0 padding, 1 unknown)
    assert federation.partition["vocab_size"] == 5
    by_text = {"b a": [3, 2, 0, 0], "a c": [2, 4, 0, 0], "a a b": [2, 2, 3, 0], "c": [4, 0, 0, 0]}
    rows = torch.cat([c.x for c in federation.clients] + [x]).tolist()
    assert all(row in by_text.values() for row in rows)
    assert sum(len(c) for c in federation.clients) == 16
    model = build_model("textcnn", 2, federation.input_shape, 8)
    assert model(federation.clients[0].x).shape == (len(federation.clients[0]), 2)


def test_huggingface_array_images_are_the_pixels(tmp_path):
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(7)
    pictures = rng.integers(0, 256, (8, 5, 5, 3), dtype=np.uint8)
    grey = rng.integers(0, 256, (4, 5, 5), dtype=np.uint8)
    datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"image": list(pictures), "label": [0, 1] * 4}),
        test=datasets.Dataset.from_dict({"image": list(np.repeat(grey[..., None], 3, axis=3)), "label": [1, 0] * 2}),
    ).save_to_disk(str(tmp_path / "arrays"))
    federation = _build("huggingface", f"data.path={tmp_path / 'arrays'}", "data.image_size=5", "clients=1",
                        "partition=iid")
    expected = torch.from_numpy(pictures.transpose(0, 3, 1, 2).astype(np.float32)) / 127.5 - 1
    torch.testing.assert_close(federation.clients[0].x, expected, rtol=0, atol=1e-6)
    x, y = federation.test_sets["all"]
    torch.testing.assert_close(x[:, 1], torch.from_numpy(grey.astype(np.float32)) / 127.5 - 1, rtol=0, atol=1e-6)
    assert y.tolist() == [1, 0, 1, 0] and federation.partition["classes"] == ["0", "1"]


# ----------------------------------------------------------------------------------- model=mlp


def test_mlp_shape_and_contract():
    torch.manual_seed(0)
    model = build_model("mlp", 3, (5,), 16)
    assert sum(p.numel() for p in model.parameters()) == (5 * 256 + 256) + (256 * 16 + 16) + (16 * 3 + 3)
    x = torch.randn(7, 5)
    z = model.features(x)
    assert z.shape == (7, 16) and bool((z >= 0).all()) and model.feature_dim == 16 and model.num_classes == 3
    torch.testing.assert_close(model(x), model.classifier(z))
    images_model = build_model("mlp", 4, (3, 8, 8), 16)  # any shape: flattened
    assert images_model(torch.randn(2, 3, 8, 8)).shape == (2, 4)
    with pytest.raises(ValueError, match="positive ints"):
        build_model("mlp", 3, (0,), 16)


# ----------------------------------------------------------------------------------- bad input: one line each


def _bad_inputs(root: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (CLI arguments, a word the one-line error must hold), with the files written under ``root``."""
    rng = np.random.default_rng(5)
    loose = root / "loose"
    _image(loose / "a.png", COLOURS["cat"], rng, side=4)
    broken = root / "broken"
    for i in range(4):
        _image(broken / "cat" / f"good{i}.png", COLOURS["cat"], rng, side=4)
    tiny = root / "tiny"
    _image(tiny / "cat" / "only.png", COLOURS["cat"], rng, side=4)
    (broken / "cat" / "smashed.png").write_bytes(b"\x89PNG not really")
    no_classes = root / "no-classes"
    _image(no_classes / "site-0" / "train" / "a.png", COLOURS["cat"], rng, side=4)
    broken_client = root / "broken-client"
    _image(broken_client / "site-0" / "train" / "cat" / "ok.png", COLOURS["cat"], rng, side=4)
    _image(broken_client / "site-0" / "test" / "cat" / "ok.png", COLOURS["cat"], rng, side=4)
    (broken_client / "site-0" / "train" / "cat" / "cut.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    x = np.zeros((4, 3), dtype=np.float32)
    empty_client = root / "empty-client"
    (empty_client / "site-0").mkdir(parents=True)
    np.savez(empty_client / "site-0" / "train.npz", x=x, y=np.arange(4))
    np.savez(empty_client / "site-0" / "test.npz", x=x, y=np.arange(4))
    (empty_client / "site-1").mkdir()
    negative = root / "negative"
    (negative / "site-0").mkdir(parents=True)
    np.savez(negative / "site-0" / "train.npz", x=x, y=np.array([0, 1, -1, 2]))
    too_large = root / "too-large"
    (too_large / "site-0").mkdir(parents=True)
    np.savez(too_large / "site-0" / "train.npz", x=x, y=np.array([0, 1, 7, 2]))
    np.savez(too_large / "site-0" / "test.npz", x=x, y=np.arange(4))
    no_y = root / "no-y"
    (no_y / "site-0").mkdir(parents=True)
    torch.save({"x": torch.from_numpy(x), "labels": torch.arange(4)}, no_y / "site-0" / "train.pt")
    return {
        "folder without class subfolders": (["dataset=imagefolder", f"data_dir={loose}"], "no class subfolders"),
        "client without class subfolders": (["dataset=clients", f"data_dir={no_classes}"],
                                            str(no_classes / "site-0" / "train")),
        "image that does not decode": (["dataset=imagefolder", f"data_dir={broken}", "data.image_size=4",
                                        "clients=1", "partition=iid"], "smashed.png"),
        "nothing to hold out for testing": (["dataset=imagefolder", f"data_dir={tiny}", "clients=1"],
                                            "no test images"),
        "client image that does not decode": (["dataset=clients", f"data_dir={broken_client}"], "cut.jpg"),
        "client without training data": (["dataset=clients", f"data_dir={empty_client}"],
                                         str(empty_client / "site-1")),
        "negative label": (["dataset=clients", f"data_dir={negative}"], str(negative / "site-0" / "train.npz")),
        "label out of range": (["dataset=clients", f"data_dir={too_large}", "data.num_classes=4"],
                               str(too_large / "site-0" / "train.npz")),
        "tensor file without y": (["dataset=clients", f"data_dir={no_y}"], str(no_y / "site-0" / "train.pt")),
        "clients without data_dir": (["dataset=clients"], "needs data_dir="),
        "imagefolder without data_dir": (["dataset=imagefolder"], "needs data_dir="),
        "missing data_dir": (["dataset=clients", f"data_dir={root / 'nowhere'}"], str(root / "nowhere")),
        "huggingface without data.path": (["dataset=huggingface"], "needs data.path="),
        "missing data.path": (["dataset=huggingface", f"data.path={root / 'nohf'}"], str(root / "nohf")),
        "partition for clients": (["dataset=clients", f"data_dir={empty_client}", "partition=iid"],
                                  "already split"),
        "clients=K for clients": (["dataset=clients", f"data_dir={negative}", "clients=3"], "1 client folders"),
    }


@pytest.mark.slow
def test_bad_input_is_one_line_without_traceback(tmp_path, capsys):
    cases = _bad_inputs(tmp_path)
    for name, (args, word) in cases.items():
        out = tmp_path / "runs" / name.replace(" ", "-")
        code = cli.main(["run", *args, f"out={out}", "progress=false", "rounds=1"])
        err = capsys.readouterr().err.strip()
        assert code != 0, name
        assert err.startswith("fedhpro: error:") and "\n" not in err and "Traceback" not in err, (name, err)
        assert word in err, (name, err)
        assert not out.exists(), name  # nothing half-written


@pytest.mark.slow
def test_bad_input_from_a_subprocess(tmp_path):
    args, word = _bad_inputs(tmp_path)["image that does not decode"]
    result = subprocess.run([sys.executable, "-m", "fedhpro", "run", *args, f"out={tmp_path / 'run'}"], cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr and word in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_datasets_package_missing_is_one_line(tmp_path, monkeypatch):
    from fedhpro.data import huggingface

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(DataError) as error:
        _build("huggingface", f"data.path={tmp_path}")
    assert str(error.value) == huggingface.MISSING_PACKAGE == \
        'dataset=huggingface needs the datasets package: pip install "fedhpro[hf]"'


def test_mixed_and_mismatched_clients_name_them(tmp_path):
    rng = np.random.default_rng(6)
    _image(tmp_path / "mixed" / "a" / "train" / "cat" / "0.png", COLOURS["cat"], rng, side=4)
    (tmp_path / "mixed" / "b").mkdir(parents=True)
    np.savez(tmp_path / "mixed" / "b" / "train.npz", x=np.zeros((2, 3), np.float32), y=np.zeros(2, np.int64))
    with pytest.raises(DataError, match="mix image folders and tensor files.*images: a; tensors: b"):
        _build("clients", f"data_dir={tmp_path / 'mixed'}")
    for name, features in (("a", 3), ("b", 4)):
        (tmp_path / "shapes" / name).mkdir(parents=True)
        np.savez(tmp_path / "shapes" / name / "train.npz", x=np.zeros((2, features), np.float32),
                 y=np.zeros(2, np.int64))
    with pytest.raises(DataError, match="differ in shape.*\\[3\\]: a; \\[4\\]: b"):
        _build("clients", f"data_dir={tmp_path / 'shapes'}")


# ----------------------------------------------------------------------------------- names that differ only in case


@pytest.mark.slow
@pytest.mark.parametrize("other", ["Cat", "CAT", " cat", "cat\u00a0"])
def test_class_folders_differing_only_in_case_or_whitespace_are_refused(tmp_path, other, capsys):
    """One site's ``cat`` spelled ``Cat`` would otherwise be a fourth class (and half the cats' accuracy)."""
    rng = np.random.default_rng(4)
    for client, name in (("a", "cat"), ("b", other)):
        for split in ("train", "test"):
            _image(tmp_path / "data" / client / split / name / "0.png", COLOURS["cat"], rng, side=4)
            _image(tmp_path / "data" / client / split / "dog" / "0.png", COLOURS["dog"], rng, side=4)
    with pytest.raises(DataError) as error:
        _build("clients", f"data_dir={tmp_path / 'data'}", "data.image_size=4")
    message = str(error.value)
    assert repr(other) in message and "'cat'" in message and "rename" in message and "\n" not in message
    code = cli.main(["run", "dataset=clients", f"data_dir={tmp_path / 'data'}", "data.image_size=4",
                     f"out={tmp_path / 'run'}", "progress=false", "rounds=1"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "\n" not in err and "Traceback" not in err and repr(other) in err
    assert not (tmp_path / "run").exists()


def test_class_lists_differing_only_in_case_are_refused(tmp_path):
    root = _label_clients(tmp_path, {"a": {"train": {"cat": 1, "dog": 1}, "test": {"dog": 1}}},
                          declared={"a": "cat\ndog\nDog\n"})
    with pytest.raises(DataError, match=r"'dog'.*'Dog'.*one spelling"):
        _build("clients", f"data_dir={root}", "data.image_size=4")
    info = dataclasses.replace(scan_client(root / "a", ClientsOptions(image_size=4)), declared_classes=None)
    with pytest.raises(DataError, match=r"'cat'.*'Cat '.*one spelling"):
        resolve_classes([info], ClientsOptions(image_size=4, classes=["cat", "Cat ", "dog"]))


def test_site_folders_differing_only_in_case_or_whitespace_are_refused(tmp_path):
    for site in ("Clinic-1", "clinic-1"):
        np.savez(tmp_path / "make.npz", x=np.zeros((2, 3), np.float32), y=np.zeros(2, np.int64))
        (tmp_path / "data" / site).mkdir(parents=True)
        (tmp_path / "make.npz").rename(tmp_path / "data" / site / "train.npz")
    with pytest.raises(DataError) as error:
        _build("clients", f"data_dir={tmp_path / 'data'}")
    assert "'Clinic-1'" in str(error.value) and "'clinic-1'" in str(error.value) and "rename" in str(error.value)
    infos = [ClientInfo(name, None, "tensors", None, None, 0, [3], 2, 0) for name in ("north  site", "North Site")]
    with pytest.raises(DataError, match="client folders"):
        resolve_classes(infos, ClientsOptions())
