"""The stumbles of a new user with their own data (issue 26, 1-9): each is read as the user means it, or
refused in one line.

Every data file is written here (PNG and TIFF through PIL, ``.npz``, a Hugging Face data set saved with
``save_to_disk``) and every expectation is counted from what was written: the files per folder, the
pixel formula of a bit depth, the mean and standard deviation of the features.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedhpro import cli
from fedhpro.config import load_config
from fedhpro.data import get_dataset, images
from fedhpro.data.clients import ClientsOptions, client_folders, load_client, resolve_classes, scan_client
from fedhpro.data.federation import Federation, avg_note
from fedhpro.errors import ConfigError, DataError

COLOURS = {"cat": (220, 40, 40), "dog": (40, 220, 40), "owl": (40, 40, 220), "seven": (220, 220, 40)}


def _png(path: Path, colour: tuple[int, int, int], rng: np.random.Generator, side: int = 4) -> Path:
    pixels = np.clip(np.array(colour) + rng.integers(-10, 11, (side, side, 3)), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return path


def _folder(root: Path, counts: dict[str, int], rng: np.random.Generator, offset: int = 0) -> None:
    for name, n in counts.items():
        for i in range(n):
            _png(root / name / f"{offset + i:03d}.png", COLOURS[name], rng)


def _build(dataset: str, *overrides: str) -> Federation:
    config = load_config(None, [f"dataset={dataset}", *overrides])
    return get_dataset(dataset).build(config.data, config.run.clients, config.run.seed, data_dir=config.run.data_dir,
                                      partition=config.partition)


def _colour_class(x: torch.Tensor) -> str:
    mean = ((x.float().mean(dim=(1, 2)) + 1.0) * 127.5).numpy()
    return min(COLOURS, key=lambda c: float(np.abs(mean - np.array(COLOURS[c])).sum()))


def _tiny_run(tmp_path: Path, **settings) -> dict:
    import fedhpro

    common = {"method": "fedavg", "rounds": 4, "local_epochs": 2, "feature_dim": 16, "device": "cpu",
              "progress": False, "threads": 1, "seed": 0, "lr": 0.05, "out": str(tmp_path / "run")}
    return fedhpro.run(**{**common, **settings}).summary


# ----------------------------------------------------------------------------------- 1. split folders


def test_1_split_folders_are_matched_in_any_case_and_spelling(tmp_path):
    rng = np.random.default_rng(1)
    kaggle = tmp_path / "kaggle"
    _folder(kaggle / "Train", {"cat": 6, "dog": 4}, rng)
    _folder(kaggle / "Test", {"cat": 2, "dog": 3}, rng)
    federation = _build("imagefolder", f"data_dir={kaggle}", "clients=2", "partition=iid")
    # Train/ + Test/ is a split, not two domains: trained on Train's 10 images, tested on Test's 5
    assert list(federation.test_sets) == ["all"] and federation.client_domains == ["", ""]
    assert sum(len(c) for c in federation.clients) == 10
    x, y = federation.test_sets["all"]
    assert y.tolist() == [0, 0, 1, 1, 1] and [_colour_class(i) for i in x] == ["cat"] * 2 + ["dog"] * 3
    assert federation.notes[0] == f"imagefolder: {kaggle}: Train/ -> training, Test/ -> test; one data set, no domains"

    # validation/ is the test split where there is no test/ (never 20 % of training/ held out instead)
    validation = tmp_path / "validation"
    _folder(validation / "training", {"cat": 5, "dog": 5}, rng)
    _folder(validation / "validation", {"cat": 1, "dog": 2}, rng)
    federation = _build("imagefolder", f"data_dir={validation}", "clients=2", "partition=iid")
    assert federation.test_sets["all"][1].tolist() == [0, 1, 1]
    assert sum(len(c) for c in federation.clients) == 10
    assert "training/ -> training, validation/ -> test" in federation.notes[0]

    # beside test/, VALID/ is not used: and the run says so
    both = tmp_path / "both"
    _folder(both / "train", {"cat": 5, "dog": 5}, rng)
    _folder(both / "test", {"cat": 2, "dog": 2}, rng)
    _folder(both / "VALID", {"cat": 3, "dog": 3}, rng)
    federation = _build("imagefolder", f"data_dir={both}", "clients=2", "partition=iid")
    assert len(federation.test_sets["all"][1]) == 4
    assert any("VALID/ is not used: test/ is the test split" in note for note in federation.notes)

    # domains with their own split folders, in any case: one line names every folder's role
    domains = tmp_path / "domains"
    _folder(domains / "photos" / "TRAINING", {"cat": 4, "dog": 4}, rng)
    _folder(domains / "photos" / "Testing", {"cat": 1, "dog": 1}, rng)
    _folder(domains / "sketches", {"cat": 5, "dog": 5}, rng)
    federation = _build("imagefolder", f"data_dir={domains}", "clients=2", "partition=iid")
    assert federation.notes[0] == (f"imagefolder: {domains}: 2 domains: photos (photos/TRAINING/ -> training, "
                                   "photos/Testing/ -> test); sketches (sketches/<class>/ -> training, 0.2 of each "
                                   "class held out -> test)")
    # two folders for one split: one line
    (both / "Training").mkdir()
    with pytest.raises(DataError, match="Training/ and train/, both taken for the train split"):
        _build("imagefolder", f"data_dir={both}")


# ----------------------------------------------------------------------------------- 2. bit depths


def test_2_sixteen_bit_and_float_images_are_scaled_by_their_bit_depth(tmp_path):
    gradient = (np.arange(64 * 64, dtype=np.int64).reshape(64, 64) * 16).astype(np.uint16)  # 0 .. 65520
    path = tmp_path / "gradient.png"
    Image.fromarray(gradient).save(path)
    with Image.open(path) as opened:
        assert opened.mode.startswith("I")  # what PIL's convert("RGB") clips to 99.6 % white
    pixels = images.decode_files([path], 64)[0]
    expected = np.rint(gradient * (255 / 65535)).astype(np.uint8)
    assert all(np.array_equal(pixels[c], expected) for c in range(3))
    floats = tmp_path / "float.tiff"
    values = np.linspace(0, 1, 16, dtype=np.float32).reshape(4, 4)
    Image.fromarray(values).save(floats)
    assert np.array_equal(images.decode_files([floats], 4)[0, 0], np.rint(values * 255).astype(np.uint8))
    Image.fromarray(values * 300).save(floats)
    with pytest.raises(DataError, match="float pixels outside 0..1"):
        images.decode_files([floats], 4)


@pytest.mark.slow
def test_2_two_classes_differing_only_in_16_bit_intensity_are_learned(tmp_path):
    rng = np.random.default_rng(2)
    root = tmp_path / "scans"
    for split, n in (("train", 40), ("test", 20)):
        for name, level in (("dim", 15000), ("bright", 40000)):  # both far above 255: one white before
            for i in range(n):
                pixels = np.clip(level + rng.integers(-3000, 3001, (8, 8)), 0, 65535).astype(np.uint16)
                target = root / split / name / f"{i:03d}.png"
                target.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(pixels).save(target)
    summary = _tiny_run(tmp_path, dataset="imagefolder", data_dir=str(root), model="mlp", clients=2,
                        partition="iid", **{"data.image_size": 8})
    assert summary["accuracy"] > 90


# ----------------------------------------------------------------------------------- 3. clients_per_domain


@pytest.fixture(scope="module")
def three_domains(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("domains")
    rng = np.random.default_rng(3)
    for domain in ("a", "b", "c"):
        _folder(root / domain / "train", {"cat": 6, "dog": 6}, rng)
        _folder(root / domain / "test", {"cat": 1, "dog": 1}, rng)
    return root


def _layout(root: Path, *settings: str) -> dict[str, int]:
    federation = _build("imagefolder", f"data_dir={root}", "partition=iid", *settings)
    return {d: federation.client_domains.count(d) for d in sorted(set(federation.client_domains))}


def test_3_clients_per_domain_alone_keeps_the_other_domains_defaults(three_domains):
    # without it: 10 clients round robin over a, b, c = 4, 3, 3
    assert _layout(three_domains) == {"a": 4, "b": 3, "c": 3}
    assert _layout(three_domains, "data.clients_per_domain.a=2") == {"a": 2, "b": 3, "c": 3}
    assert _layout(three_domains, "data.clients_per_domain.c=0") == {"a": 4, "b": 3}  # 0 leaves a domain out


def test_3_clients_per_domain_with_clients_shares_the_rest(three_domains):
    # clients=7 less a's 1: 6 round robin over b, c
    assert _layout(three_domains, "clients=7", "data.clients_per_domain.a=1") == {"a": 1, "b": 3, "c": 3}
    # too few for the unnamed domains: c gets none, and the run says so (the built-in data sets' rule)
    assert _layout(three_domains, "clients=2", "data.clients_per_domain.a=1") == {"a": 1, "b": 1}
    notes = _build("imagefolder", f"data_dir={three_domains}", "partition=iid", "clients=2",
                   "data.clients_per_domain.a=1").notes
    assert "imagefolder: clients=2 is fewer than its 3 domains, so domain c gets no client: not trained on, not " \
           "tested, and AVG covers a, b only" in " ".join(notes)


def test_3_clients_per_domain_for_all_domains(three_domains):
    every = "data.clients_per_domain={a: 1, b: 2, c: 3}"
    assert _layout(three_domains, every) == {"a": 1, "b": 2, "c": 3}
    assert _layout(three_domains, every, "clients=6") == {"a": 1, "b": 2, "c": 3}
    with pytest.raises(ConfigError, match="clients=5 but data.clients_per_domain gives every domain"):
        _layout(three_domains, every, "clients=5")


# ----------------------------------------------------------------------------------- 4. data_dir without dataset=


@pytest.mark.slow
def test_4_data_dir_without_dataset_is_refused_and_nothing_is_written(tmp_path, capsys):
    rng = np.random.default_rng(4)
    mine = tmp_path / "my-images"
    _folder(mine, {"cat": 3, "dog": 3}, rng)
    before = sorted(p.relative_to(mine) for p in mine.rglob("*"))
    with pytest.raises(ConfigError, match="did you mean dataset=imagefolder"):
        load_config(None, [f"data_dir={mine}"])
    code = cli.main(["run", f"data_dir={mine}", "rounds=1", "progress=false", f"out={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "\n" not in err and "dataset=imagefolder" in err
    assert sorted(p.relative_to(mine) for p in mine.rglob("*")) == before
    # the default data set's own cache folder, an empty or a new folder: data_dir is where it builds
    (tmp_path / "cache" / "digits-offline").mkdir(parents=True)
    for fine in (tmp_path / "cache", tmp_path / "empty", tmp_path / "new"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        assert load_config(None, [f"data_dir={fine}"]).run.data_dir == str(fine)
    # with dataset=imagefolder the one thing written into the folder is the documented cache
    _build("imagefolder", f"data_dir={mine}", "clients=1", "partition=iid", "data.test_fraction=0.4")
    written = {p.relative_to(mine).parts[0] for p in mine.rglob("*")} - {p.parts[0] for p in before}
    assert written == {images.CACHE_FOLDER}


# ----------------------------------------------------------------------------------- 5. empty, nested, missing


def test_5_empty_class_folders_nested_images_and_classes_missing_from_test(tmp_path):
    rng = np.random.default_rng(5)
    root = tmp_path / "digits"
    _folder(root / "train", {"cat": 4, "dog": 4}, rng)
    (root / "train" / "empty").mkdir()
    (root / "test" / "empty").mkdir(parents=True)
    for i in range(3):  # read as torchvision's ImageFolder reads them: at any depth below the class folder
        _png(root / "train" / "seven" / "batch2" / f"{i}.png", COLOURS["seven"], rng)
    _png(root / "train" / "seven" / "batch3" / "deeper" / "x.png", COLOURS["seven"], rng)
    os.symlink(root / "train" / "seven", root / "train" / "seven" / "batch3" / "loop")  # read once, not forever
    _folder(root / "test", {"cat": 1, "dog": 2}, rng)
    federation = _build("imagefolder", f"data_dir={root}", "clients=1", "partition=iid")
    classes = federation.partition["classes"]
    assert classes == ["cat", "dog", "seven"] and federation.num_classes == 3
    x, y = federation.clients[0].x, federation.clients[0].y
    assert torch.bincount(y, minlength=3).tolist() == [4, 4, 4]
    assert all(classes[int(label)] == _colour_class(image) for image, label in zip(x, y))
    notes = "\n".join(federation.notes)
    assert "class folders without images left out (no class): empty" in notes
    assert "classes without test images (their accuracy is not measured): seven" in notes

    # dataset=clients: the same rules, per client folder
    sites = tmp_path / "sites"
    _folder(sites / "a" / "train", {"cat": 2, "dog": 2}, rng)
    _folder(sites / "a" / "test", {"cat": 1}, rng)
    (sites / "a" / "train" / "owl").mkdir()
    _png(sites / "b" / "Train" / "dog" / "nested" / "0.png", COLOURS["dog"], rng)
    federation = _build("clients", f"data_dir={sites}")
    assert federation.partition["classes"] == ["cat", "dog"]
    assert [len(c) for c in federation.clients] == [4, 1]
    notes = "\n".join(federation.notes)
    assert "class folders without images left out: a/train/owl" in notes
    assert "classes without test images (their accuracy is not measured): dog" in notes


# ----------------------------------------------------------------------------------- 6. tabular standardisation


def _wine_sites(root: Path) -> Path:
    from sklearn.datasets import load_wine

    x, y = load_wine(return_X_y=True)
    order = np.random.default_rng(6).permutation(len(y))
    x, y = x[order].astype(np.float32), y[order].astype(np.int64)
    for k in range(3):  # three sites, each with its own 80/20 split
        xs, ys = x[k::3], y[k::3]
        cut = int(0.8 * len(ys))
        (root / f"site-{k}").mkdir(parents=True)
        np.savez(root / f"site-{k}" / "train.npz", x=xs[:cut], y=ys[:cut])
        np.savez(root / f"site-{k}" / "test.npz", x=xs[cut:], y=ys[cut:])
    return root


def test_6_tabular_features_are_standardised_by_each_clients_own_statistics(tmp_path):
    root = _wine_sites(tmp_path / "wine")
    federation = _build("clients", f"data_dir={root}", "data.standardize=client")
    raw = _build("clients", f"data_dir={root}", "data.standardize=none")
    for k, folder in enumerate(client_folders(root)):
        with np.load(folder / "train.npz") as train, np.load(folder / "test.npz") as test:
            mean = train["x"].astype(np.float64).mean(axis=0)
            std = train["x"].astype(np.float64).std(axis=0)  # the client's own, over its training rows
            expected = ((train["x"] - mean) / std, (test["x"] - mean) / std)
        np.testing.assert_allclose(federation.clients[k].x.numpy(), expected[0], rtol=0, atol=1e-5)
        np.testing.assert_allclose(federation.client_tests[k][0].numpy(), expected[1], rtol=0, atol=1e-5)
        np.testing.assert_array_equal(raw.clients[k].x.numpy(), np.load(folder / "train.npz")["x"])
        # a Flower node, holding only its own folder, gets the same tensors
        options = ClientsOptions(standardize="client")
        classes = resolve_classes([scan_client(f, options) for f in client_folders(root)], options)
        (train_x, _), (test_x, _), _ = load_client(folder, options, classes)
        assert torch.equal(train_x, federation.clients[k].x) and torch.equal(test_x, federation.client_tests[k][0])
    assert any("standardised with each client's own training mean and std" in note for note in federation.notes)


@pytest.mark.slow
def test_6_wine_is_learned_with_the_default(tmp_path):
    pytest.importorskip("sklearn")
    root = _wine_sites(tmp_path / "wine")
    summary = _tiny_run(tmp_path, dataset="clients", data_dir=str(root), model="mlp", rounds=12)
    # 97.2 % measured; the most frequent class is 40 % of the test rows, and data.standardize=none stays at
    # 36.1 % (the 13 features' scales differ by up to 10^4)
    assert summary["accuracy"] > 85


# ----------------------------------------------------------------------------------- 7. from_datasets


def test_7_from_datasets_maps_classes_by_name_across_sites(tmp_path):
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import ToTensor

    rng = np.random.default_rng(7)
    _folder(tmp_path / "a" / "train", {"cat": 3, "dog": 2}, rng)
    _folder(tmp_path / "b" / "train", {"dog": 2, "owl": 3}, rng)  # its ImageFolder numbers dog 0, owl 1
    _folder(tmp_path / "test", {"cat": 1, "dog": 1, "owl": 1}, rng)
    sites = [ImageFolder(str(tmp_path / s / "train"), transform=ToTensor()) for s in ("a", "b")]
    test = ImageFolder(str(tmp_path / "test"), transform=ToTensor())
    federation = Federation.from_datasets(sites, {"all": test})
    classes = federation.partition["classes"]
    assert classes == ["cat", "dog", "owl"] and federation.num_classes == 3
    for client in federation.clients:  # every label found again from the image's colour
        assert all(classes[int(label)] == _colour_class(x * 2 - 1) for x, label in zip(client.x, client.y))
    assert federation.clients[1].y.tolist() == [1, 1, 2, 2, 2]
    assert any("matched by name" in note for note in federation.notes)
    # the same numbering everywhere: labels as they are, no note of it (the one note says what AVG is)
    same = Federation.from_datasets([sites[0], sites[0]], [sites[0], sites[0]])
    assert same.clients[0].y.tolist() == [0, 0, 0, 1, 1] and same.notes == [avg_note([("client 0", "all"),
                                                                                      ("client 1", "all")])]
    bare = torch.utils.data.TensorDataset(torch.zeros(2, 3, 4, 4), torch.tensor([0, 1]))
    with pytest.raises(DataError, match="names its classes .* but client 1's training dataset does not"):
        Federation.from_datasets([sites[0], bare], {"all": test})


# ----------------------------------------------------------------------------------- 8. a site without test/


def test_8_a_site_without_a_test_split_is_named_and_not_tested(tmp_path):
    rng = np.random.default_rng(8)
    for site in ("clinic-0", "clinic-1", "lab-0"):
        _folder(tmp_path / site / "train", {"cat": 2, "dog": 2}, rng)
        if site != "clinic-1":
            _folder(tmp_path / site / "test", {"cat": 1, "dog": 1}, rng)
    federation = _build("clients", f"data_dir={tmp_path}")
    assert federation.untested_clients == [1]
    assert ("clients without a test split, not tested (no accuracy of their own, left out of the fairness "
            "statistics): clinic-1") in federation.notes
    # from Python: the same note and the same list
    x, y = torch.zeros(2, 3), torch.tensor([0, 1])
    given = Federation.from_tensors([(x, y)] * 2, [(x, y), (x[:0], y[:0])], names=["a", "b"])
    assert given.untested_clients == [1] and given.notes[-1].endswith("statistics): b")


# ----------------------------------------------------------------------------------- 9. Hugging Face columns


def test_9_huggingface_columns_are_found_from_their_feature_types(tmp_path):
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(9)
    names = ["cat", "dog"]

    def split(n: int, extra: bool = False):
        labels = [i % 2 for i in range(n)]
        pictures = [Image.fromarray(np.clip(np.array(COLOURS[names[y]]) + rng.integers(-10, 11, (4, 4, 3)), 0,
                                            255).astype(np.uint8)) for y in labels]
        columns = {"picture": pictures, "kind": labels}
        features = {"picture": datasets.Image(), "kind": datasets.ClassLabel(names=names)}
        if extra:
            columns["mood"] = labels
            features["mood"] = datasets.ClassLabel(names=["calm", "wild"])
        return datasets.Dataset.from_dict(columns, features=datasets.Features(features))

    datasets.DatasetDict(train=split(8), test=split(4)).save_to_disk(str(tmp_path / "hf"))
    federation = _build("huggingface", f"data.path={tmp_path / 'hf'}", "clients=2", "partition=iid",
                        "data.image_size=4")
    assert federation.partition["classes"] == names
    assert [_colour_class(x) for x in federation.test_sets["all"][0]] == ["cat", "dog"] * 2
    assert "huggingface: images from the column 'picture' (its Image feature)" in federation.notes
    assert "huggingface: labels from the column 'kind' (its ClassLabel feature)" in federation.notes
    datasets.DatasetDict(train=split(8, True), test=split(4, True)).save_to_disk(str(tmp_path / "two"))
    with pytest.raises(ConfigError, match="several ClassLabel columns \\(kind, mood\\).*data.label_column"):
        _build("huggingface", f"data.path={tmp_path / 'two'}")
    given = _build("huggingface", f"data.path={tmp_path / 'two'}", "data.label_column=mood", "clients=2",
                   "partition=iid", "data.image_size=4")
    assert given.partition["classes"] == ["calm", "wild"]


@pytest.mark.slow
def test_8_a_site_without_a_test_split_has_no_accuracy_of_its_own_in_the_run(tmp_path, capsys):
    """The run's rows and summary: the untested site's accuracy is None (not the pooled AVG), the fairness
    statistics are those of the tested sites alone, and the CLI-style echo names it before training."""
    import fedhpro
    from fedhpro.metrics import fairness_statistics

    rng = np.random.default_rng(80)
    for site in ("clinic-0", "clinic-1", "lab-0"):
        _folder(tmp_path / "data" / site / "train", {"cat": 3, "dog": 3}, rng)
        if site != "clinic-1":
            _folder(tmp_path / "data" / site / "test", {"cat": 2, "dog": 2}, rng)
    result = fedhpro.run(dataset="clients", data_dir=str(tmp_path / "data"), method="fedavg", rounds=1,
                         local_epochs=1, feature_dim=8, progress=False, threads=1, echo=True,
                         out=str(tmp_path / "run"))
    accuracies = result.summary["client_accuracy"]
    assert accuracies[1] is None and None not in (accuracies[0], accuracies[2])
    assert result.summary["fairness"] == fairness_statistics([accuracies[0], accuracies[2]])
    assert "note: clients without a test split, not tested" in capsys.readouterr().out


def test_image_folder_class_or_domain_folders_differing_only_in_case_are_refused(tmp_path):
    """``Blue Square`` beside ``blue square`` would be two classes; in an image folder, as across sites, it is
    one line naming both spellings (and the same for domain folders)."""
    rng = np.random.default_rng(0)
    colour = next(iter(COLOURS.values()))
    for name in ("blue square", "Blue Square"):
        for split in ("train", "test"):
            _png(tmp_path / "classes" / split / name / "0.png", colour, rng)
    with pytest.raises(DataError, match="'Blue Square'.*'blue square'|'blue square'.*'Blue Square'") as raised:
        _build("imagefolder", f"data_dir={tmp_path / 'classes'}", "clients=1")
    assert "\n" not in str(raised.value)
    for domain in ("North", "north"):
        for split in ("train", "test"):
            _png(tmp_path / "domains" / domain / split / "a" / "0.png", colour, rng)
    with pytest.raises(DataError, match="domain folders"):
        _build("imagefolder", f"data_dir={tmp_path / 'domains'}", "clients=2")


@pytest.mark.slow
def test_4_a_csv_table_as_data_dir_without_dataset_names_dataset_clients(tmp_path, capsys):
    table = tmp_path / "cancer.csv"
    table.write_text("site,split,x,label\na,train,1.0,benign\n")
    with pytest.raises(ConfigError, match="is a CSV table but no dataset= is given; did you mean dataset=clients"):
        load_config(None, [f"data_dir={table}"])
    code = cli.main(["run", f"data_dir={table}", "rounds=1", "progress=false", f"out={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "\n" not in err and "dataset=clients" in err and not (tmp_path / "run").exists()
