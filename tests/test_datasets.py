"""Loaders and benchmarks on tiny files in each data set's real on-disk format.

Every fixture below writes the files the real data set ships (MNIST idx,
USPS libsvm .bz2, SVHN .mat, CIFAR pickled batches, image folders, the
TinyImageNet layout, HAM10000 csv + images, AG News csv) and loads them
through the real code path (torchvision's own classes where they are used).
Expected values are computed here by hand from what was written.
"""

from __future__ import annotations

import bz2
import csv
import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedhpro.cli import main
from fedhpro.config import load_config
from fedhpro.data import DATASETS, get_dataset
from fedhpro.data.benchmarks import PRESETS, AutoAugmentBatch
from fedhpro.data.loaders import LOADERS, build_vocab, image_arrays, open_loader, tokenize
from fedhpro.data.partition import Partition, PartitionOptions
from fedhpro.errors import ConfigError, DataError

# --------------------------------------------------------------------------- writers of the real formats


def pixels(n: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, *shape), dtype=np.uint8)


def labels_for(n: int, classes: int, seed: int) -> np.ndarray:
    """Every class at least once, the rest random."""
    y = np.concatenate([np.arange(classes), np.random.default_rng(seed).integers(0, classes, n - classes)])
    return np.random.default_rng(seed + 1).permutation(y).astype(np.int64)


def write_mnist(root: Path, n_train: int = 40, n_test: int = 12) -> dict:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    out = {}
    for prefix, n, seed in (("train", n_train, 1), ("t10k", n_test, 2)):
        x, y = pixels(n, (28, 28), seed), labels_for(n, 10, seed)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">iiii", 2051, n, 28, 28) + x.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">ii", 2049, n) + y.astype(np.uint8).tobytes())
        out[prefix] = (x, y)
    return out


USPS_VALUES = {-1.0: 0, 0.0: 127, 1.0: 255}  # torchvision: ((v + 1) / 2 * 255) as uint8


def write_usps(root: Path, n_train: int = 40, n_test: int = 12) -> dict:
    root.mkdir(parents=True)
    out = {}
    for name, n, seed in (("usps.bz2", n_train, 3), ("usps.t.bz2", n_test, 4)):
        rng = np.random.default_rng(seed)
        values = rng.choice([-1.0, 0.0, 1.0], size=(n, 256))
        y = labels_for(n, 10, seed)
        lines = [f"{label + 1} " + " ".join(f"{i + 1}:{v:g}" for i, v in enumerate(row))
                 for row, label in zip(values, y)]
        (root / name).write_bytes(bz2.compress(("\n".join(lines) + "\n").encode()))
        expected = np.vectorize(USPS_VALUES.get)(values).astype(np.uint8).reshape(n, 16, 16)
        out["train" if name == "usps.bz2" else "test"] = (expected, y)
    return out


def write_svhn(root: Path, n_train: int = 40, n_test: int = 12) -> dict:
    from scipy.io import savemat

    root.mkdir(parents=True)
    out = {}
    for split, n, seed in (("train", n_train, 5), ("test", n_test, 6)):
        x, y = pixels(n, (3, 32, 32), seed), labels_for(n, 10, seed)
        # the .mat stores H x W x C x N and the digit 0 as label 10
        savemat(root / f"{split}_32x32.mat", {"X": x.transpose(2, 3, 1, 0), "y": np.where(y == 0, 10, y)[:, None]})
        out[split] = (x, y)
    return out


def write_cifar(root: Path, hundred: bool = False, n_batch: int = 30, n_test: int = 40) -> dict:
    classes = 100 if hundred else 10
    folder = root / ("cifar-100-python" if hundred else "cifar-10-batches-py")
    folder.mkdir(parents=True)
    key = "fine_labels" if hundred else "labels"
    names = ["train"] if hundred else [f"data_batch_{i}" for i in range(1, 6)]
    per_file = n_batch * (5 if hundred else 1)
    xs, ys = [], []
    for i, name in enumerate(names):
        x, y = pixels(per_file, (3, 32, 32), 10 + i), labels_for(per_file, min(classes, per_file), 10 + i)
        with open(folder / name, "wb") as handle:
            pickle.dump({"data": x.reshape(per_file, -1), key: y.tolist()}, handle)
        xs.append(x)
        ys.append(y)
    x_test, y_test = pixels(n_test, (3, 32, 32), 20), labels_for(n_test, min(classes, n_test), 20)
    with open(folder / ("test" if hundred else "test_batch"), "wb") as handle:
        pickle.dump({"data": x_test.reshape(n_test, -1), key: y_test.tolist()}, handle)
    meta_key = "fine_label_names" if hundred else "label_names"
    with open(folder / ("meta" if hundred else "batches.meta"), "wb") as handle:
        pickle.dump({meta_key: [f"class{c}" for c in range(classes)]}, handle)
    return {"train": (np.concatenate(xs), np.concatenate(ys)), "test": (x_test, y_test)}


