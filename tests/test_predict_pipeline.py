"""``fedhpro predict`` rebuilds the run's own input pipeline: the issue "No silent result left".

A run of each own-data form, then ``predict`` on that run's own test inputs, must give the accuracy the run
reported for each test set (summary.json's ``per_domain``: the engine's own evaluation, an independent
reference). Tabular sites trained with ``data.standardize=client`` are scaled by statistics the run saves
(standardize.json), checked here against statistics computed by hand with numpy; ``.npz`` files are read
as training reads them; a run folder whose pipeline cannot be rebuilt is refused in one line.
"""

from __future__ import annotations

import csv
import io
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import fedhpro
from fedhpro.cli import main as cli_main
from fedhpro.data.federation import Federation
from fedhpro.errors import ConfigError, DataError
from fedhpro.trained import ModelFileError, predict, prepare_inputs

pytestmark = pytest.mark.slow

SITES = ("alpha", "beta", "gamma")
TINY = {"rounds": 1, "local_epochs": 1, "feature_dim": 16, "progress": False, "threads": 1, "device": "cpu",
        "seed": 1, "method": "fedavg", "model": "mlp", "batch_size": 4}


def rows_of(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


def hits(text: str, labels) -> float:
    """Predict's accuracy (%) on rows whose true class names are ``labels``, in order."""
    rows = rows_of(text)
    assert len(rows) == len(labels)
    return 100.0 * sum(row["predicted"] == str(label) for row, label in zip(rows, labels)) / len(rows)


# ----------------------------------------------------------------------------------- 1. tabular standardisation


def write_wine_sites(root: Path) -> Path:
    """scikit-learn's wine data (13 raw features of very different scales, 3 classes) split into 3 sites,
    70 % of each site's rows to train.npz, the rest to test.npz; each site its own test set (domain.txt)."""
    from sklearn.datasets import load_wine

    x, y = load_wine(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    for name, part in zip(SITES, np.array_split(order, 3)):
        site = root / name
        site.mkdir(parents=True)
        cut = int(len(part) * 0.7)
        np.savez(site / "train.npz", x=x[part[:cut]].astype(np.float32), y=y[part[:cut]])
        np.savez(site / "test.npz", x=x[part[cut:]].astype(np.float32), y=y[part[cut:]])
        (site / "domain.txt").write_text(name)
    return root


@pytest.fixture(scope="module")
def wine(tmp_path_factory):
    base = tmp_path_factory.mktemp("wine")
    data = write_wine_sites(base / "data")
    result = fedhpro.run(**{**TINY, "rounds": 5, "local_epochs": 2, "batch_size": 16}, dataset="clients",
                         data_dir=str(data), out=str(base / "run"), **{"data.standardize": "client"})
    return data, result


def by_hand(x: np.ndarray, train: np.ndarray) -> torch.Tensor:
    """``x`` scaled by ``train``'s per-feature mean and population std (numpy, float64), as float32."""
    mean, std = train.astype(np.float64).mean(0), train.astype(np.float64).std(0)
    return torch.from_numpy(((x.astype(np.float64) - mean) / np.where(std > 0, std, 1.0)).astype(np.float32))


def test_predict_on_each_site_gives_the_run_s_own_accuracy(wine):
    data, result = wine
    per_domain = result.summary["per_domain"]
    assert result.accuracy > 60  # the model learned something: a raw-input prediction would be far off
    for name in SITES:
        test = np.load(data / name / "test.npz")
        text = predict(result.out, [data / name / "test.npz"], site=name)
        assert hits(text, test["y"]) == pytest.approx(per_domain[name], abs=1e-9), name


def test_predict_scales_as_numpy_does_per_site_and_pooled(wine):
    """The statistics saved are those computed here by hand: each site's own, and all training rows pooled
    (predict's default, for a new site); the predicted classes are the model's on rows scaled by hand."""
    data, result = wine
    module = fedhpro.load_model(result.out, preprocess=False)  # the bare network: rows scaled by hand
    trains = {name: np.load(data / name / "train.npz")["x"] for name in SITES}
    pooled = np.concatenate(list(trains.values()))
    classes = json.loads((result.out / "model.json").read_text())["classes"]
    for name in SITES:
        x = np.load(data / name / "test.npz")["x"]
        for site, reference in ((name, trains[name]), (None, pooled)):
            scaled = prepare_inputs(result.out, torch.from_numpy(x), site=site)
            assert torch.allclose(scaled, by_hand(x, reference), atol=1e-5)
            with torch.no_grad():
                expected = [classes[int(i)] for i in module(by_hand(x, reference)).argmax(1)]
            text = predict(result.out, [data / name / "test.npz"], site=site)
            assert [row["predicted"] for row in rows_of(text)] == expected


def test_the_cli_predicts_with_the_pooled_statistics(wine, capsys):
    data, result = wine
    assert cli_main(["predict", str(result.out), str(data / "beta" / "test.npz")]) == 0
    printed = capsys.readouterr().out
    assert printed == predict(result.out, [data / "beta" / "test.npz"])


def copy_run(result, tmp_path: Path) -> Path:
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(result.out, folder, ignore=shutil.ignore_patterns("checkpoints"))
    return folder


def test_a_run_without_statistics_is_refused_in_one_line(wine, tmp_path, capsys):
    """An old run folder (standardize=client, no standardize.json): refused, naming the fix."""
    data, result = wine
    folder = copy_run(result, tmp_path)
    info = json.loads((folder / "model.json").read_text())
    del info["input"]["statistics"]
    (folder / "model.json").write_text(json.dumps(info))
    (folder / "standardize.json").unlink()
    with pytest.raises(ModelFileError, match="standardize=client.*run it again"):
        predict(folder, [data / "alpha" / "test.npz"])
    assert cli_main(["predict", str(folder), str(data / "alpha" / "test.npz")]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and "standardize.json" in err


@pytest.mark.parametrize("change, message", [
    (lambda s: s["sites"]["alpha"].update(mean=s["sites"]["alpha"]["mean"][:5]), "13 finite numbers"),
    (lambda s: s["pooled"].update(std=[0.0] * 13), "> 0"),
    (lambda s: s["pooled"].update(mean=["1"] * 13), "13 finite numbers"),
    (lambda s: s.update(format="other/9"), "not a fedhpro statistics file"),
    (lambda s: s.update(sites=[]), "sites"),
])
def test_damaged_statistics_are_one_line(wine, tmp_path, change, message):
    data, result = wine
    folder = copy_run(result, tmp_path)
    statistics = json.loads((folder / "standardize.json").read_text())
    change(statistics)
    (folder / "standardize.json").write_text(json.dumps(statistics))
    with pytest.raises(ModelFileError, match=message) as error:
        predict(folder, [data / "alpha" / "test.npz"])
    assert "\n" not in str(error.value)


def test_statistics_outside_the_folder_or_huge_are_refused(wine, tmp_path):
    data, result = wine
    folder = copy_run(result, tmp_path)
    info = json.loads((folder / "model.json").read_text())
    info["input"]["statistics"] = "../elsewhere.json"
    (folder / "model.json").write_text(json.dumps(info))
    with pytest.raises(ModelFileError, match="outside the run folder"):
        predict(folder, [data / "alpha" / "test.npz"])
    folder = copy_run(result, tmp_path / "b")
    (folder / "standardize.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ModelFileError):
        predict(folder, [data / "alpha" / "test.npz"])


def test_an_unknown_site_or_a_site_without_scaling_is_one_line(wine, tmp_path):
    data, result = wine
    with pytest.raises(ConfigError, match="alpha, beta, gamma"):
        predict(result.out, [data / "alpha" / "test.npz"], site="delta")
    out = tmp_path / "raw"
    raw = fedhpro.run(**TINY, dataset="clients", data_dir=str(data), out=str(out), **{"data.standardize": "none"})
    assert not (out / "standardize.json").exists()
    assert "standardize" not in json.loads((out / "model.json").read_text())["input"]
    with pytest.raises(ConfigError, match="leave out the site"):
        predict(raw.out, [data / "alpha" / "test.npz"], site="alpha")


# ----------------------------------------------------------------------------------- 3. .npz inputs


def test_predict_reads_npz_as_training_does(wine, tmp_path):
    """A training file (x and y), a single array, a .pt dict of x and y: the same rows, the same CSV."""
    data, result = wine
    test = np.load(data / "gamma" / "test.npz")
    reference = predict(result.out, [data / "gamma" / "test.npz"], site="gamma")
    np.savez(tmp_path / "only.npz", test["x"])
    torch.save({"x": torch.from_numpy(test["x"]), "y": torch.from_numpy(test["y"])}, tmp_path / "train_form.pt")
    torch.save(torch.from_numpy(test["x"]), tmp_path / "plain.pt")
    for path in ("only.npz", "train_form.pt", "plain.pt"):
        text = predict(result.out, [tmp_path / path], site="gamma")
        assert [r["predicted"] for r in rows_of(text)] == [r["predicted"] for r in rows_of(reference)], path


def test_hostile_npz_inputs_are_one_line_and_never_unpickled(wine, tmp_path, capsys):
    data, result = wine
    np.savez(tmp_path / "objects.npz", x=np.array([{"a": 1}, None], dtype=object))
    np.savez(tmp_path / "two.npz", a=np.zeros((2, 13)), b=np.zeros((2, 13)))
    np.savez(tmp_path / "shape.npz", x=np.zeros((2, 7), np.float32))
    np.savez(tmp_path / "nan.npz", x=np.full((2, 13), np.nan, np.float32))
    (tmp_path / "garbage.npz").write_bytes(b"PK\x03\x04 not a zip" + pickle.dumps(object()))
    cases = {"objects.npz": "Object arrays cannot be loaded", "two.npz": "no x", "shape.npz": "N x 13",
             "nan.npz": "NaN", "garbage.npz": "not a .npz file"}
    for name, word in cases.items():
        with pytest.raises(DataError, match=word):
            predict(result.out, [tmp_path / name])
        assert cli_main(["predict", str(result.out), str(tmp_path / name)]) != 0
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "Traceback" not in err, (name, err)


# ----------------------------------------------------------------------------------- 4. every own-data form

COLOURS = {"cat": (220, 40, 40), "dog": (40, 220, 40), "fox": (40, 40, 220)}


def picture(colour, rng, side: int = 11) -> Image.Image:
    """A ``side x side`` picture of ``colour`` with noise wide enough that a 1-round model errs on some."""
    pixels = np.clip(np.array(colour) + rng.integers(-90, 91, (side, side, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def write_images(root: Path, counts: dict[str, int], rng) -> None:
    for name, n in counts.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            picture(COLOURS[name], rng).save(root / name / f"{i:02d}.png")


def image_labels(folder: Path) -> list[str]:
    """The class of each image predict lists for ``folder`` (sorted by path): its class folder's name."""
    return [p.parent.name for p in sorted(p for p in folder.rglob("*.png"))]


def form_imagefolder(tmp: Path) -> tuple[dict, dict]:
    rng = np.random.default_rng(1)
    for domain in ("photos", "sketches"):
        write_images(tmp / "data" / domain / "train", {c: 6 for c in COLOURS}, rng)
        write_images(tmp / "data" / domain / "test", {c: 4 for c in COLOURS}, rng)
    run = {"dataset": "imagefolder", "data_dir": str(tmp / "data"), "clients": 2, "data.image_size": 8}
    return run, {d: tmp / "data" / d / "test" for d in ("photos", "sketches")}


def form_sites(tmp: Path) -> tuple[dict, dict]:
    rng = np.random.default_rng(2)
    for site in SITES:
        write_images(tmp / "data" / site / "train", {c: 5 for c in COLOURS}, rng)
        write_images(tmp / "data" / site / "test", {c: 3 for c in COLOURS}, rng)
        (tmp / "data" / site / "domain.txt").write_text(site)
    run = {"dataset": "clients", "data_dir": str(tmp / "data"), "data.image_size": 8}
    return run, {site: tmp / "data" / site / "test" for site in SITES}


def form_tensors(tmp: Path) -> tuple[dict, dict]:
    data = write_wine_sites(tmp / "data")
    return {"dataset": "clients", "data_dir": str(data)}, {site: data / site / "test.npz" for site in SITES}


def form_huggingface(tmp: Path) -> tuple[dict, dict]:
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(3)
    names = list(COLOURS)

    def split(n: int):
        labels = [i % 3 for i in range(n)]
        pictures = [picture(COLOURS[names[y]], rng) for y in labels]
        features = datasets.Features({"picture": datasets.Image(), "kind": datasets.ClassLabel(names=names)})
        return datasets.Dataset.from_dict({"picture": pictures, "kind": labels}, features=features)

    test = split(12)
    datasets.DatasetDict(train=split(30), test=test).save_to_disk(str(tmp / "hf"))
    for i, item in enumerate(test):  # the test images as the files a user would give predict
        target = tmp / "test" / names[item["kind"]] / f"{i:02d}.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        item["picture"].save(target)
    run = {"dataset": "huggingface", "data.path": str(tmp / "hf"), "data.image_column": "picture",
           "data.label_column": "kind", "data.image_size": 8, "clients": 3, "partition": "iid"}
    return run, {"all": tmp / "test"}


def form_python(tmp: Path) -> tuple[dict, dict]:
    """Federation.from_datasets: predict cannot take a Python object, so the test tensors are saved (.pt)."""
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(4)
    weights = torch.randn(6, 3, generator=generator)

    def site(n: int) -> TensorDataset:
        x = torch.randn(n, 6, generator=generator)
        return TensorDataset(x, (x @ weights + 0.8 * torch.randn(n, 3, generator=generator)).argmax(1))

    train, tests = [site(40) for _ in SITES], [site(15) for _ in SITES]
    federation = Federation.from_datasets(train, tests, domains=list(SITES), names=list(SITES))
    inputs = {}
    for name, test in zip(SITES, tests):
        x, y = test.tensors
        torch.save({"x": x, "y": y}, tmp / f"{name}.pt")
        inputs[name] = tmp / f"{name}.pt"
    return {"federation": federation}, inputs


FORMS = {"imagefolder": form_imagefolder, "sites": form_sites, "tensors": form_tensors,
         "huggingface": form_huggingface, "python": form_python}


def true_labels(path: Path) -> list[str]:
    if path.is_dir():
        return image_labels(path)
    content = np.load(path) if path.suffix == ".npz" else torch.load(path, weights_only=True)
    return [str(int(v)) for v in content["y"]]


@pytest.mark.parametrize("form", list(FORMS))
def test_a_run_of_each_own_data_form_then_predict_gives_the_run_s_accuracy(form, tmp_path):
    settings, test_inputs = FORMS[form](tmp_path)
    result = fedhpro.run(**TINY, out=str(tmp_path / "run"), **settings)
    per_domain = result.summary["per_domain"]
    assert set(per_domain) == set(test_inputs)
    for name, path in test_inputs.items():
        text = predict(result.out, [path], **({"site": name} if form == "tensors" else {}))
        assert hits(text, true_labels(path)) == pytest.approx(per_domain[name], abs=1e-9), (form, name)


def test_16_bit_and_standardised_images_are_predicted_as_the_run_read_them(tmp_path):
    """An image folder of 12-bit values in 16-bit PNGs with data.standardize=train: predict decodes new images
    by the run's recorded bit depth and channel statistics, so its accuracy on each domain's test images is the
    run's (read as 8-bit data in [-1, 1] they gave 33 % here against the run's 83 %)."""
    rng = np.random.default_rng(5)
    levels = {"cat": 600, "dog": 2000, "fox": 3400}
    for domain in ("photos", "sketches"):
        for split, n in (("train", 6), ("test", 4)):
            for name, level in levels.items():
                (tmp_path / "data" / domain / split / name).mkdir(parents=True)
                for i in range(n):
                    values = np.clip(level + rng.integers(-1400, 1401, (11, 11)), 0, 4095).astype(np.uint16)
                    Image.fromarray(values).save(tmp_path / "data" / domain / split / name / f"{i}.png")
    result = fedhpro.run(**TINY, out=str(tmp_path / "run"), dataset="imagefolder", data_dir=str(tmp_path / "data"),
                         clients=2, **{"data.image_size": 8, "data.standardize": "train"})
    info = json.loads((result.out / "model.json").read_text())["input"]
    assert info["bit_depth"] == 12 and set(info["standardize"]) == {"mean", "std"}
    for domain, accuracy in result.summary["per_domain"].items():
        path = tmp_path / "data" / domain / "test"
        assert hits(predict(result.out, [path]), true_labels(path)) == pytest.approx(accuracy, abs=1e-9), domain


def test_the_cli_predicts_with_one_site_s_statistics(wine, capsys):
    """``fedhpro predict --site NAME``: the rows scaled by that site's training statistics, as predict(site=)."""
    data, result = wine
    assert cli_main(["predict", str(result.out), str(data / "beta" / "test.npz"), "--site", "beta"]) == 0
    printed = capsys.readouterr().out
    assert printed == predict(result.out, [data / "beta" / "test.npz"], site="beta")
    assert printed != predict(result.out, [data / "beta" / "test.npz"])  # the pooled statistics differ