def write_balanced_cifar10(root: Path, per_class: int = 30, test_per_class: int = 4) -> dict:
    """CIFAR-10 batches with equal class sizes (what the long-tail subsample expects)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    y = np.random.default_rng(0).permutation(np.repeat(np.arange(10), per_class))
    x = pixels(len(y), (3, 32, 32), 30)
    for i, part in enumerate(np.array_split(np.arange(len(y)), 5), start=1):
        with open(folder / f"data_batch_{i}", "wb") as handle:
            pickle.dump({"data": x[part].reshape(len(part), -1), "labels": y[part].tolist()}, handle)
    y_test = np.repeat(np.arange(10), test_per_class)
    x_test = pixels(len(y_test), (3, 32, 32), 31)
    with open(folder / "test_batch", "wb") as handle:
        pickle.dump({"data": x_test.reshape(len(y_test), -1), "labels": y_test.tolist()}, handle)
    with open(folder / "batches.meta", "wb") as handle:
        pickle.dump({"label_names": [f"class{c}" for c in range(10)]}, handle)
    return {"train": (x, y), "test": (x_test, y_test)}


def solid(color: tuple[int, int, int], size: int = 20) -> Image.Image:
    return Image.new("RGB", (size, size), color)


def color_of(i: int) -> tuple[int, int, int]:
    return (37 * i % 256, 91 * i % 256, 53 * i % 256)


def write_image_folder(folder: Path, classes: list[str], per_class: int, suffix: str = ".png", offset: int = 0,
                       size: int = 20) -> list[tuple[Path, int, tuple[int, int, int]]]:
    """``folder/<class>/img<i><suffix>`` solid-colour images; returns (path, label, colour) in file order."""
    written = []
    for label, name in enumerate(classes):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            color = color_of(offset + label * per_class + i + 1)
            path = folder / name / f"img{i:03d}{suffix}"
            solid(color, size).save(path)
            written.append((path, label, color))
    return written


def write_syn(root: Path, per_class: int = 4) -> dict:
    digits = [str(d) for d in range(10)]
    return {"train": write_image_folder(root / "train", digits, per_class),
            "test": write_image_folder(root / "val", digits, 2, offset=500)}


def write_office(root: Path, per_class: int = 5) -> None:
    classes = ["back_pack", "bike", "calculator", "headphones", "keyboard", "laptop_computer", "monitor", "mouse",
               "mug", "projector"]
    for j, domain in enumerate(("amazon", "caltech", "dslr", "webcam")):
        write_image_folder(root / "office_caltech_10" / domain, classes, per_class, offset=100 * j)


def write_tinyimagenet(root: Path, wnids: tuple[str, ...] = ("n01443537", "n01629819", "n01641577"),
                       per_class: int = 4) -> dict:
    base = root / "tiny-imagenet-200"
    base.mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(reversed(wnids)) + "\n")  # labels follow the SORTED wnids
    train = []
    for label, wnid in enumerate(sorted(wnids)):
        images = base / "train" / wnid / "images"
        images.mkdir(parents=True)
        for i in range(per_class):
            color = color_of(label * per_class + i + 1)
            solid(color, 64).save(images / f"{wnid}_{i}.JPEG", format="JPEG", quality=95)
            train.append((label, color))
        (base / "train" / wnid / f"{wnid}_boxes.txt").write_text("")
    (base / "val" / "images").mkdir(parents=True)
    lines, test = [], []
    for i in range(6):
        label = (i * 2) % len(wnids)
        color = color_of(200 + i)
        solid(color, 64).save(base / "val" / "images" / f"val_{i}.JPEG", format="JPEG", quality=95)
        lines.append(f"val_{i}.JPEG\t{sorted(wnids)[label]}\t0\t0\t63\t63")
        test.append((label, color))
    (base / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return {"train": train, "test": test}


HAM_CLASSES = ("akiec", "bcc", "bkl", "df", "mel", "nv", "vasc")


def write_ham10000(root: Path, per_class: int = 9) -> list[tuple[str, int, tuple[int, int, int]]]:
    root.mkdir(parents=True)
    rows, written = [], []
    for label, dx in enumerate(HAM_CLASSES):
        for i in range(per_class):
            image_id = f"ISIC_{label:02d}{i:05d}"
            part = root / ("HAM10000_images_part_1" if i % 2 else "HAM10000_images_part_2")
            part.mkdir(exist_ok=True)
            color = color_of(label * per_class + i + 1)
            solid(color, 40).save(part / f"{image_id}.jpg", format="JPEG", quality=95)
            rows.append({"lesion_id": f"HAM_{label}{i}", "image_id": image_id, "dx": dx, "dx_type": "histo",
                         "age": "50.0", "sex": "male", "localization": "back"})
            written.append((image_id, label, color))
    with (root / "HAM10000_metadata.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return written


AG_TRAIN = [
    (3, "Wall St. Bears Claw Back", "Short-sellers, Wall Street's dwindling band, are seeing green again."),
    (3, "Oil and Economy", "Oil prices soar to all-time record, posing new menace to US economy"),
    (1, "Talks on Iraq", "Leaders meet for talks on Iraq security"),
    (1, "Iraq vote", "Iraq holds a vote"),
    (2, "Phelps wins gold", "Phelps wins his sixth gold medal in Athens"),
    (2, "Athens games", "The Athens games end with gold for the hosts"),
    (4, "New chip", "Intel unveils a new chip for laptops"),
    (4, "Space probe", "NASA space probe sends new images"),
]
AG_TEST = [(4, "Chip news", "A new chip from Intel"), (2, "Gold", "Gold in Athens for Phelps")]


def write_ag_news(root: Path, train: list = AG_TRAIN, test: list = AG_TEST) -> None:
    root.mkdir(parents=True)
    for name, rows in (("train.csv", train), ("test.csv", test)):
        with (root / name).open("w", newline="") as handle:
            csv.writer(handle, quoting=csv.QUOTE_ALL).writerows([(str(c), t, d) for c, t, d in rows])


def write_sun397(root: Path, per_class: int = 10) -> None:
    base = root / "SUN397"
    classes = ["/a/abbey", "/b/beach", "/c/castle"]
    base.mkdir(parents=True)
    (base / "ClassName.txt").write_text("\n".join(classes) + "\n")
    for label, name in enumerate(classes):
        folder = base / name.strip("/")
        folder.mkdir(parents=True)
        for i in range(per_class):
            solid(color_of(label * per_class + i + 1), 30).save(folder / f"sun_{label}{i:04d}.jpg", format="JPEG")


# --------------------------------------------------------------------------- the loaders


def test_every_loader_is_registered():
    assert set(LOADERS) == {"mnist", "usps", "svhn", "cifar10", "cifar100", "sun397", "syn", "office-caltech",
                            "tinyimagenet", "ham10000", "ag_news"}
    assert {name for name, spec in LOADERS.items() if spec.download} == {"mnist", "usps", "svhn", "cifar10",
                                                                          "cifar100", "sun397"}


def test_mnist_idx_files_load_through_torchvision(tmp_path):
    written = write_mnist(tmp_path / "mnist")
    for train, key in ((True, "train"), (False, "t10k")):
        dataset = open_loader("mnist", tmp_path, train)
        assert type(dataset).__module__.startswith("torchvision")
        x, y = image_arrays(dataset)
        assert np.array_equal(x[:, 0], written[key][0]) and np.array_equal(y, written[key][1])


def test_usps_bz2_loads_through_torchvision(tmp_path):
    written = write_usps(tmp_path / "usps")
    for train, key in ((True, "train"), (False, "test")):
        x, y = image_arrays(open_loader("usps", tmp_path, train))
        assert x.shape == (len(written[key][1]), 1, 16, 16)
        assert np.array_equal(x[:, 0], written[key][0]) and np.array_equal(y, written[key][1])


def test_svhn_mat_loads_through_torchvision_with_label_10_as_0(tmp_path):
    written = write_svhn(tmp_path / "svhn")
    for train, key in ((True, "train"), (False, "test")):
        x, y = image_arrays(open_loader("svhn", tmp_path, train, verify=False))
        assert np.array_equal(x, written[key][0]) and np.array_equal(y, written[key][1])
        assert y.min() == 0 and y.max() == 9


@pytest.mark.parametrize("hundred", [False, True])
def test_cifar_pickled_batches_load_through_torchvision(tmp_path, hundred):
    name = "cifar100" if hundred else "cifar10"
    written = write_cifar(tmp_path / name, hundred)
    for train, key in ((True, "train"), (False, "test")):
        dataset = open_loader(name, tmp_path, train, verify=False)  # a fixture: not the published files
        x, y = image_arrays(dataset)
        assert np.array_equal(x, written[key][0]) and np.array_equal(y, written[key][1])
        image, label = dataset[3]  # torchvision's own item access still works: a PIL image
        assert np.array_equal(np.asarray(image).transpose(2, 0, 1), written[key][0][3])
    assert len(dataset.classes) == (100 if hundred else 10)


def test_syn_image_folder_and_its_test_alias(tmp_path):
    written = write_syn(tmp_path / "syn")
    for train, key in ((True, "train"), (False, "test")):
        x, y = image_arrays(open_loader("syn", tmp_path, train), size=20)
        assert np.array_equal(y, [label for _, label, _ in written[key]])
        expected = np.stack([np.broadcast_to(np.array(c, np.uint8)[:, None, None], (3, 20, 20)) for _, _, c in
                             written[key]])
        assert np.array_equal(x, expected)  # PNG: lossless
    (tmp_path / "syn" / "val").rename(tmp_path / "syn" / "test")
    assert len(open_loader("syn", tmp_path, False)) == 20


def test_office_caltech_split_is_disjoint_stratified_and_fixed(tmp_path):
    write_office(tmp_path)
    train = open_loader("office-caltech", tmp_path, True, domain="dslr", test_fraction=0.4, split_seed=0)
    test = open_loader("office-caltech", tmp_path, False, domain="dslr", test_fraction=0.4, split_seed=0)
    assert not set(train.files) & set(test.files)
    assert len(train) + len(test) == 50
    assert np.array_equal(np.bincount(test.targets, minlength=10), np.full(10, 2))  # round(0.4 * 5) per class
    again = open_loader("office-caltech", tmp_path, False, domain="dslr", test_fraction=0.4, split_seed=0)
    assert again.files == test.files
    with pytest.raises(DataError, match="unknown domain"):
        open_loader("office-caltech", tmp_path, True, domain="clipart")


def test_tinyimagenet_official_layout_with_val_annotations(tmp_path):
    written = write_tinyimagenet(tmp_path)
    for train, key in ((True, "train"), (False, "test")):
        dataset = open_loader("tinyimagenet", tmp_path, train)
        x, y = image_arrays(dataset, size=64)
        assert np.array_equal(y, [label for label, _ in written[key]])
        expected = np.array([c for _, c in written[key]], dtype=np.float64)
        assert np.abs(x.reshape(len(y), 3, -1).mean(-1) - expected).max() < 3  # solid JPEGs: within rounding
    assert dataset.classes == sorted(dataset.classes)


def test_ham10000_metadata_labels_and_split(tmp_path):
    written = write_ham10000(tmp_path / "ham10000")
    train = open_loader("ham10000", tmp_path, True, test_fraction=0.2, split_seed=0)
    test = open_loader("ham10000", tmp_path, False, test_fraction=0.2, split_seed=0)
    assert len(train) + len(test) == 63 and not set(train.files) & set(test.files)
    assert np.array_equal(np.bincount(test.targets, minlength=7), np.full(7, 2))  # round(0.2 * 9)
    by_id = {image_id: (label, color) for image_id, label, color in written}
    x, y = image_arrays(test, size=24)
    for path, label, row in zip(test.files, y, x):
        assert by_id[path.stem][0] == label
        assert np.abs(row.reshape(3, -1).mean(-1) - np.array(by_id[path.stem][1])).max() < 3


def test_ham10000_unknown_label_is_a_clear_error(tmp_path):
    write_ham10000(tmp_path / "ham10000", per_class=1)
    metadata = tmp_path / "ham10000" / "HAM10000_metadata.csv"
    metadata.write_text(metadata.read_text().replace(",df,", ",melanoma,"))
    with pytest.raises(DataError, match="dx='melanoma'"):
        open_loader("ham10000", tmp_path, True)


def test_ag_news_tokens_from_a_training_vocabulary(tmp_path):
    write_ag_news(tmp_path / "ag_news")
    train = open_loader("ag_news", tmp_path, True, max_length=6, vocab_size=12)
    test = open_loader("ag_news", tmp_path, False, max_length=6, vocab=train.vocab)
    assert train.targets.tolist() == [2, 2, 0, 0, 1, 1, 3, 3]
    # by hand: iraq and new appear 4 times, athens, for and gold 3 times, then the 2-count tokens
    # alphabetically; ids start at 2 (0 pads, 1 is unknown)
    assert list(train.vocab) == ["iraq", "new", "athens", "for", "gold", "a", "chip", "economy", "games", "oil"]
    assert list(train.vocab.values()) == list(range(2, 12))
    # "Chip news" + "A new chip from Intel" -> chip news a new chip from (intel) cut at 6; news, from unknown
    assert test.tokens[0].tolist() == [8, 1, 7, 3, 8, 1]
    # "Gold" + "Gold in Athens for Phelps" -> gold gold in athens for phelps
    assert test.tokens[1].tolist() == [6, 6, 1, 4, 5, 1]
    # "Iraq vote" + "Iraq holds a vote" -> iraq vote iraq holds a vote: exactly 6, no padding
    assert train.tokens[3].tolist() == [2, 1, 2, 1, 7, 1]
    short = open_loader("ag_news", tmp_path, False, max_length=9, vocab=train.vocab)
    assert short.tokens[0].tolist()[-2:] == [0, 0]  # 7 tokens padded with 0 to 9
    assert tokenize("It#39;s U.S. No. 1!") == ["it's", "u", "s", "no", "1"]
    assert build_vocab(["b a a", "c b a"], 5) == {"a": 2, "b": 3, "c": 4}


def test_sun397_through_torchvision(tmp_path):
    write_sun397(tmp_path / "sun397")
    dataset = open_loader("sun397", tmp_path, True)
    assert type(dataset).__module__.startswith("torchvision")
    x, y = image_arrays(dataset, size=16)
    assert x.shape == (30, 3, 16, 16) and np.array_equal(np.bincount(y), [10, 10, 10])


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_missing_data_is_one_clear_line(tmp_path, name):
    with pytest.raises(DataError) as raised:
        open_loader(name, tmp_path, True, **({"domain": "amazon"} if name == "office-caltech" else {}))
    message = str(raised.value)
    assert "\n" not in message and str(tmp_path) in message and name in message
    assert ("data.download=true" in message) == LOADERS[name].download


def test_image_cache_is_written_once_and_memory_mapped(tmp_path):
    write_syn(tmp_path / "syn", per_class=1)
    cache = tmp_path / "cache"
    first, _ = image_arrays(open_loader("syn", tmp_path, True), size=8, cache=cache)
    files = list(cache.glob("*.npy"))
    assert len(files) == 1 and not list(cache.glob(".*tmp*"))
    second, _ = image_arrays(open_loader("syn", tmp_path, True), size=8, cache=cache)
    assert isinstance(second, np.memmap) and np.array_equal(first, second)


# --------------------------------------------------------------------------- the benchmarks


#: the benchmarks that read CIFAR or SVHN files, checked against torchvision's md5 unless data.verify=false
UNVERIFIED = ("cifar10", "cifar100", "cifar10-lt", "cifar100-lt", "digits")


def build(name: str, data_dir: Path, clients=None, seed: int = 0, data: dict | None = None, **partition):
    spec = get_dataset(name)
    if name in UNVERIFIED:  # the fixtures are not torchvision's published files
        data = {"verify": False, **(data or {})}
    options = load_config(None, {"dataset": name, **{f"data.{k}": v for k, v in (data or {}).items()}}).data
    return spec.build(options, clients, seed, data_dir=data_dir, partition=PartitionOptions(**partition))


def normalised(images: np.ndarray, preset) -> torch.Tensor:
    """By hand: (x / 255 - mean) / std per channel."""
    x = torch.from_numpy(images.astype(np.float32)) / 255.0
    return (x - torch.tensor(preset.mean).view(1, 3, 1, 1)) / torch.tensor(preset.std).view(1, 3, 1, 1)


def test_every_paper_benchmark_is_registered():
    assert {"digits", "office-caltech", "cifar10", "cifar100", "ham10000", "tinyimagenet", "cifar10-lt",
            "cifar100-lt", "tinyimagenet-lt", "ag-news", "sun397"} <= set(DATASETS)


def test_cifar10_dirichlet_clients_hold_their_written_images(tmp_path):
    written = write_cifar(tmp_path / "cifar10")
    fed = build("cifar10", tmp_path, scheme="dirichlet", alpha=0.5, min_size=2)
    x_train, y_train = written["train"]
    assert fed.num_clients == 10 and fed.input_shape == (3, 32, 32) and fed.num_classes == 10
    record = fed.partition
    assert record["scheme"] == "dirichlet" and record["seed"] == 0 and record["params"]["alpha"] == 0.5
    seen = []
    for client, entry in zip(fed.clients, record["clients"]):
        ix = np.array(entry["indices"])
        assert torch.allclose(client.x, normalised(x_train[ix], PRESETS["cifar10"]), atol=1e-6)
        assert client.y.tolist() == y_train[ix].tolist()
        assert entry["class_counts"] == np.bincount(y_train[ix], minlength=10).tolist()
        assert client.augment is None
        seen.extend(ix.tolist())
    assert sorted(seen) == list(range(len(y_train)))  # dirichlet assigns every sample once
    x_test, y_test = fed.test_sets["all"]
    assert torch.allclose(x_test, normalised(written["test"][0], PRESETS["cifar10"]), atol=1e-6)
    assert y_test.tolist() == written["test"][1].tolist()


def test_data_mean_and_std_normalise_training_test_and_predicts_inputs(tmp_path):
    """data.mean/data.std (the authors' CIFAR statistics here) replace the preset's, by hand, for one pixel
    and for every image, and travel to the trained model's input (what predict applies)."""
    written = write_cifar(tmp_path / "cifar10")
    mean, std = [0.4914, 0.4822, 0.4465], [0.2023, 0.1994, 0.2010]
    fed = build("cifar10", tmp_path, data={"mean": mean, "std": std}, scheme="iid")
    x_test = fed.test_sets["all"][0]
    pixel = int(written["test"][0][3, 1, 5, 7])
    assert x_test[3, 1, 5, 7].item() == pytest.approx((pixel / 255 - 0.4822) / 0.1994, abs=1e-6)
    chosen = PRESETS["cifar10"].__class__(32, tuple(mean), tuple(std))
    assert torch.allclose(x_test, normalised(written["test"][0], chosen), atol=1e-6)
    x_train = written["train"][0]
    for client, entry in zip(fed.clients, fed.partition["clients"]):
        assert torch.allclose(client.x, normalised(x_train[np.array(entry["indices"])], chosen), atol=1e-6)
    assert any("std [0.2023, 0.1994, 0.201]" in note for note in fed.notes)
    options = load_config(None, {"dataset": "cifar10", "data.std": std}).data
    exported = get_dataset("cifar10").image_input(options, {}, 32)
    assert exported["std"] == std and exported["mean"] == list(PRESETS["cifar10"].mean)  # one set, one kept
    plain = build("cifar10", tmp_path, scheme="iid")
    assert torch.allclose(plain.test_sets["all"][0], normalised(written["test"][0], PRESETS["cifar10"]), atol=1e-6)
    assert not any("data.mean/data.std" in note for note in plain.notes)


@pytest.mark.parametrize("setting, message", [
    ("data.std=[0.3,0.3]", "must hold 3 numbers"),
    ("data.mean=[0.1,0.2,0.3,0.4]", "must hold 3 numbers"),
    ("data.std=[0.2,0,0.2]", "must hold numbers > 0"),
    ("data.std=[0.2,-1,0.2]", "must hold numbers > 0"),
    ("data.std=[0.2,nan,0.2]", "finite"),
])
def test_data_mean_and_std_refuse_what_cannot_normalise_in_one_line(setting, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["dataset=cifar10", setting])


def test_authors_recipe_sets_their_normalisation_where_the_data_takes_channel_statistics():
    their = load_config(None, ["dataset=cifar100", "fedhpro.recipe=authors"]).data
    assert (their.mean, their.std) == ([0.4914, 0.4822, 0.4465], [0.2023, 0.1994, 0.2010])  # CIFAR-10's, as theirs
    mine = load_config(None, ["dataset=cifar10", "fedhpro.recipe=authors", "data.std=[0.3,0.3,0.3]"]).data
    assert mine.std == [0.3, 0.3, 0.3] and mine.mean == [0.4914, 0.4822, 0.4465]  # a key the user sets wins
    default = load_config(None, ["fedhpro.recipe=authors"])  # digits-offline: no channel statistics to set
    assert not hasattr(default.data, "std") and default.run.model == "resnet10-authors"
    assert load_config(None, ["dataset=cifar10"]).data.std is None  # the paper's recipe: the preset's


def test_cifar10_nid2_defaults_to_the_papers_seven_clients(tmp_path):
    write_cifar(tmp_path / "cifar10")
    fed = build("cifar10", tmp_path, scheme="nid2")
    counts = np.array([entry["class_counts"] for entry in fed.partition["clients"]])
    assert fed.num_clients == 7
    assert [(row > 0).sum() for row in counts[:6]] == [1] * 6 and (counts[6] > 0).all()


def test_cifar10_lt_shapes_the_training_set_and_keeps_the_test_set_balanced(tmp_path):
    written = write_balanced_cifar10(tmp_path / "cifar10", per_class=30)
    fed = build("cifar10-lt", tmp_path, rho=10, min_size=1)
    counts = np.array([entry["class_counts"] for entry in fed.partition["clients"]]).sum(0)
    # by hand: floor(30 * 10 ** (-c / 9)) for c = 0..9
    assert counts.tolist() == [30, 23, 17, 13, 10, 8, 6, 5, 3, 3]
    assert np.bincount(fed.test_sets["all"][1].numpy()).tolist() == [4] * 10
    assert fed.partition["scheme"] == "longtail" and fed.partition["params"]["rho"] == 10
    with pytest.raises(ConfigError, match="partition=dirichlet does not apply to cifar10-lt"):
        build("cifar10-lt", tmp_path, scheme="dirichlet")
    assert len(written["test"][1]) == 40


def test_cifar100_loads_100_classes(tmp_path):
    write_cifar(tmp_path / "cifar100", hundred=True, n_batch=60)
    fed = build("cifar100", tmp_path, clients=3, scheme="iid")
    assert fed.num_classes == 100 and [len(c) for c in fed.clients] == [100, 100, 100]


def test_digits_domains_follow_the_paper_layout(tmp_path):
    mnist = write_mnist(tmp_path / "mnist", n_train=70)
    write_usps(tmp_path / "usps", n_train=70)
    write_svhn(tmp_path / "svhn", n_train=70)
    write_syn(tmp_path / "syn", per_class=7)
    fed = build("digits", tmp_path, data={"fraction": 0.1})
    assert fed.client_domains == ["mnist"] * 3 + ["usps"] * 7 + ["svhn"] * 6 + ["syn"] * 4
    assert [len(c) for c in fed.clients] == [7] * 20  # int(0.1 * 70)
    assert list(fed.test_sets) == ["mnist", "usps", "svhn", "syn"]
    assert all(c.x.shape[1:] == (3, 32, 32) for c in fed.clients)
    # a grey 28 x 28 MNIST image becomes 3 equal channels in [-1, 1]
    entry = fed.partition["clients"][0]
    ix = np.array(entry["indices"])
    x = fed.clients[0].x
    assert torch.equal(x[:, 0], x[:, 1]) and x.min() >= -1 and x.max() <= 1
    means = (mnist["train"][0][ix].reshape(len(ix), -1).mean(1) / 255.0 - 0.5) / 0.5
    assert np.allclose(x.mean((1, 2, 3)).numpy(), means, atol=0.02)  # resizing keeps the mean
    assert fed.partition["scheme"] == "domains" and fed.partition["params"]["layout"][0] == ["mnist", 3, 0.1]
    with pytest.raises(ConfigError, match="exceed"):
        build("digits", tmp_path, data={"fraction": 0.2})  # 7 USPS clients x 20% > 1


def test_office_caltech_domains(tmp_path):
    write_office(tmp_path, per_class=10)
    fed = build("office-caltech", tmp_path)
    assert fed.client_domains == ["caltech"] * 3 + ["webcam"] + ["amazon"] * 2 + ["dslr"] * 4
    assert [len(c) for c in fed.clients] == [14] * 10  # int(0.2 * 70): 7 per class after the 30% test split
    assert {d: len(y) for d, (_, y) in fed.test_sets.items()} == {d: 30 for d in ("caltech", "webcam", "amazon",
                                                                                    "dslr")}
    with pytest.raises(ConfigError, match="partition=nid2 does not apply to office-caltech"):
        build("office-caltech", tmp_path, scheme="nid2")


def test_tinyimagenet_trains_with_autoaugment(tmp_path):
    write_tinyimagenet(tmp_path)
    fed = build("tinyimagenet", tmp_path, clients=2, scheme="iid")
    assert fed.input_shape == (3, 64, 64) and len(fed.test_sets["all"][1]) == 6
    assert all(isinstance(c.augment, AutoAugmentBatch) for c in fed.clients)
    plain = build("tinyimagenet", tmp_path, clients=2, scheme="iid", data={"augment": False, "image_size": 32})
    assert plain.clients[0].augment is None and plain.input_shape == (3, 32, 32)


def test_autoaugment_is_seeded_by_the_client_generator_and_leaves_the_global_rng(tmp_path):
    preset = PRESETS["tinyimagenet"]
    augment = AutoAugmentBatch(preset.mean, preset.std)
    x = normalised(pixels(8, (3, 16, 16), 0), preset)
    state = torch.get_rng_state()
    a = augment(x, torch.Generator().manual_seed(1))
    b = augment(x, torch.Generator().manual_seed(1))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, b) and a.shape == x.shape
    outputs = [augment(x, torch.Generator().manual_seed(s)) for s in range(2, 6)]
    assert any(not torch.allclose(o, x, atol=1e-2) for o in outputs)  # it does augment


def test_ham10000_benchmark_uses_224_pixels_unless_told(tmp_path):
    write_ham10000(tmp_path / "ham10000", per_class=9)
    fed = build("ham10000", tmp_path, clients=2, scheme="iid", data={"image_size": 32})
    assert fed.num_classes == 7 and fed.input_shape == (3, 32, 32)
    assert len(fed.test_sets["all"][1]) == 7  # round(0.11 * 9) = 1 per class
    assert PRESETS["ham10000"].size == 224


def test_ag_news_ag_nid_k10(tmp_path):
    rows = [(c, f"title {c} {i}", f"text of class {c} number {i}") for c in (1, 2, 3, 4) for i in range(10)]
    write_ag_news(tmp_path / "ag_news", train=rows, test=rows[:8])
    fed = build("ag-news", tmp_path, data={"max_length": 8})
    assert fed.num_clients == 10 and fed.input_shape == (8,) and fed.clients[0].x.dtype == torch.int64
    held = [int((np.array(e["class_counts"]) > 0).sum()) for e in fed.partition["clients"]]
    assert held == [2] * 5 + [4] * 5  # Table A10, AG-NID_K10
    assert load_config(None, {"dataset": "ag-news"}).run.model == "textcnn"


def test_sun397_defaults_to_100_clients_at_20_percent(tmp_path):
    write_sun397(tmp_path / "sun397", per_class=40)
    config = load_config(None, {"dataset": "sun397"})
    assert config.run.participation == 0.2
    assert load_config(None, {"dataset": "sun397", "participation": 0.5}).run.participation == 0.5
    fed = build("sun397", tmp_path, clients=4, scheme="iid", data={"image_size": 16})
    assert fed.num_classes == 397 and len(fed.test_sets["all"][1]) == 24  # 3 classes x round(0.2 * 40)
    assert sum(len(c) for c in fed.clients) == 96


def test_saved_partition_is_reused(tmp_path):
    write_cifar(tmp_path / "cifar10")
    first = build("cifar10", tmp_path, seed=3, scheme="dirichlet", alpha=0.3, min_size=2)
    path = tmp_path / "partition.json"
    path.write_text(json.dumps(first.partition))
    again = build("cifar10", tmp_path, seed=99, load=str(path))
    assert [e["indices"] for e in again.partition["clients"]] == [e["indices"] for e in first.partition["clients"]]
    assert all(torch.equal(a.x, b.x) for a, b in zip(first.clients, again.clients))
    assert again.partition["seed"] == 3 and again.partition["loaded_from"] == str(path)
    assert Partition.load(path).num_clients == 10
    with pytest.raises(ConfigError, match="no such file"):
        build("cifar10", tmp_path, load=str(tmp_path / "nope.json"))


def test_digits_offline_reuses_its_saved_partition(digits_data_dir, tmp_path):
    from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION

    from fedhpro.data.digits_federation import DigitsOfflineOptions

    spec = get_dataset("digits-offline")
    options = DigitsOfflineOptions(syn_size=DIGITS_SYN_SIZE, test_fraction=DIGITS_TEST_FRACTION, fraction=0.05)
    first = spec.build(options, None, 4, data_dir=digits_data_dir)
    path = tmp_path / "partition.json"
    path.write_text(json.dumps(first.partition))
    again = spec.build(options, None, 5, data_dir=digits_data_dir, partition=PartitionOptions(load=str(path)))
    assert again.client_domains == first.client_domains
    assert all(torch.equal(a.x, b.x) and torch.equal(a.y, b.y) for a, b in zip(first.clients, again.clients))
    with pytest.raises(ConfigError, match="does not apply to digits-offline"):
        spec.build(options, None, 4, data_dir=digits_data_dir, partition=PartitionOptions(scheme="ag-nid"))


# --------------------------------------------------------------------------- config and command line


def test_partition_shorthand_on_the_command_line_and_in_yaml(tmp_path):
    config = load_config(None, ["dataset=cifar10", "partition=dirichlet", "partition.alpha=0.1"])
    assert config.partition.scheme == "dirichlet" and config.partition.alpha == 0.1
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("dataset: cifar10\npartition: nid2\n")
    assert load_config(yaml_file).partition.scheme == "nid2"
    yaml_file.write_text("dataset: cifar10-lt\npartition:\n  scheme: longtail\n  rho: 50\n")
    resolved = load_config(yaml_file)
    assert resolved.partition.rho == 50.0
    assert load_config(resolved.to_dict()).partition == resolved.partition  # config.yaml round trip
    with pytest.raises(ConfigError, match="partition.scheme='dirichlett' is not valid"):
        load_config(None, ["partition=dirichlett"])
    with pytest.raises(ConfigError, match="too small"):
        load_config(None, ["partition.alpha=0"])


@pytest.mark.slow
def test_cli_missing_cifar10_is_one_line_exit_2(tmp_path, capsys):
    code = main(["run", "dataset=cifar10", "partition=dirichlet", "partition.alpha=0.5", f"data_dir={tmp_path}",
                 "progress=false", f"out={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert str(tmp_path / "cifar10") in err and "data.download=true" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_cli_run_starts_on_fixture_cifar10(tmp_path, capsys):
    write_cifar(tmp_path / "cifar10")
    out = tmp_path / "run"
    code = main(["run", "dataset=cifar10", "data.verify=false", "partition=dirichlet", "partition.alpha=0.5",
                 "partition.min_size=2", f"data_dir={tmp_path}", "rounds=1", "local_epochs=1", "method=fedavg",
                 "progress=false", "checkpoint_every=0", f"out={out}", "device=cpu"])
    assert code == 0, capsys.readouterr().err
    saved = json.loads((out / "partition.json").read_text())
    assert saved["scheme"] == "dirichlet" and saved["dataset"] == "cifar10" and len(saved["clients"]) == 10
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"] == "cifar10" and summary["rounds"] == 1


def test_cli_data_describe_prints_the_table_and_writes_the_heat_map(tmp_path, capsys):
    write_cifar(tmp_path / "cifar10")
    code = main(["data", "describe", "dataset=cifar10", "data.verify=false", "partition=nid2", f"data_dir={tmp_path}",
                 "progress=false", f"out={tmp_path / 'describe'}"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["client", "domain", "samples", "classes", "which"]
    rows = [line.split() for line in lines[1:8]]
    assert [r[3] for r in rows] == ["1"] * 6 + ["10"] and rows[6][4:] == ["all", "10"]
    assert sum(int(r[2]) for r in rows) == 150
    png = tmp_path / "describe" / "partition.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "describe" / "partition.json").read_text())["scheme"] == "nid2"


@pytest.mark.slow
def test_cli_runs_tinyimagenet_with_autoaugment_and_ag_news_with_textcnn(tmp_path, capsys):
    write_tinyimagenet(tmp_path, per_class=6)
    rows = [(c, f"title {c} {i}", f"text of class {c} number {i}") for c in (1, 2, 3, 4) for i in range(10)]
    write_ag_news(tmp_path / "ag_news", train=rows, test=rows[:8])
    common = [f"data_dir={tmp_path}", "rounds=1", "local_epochs=1", "progress=false", "checkpoint_every=0",
              "device=cpu", "batch_size=4"]
    code = main(["run", "dataset=tinyimagenet", "partition=iid", "clients=2", "data.image_size=32", "method=fedhpro",
                 f"out={tmp_path / 'tiny'}", *common])
    assert code == 0, capsys.readouterr().err
    assert "AutoAugment" in " ".join(json.loads((tmp_path / "tiny" / "summary.json").read_text())["notes"])
    code = main(["run", "dataset=ag-news", "data.max_length=8", "data.vocab_size=50", "method=fedavg",
                 f"out={tmp_path / 'ag'}", *common])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "ag" / "summary.json").read_text())
    assert summary["clients"] == 10 and 0.0 <= summary["accuracy"] <= 100.0


def test_failed_download_is_one_clear_line(tmp_path, monkeypatch):
    from urllib.error import URLError

    import torchvision.datasets.cifar as cifar

    def offline(*args, **kwargs):
        raise URLError("no network")

    monkeypatch.setattr(cifar, "download_and_extract_archive", offline)
    with pytest.raises(DataError, match=r"cifar10: download into .*cifar10 failed") as raised:
        open_loader("cifar10", tmp_path, True, download=True)
    assert "\n" not in str(raised.value)
