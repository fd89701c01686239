"""Images of more than 8 bits in ``dataset=imagefolder``: their precision is kept, their bit depth is found
per data set and said, and ``data.standardize=train`` standardises low-contrast inputs; 8-bit data is read
byte for byte as before.

The learning budget of these tests (20 training and 10 test images a class, 4x4 pixels, two clients, 4
rounds of 2 local epochs of FedAvg with an MLP) is one where the 8-bit version of the 12-bit data learns to
100 %; the 16-bit files stayed at 50 % there when they were scaled by 255/65535 into 8 bits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import fedhpro
from fedhpro.config import load_config
from fedhpro.data import get_dataset, images
from fedhpro.data.federation import Federation
from fedhpro.errors import ConfigError, DataError


def _two_classes(root: Path, low: float, high: float, noise: float, top: int, eight: bool = False) -> Path:
    """Two classes of grey 4x4 images, means ``low`` and ``high`` of ``0..top``: 16-bit PNGs, or with
    ``eight`` the same images scaled to the full 8-bit range."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 20), ("test", 10)):
        for name, level in (("a", low), ("b", high)):
            for i in range(n):
                values = np.clip(level + rng.normal(0, noise, (4, 4)), 0, top)
                pixels = np.rint(values * 255 / top).astype(np.uint8) if eight else np.rint(values).astype(np.uint16)
                target = root / split / name / f"{i:03d}.png"
                target.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(pixels).save(target)
    return root


def _run(tmp_path: Path, root: Path, name: str, **settings) -> dict:
    common = {"method": "fedavg", "rounds": 4, "local_epochs": 2, "feature_dim": 16, "device": "cpu",
              "progress": False, "threads": 1, "seed": 0, "lr": 0.05, "dataset": "imagefolder", "model": "mlp",
              "clients": 2, "partition": "iid", "data.image_size": 4}
    return fedhpro.run(**{**common, "data_dir": str(root), "out": str(tmp_path / name), **settings}).summary


def _build(root: Path, *overrides: str) -> Federation:
    config = load_config(None, ["dataset=imagefolder", f"data_dir={root}", "clients=2", "partition=iid", *overrides])
    return get_dataset("imagefolder").build(config.data, config.run.clients, config.run.seed,
                                            data_dir=config.run.data_dir, partition=config.partition)


@pytest.mark.slow
def test_12_bit_values_in_16_bit_pngs_are_learned_as_their_8_bit_version(tmp_path):
    eight = _run(tmp_path, _two_classes(tmp_path / "eight", 1500, 2500, 300, 4095, eight=True), "eight")
    assert eight["accuracy"] >= 90  # the budget learns the 8-bit version (measured: 100 %)
    twelve = _run(tmp_path, _two_classes(tmp_path / "twelve", 1500, 2500, 300, 4095), "twelve")
    assert twelve["accuracy"] >= 90  # measured 100 %; 50 % when scaled by 255/65535 into 8 bits
    assert any("read as 12-bit" in note and "1/4095" in note for note in twelve["notes"])


@pytest.mark.slow
def test_low_contrast_16_bit_images_are_learned(tmp_path):
    root = _two_classes(tmp_path / "dim", 2000, 9000, 1500, 65535)
    detected = _run(tmp_path, root, "detected")  # every value within 14 bits: scaled by 1/16383
    assert detected["accuracy"] >= 90  # measured 100 %; 50 % before
    assert any("read as 14-bit" in note for note in detected["notes"])
    full = _run(tmp_path, root, "full", **{"data.bit_depth": 16})  # told they are 16-bit: the fixed scaling
    assert any("data.standardize=federated may learn better" in note for note in full["notes"])
    standardized = _run(tmp_path, root, "standardized", **{"data.bit_depth": 16, "data.standardize": "federated"})
    assert standardized["accuracy"] >= 90  # measured 100 %; 50 % at the fixed [-1, 1] scaling (full)
    assert full["accuracy"] <= 60
    assert any("standardised per channel" in note for note in standardized["notes"])


def _eight_bit_folder(root: Path) -> Path:
    rng = np.random.default_rng(1)
    for name in ("a", "b"):
        for i in range(12):
            side = int(rng.integers(5, 40))
            picture = Image.fromarray(rng.integers(0, 256, (side, side + 3, 3), dtype=np.uint8))
            picture = [picture, picture.convert("L"), picture.convert("RGBA"), picture.convert("P")][i % 4]
            (root / name).mkdir(parents=True, exist_ok=True)
            picture.save(root / name / f"{i}.png")
    return root


def test_8_bit_data_is_read_byte_for_byte_as_before(tmp_path):
    root = _eight_bit_folder(tmp_path / "eight")
    federation = _build(root, "data.image_size=9")
    files = sorted(root.rglob("*.png"))
    # the 8-bit path is the one decode_files takes without depth: unchanged
    every = {path: x for path, x in zip(files, images.to_float(images.decode_files(files, 9)), strict=True)}
    rows = [x for client in federation.clients for x in client.x] + list(federation.test_sets["all"][0])
    assert len(rows) == len(files)
    for x in rows:
        assert sum(torch.equal(x, y) for y in every.values()) >= 1
    assert images.decode_files(files, 9, depth=True).dtype == np.uint8
    assert "bit_depth" not in federation.partition and "standardize" not in federation.partition
    assert not any("-bit images" in note or "standardised" in note for note in federation.notes)
    again = _build(root, "data.image_size=9")  # from the cache: the same bytes
    assert all(torch.equal(a.x, b.x) for a, b in zip(federation.clients, again.clients, strict=True))


def test_the_cache_keeps_16_bits_and_never_reads_an_8_bit_cache_as_them(tmp_path, monkeypatch):
    folder = tmp_path / "data"
    folder.mkdir()
    values = [np.arange(16, dtype=np.uint16).reshape(4, 4) * 257 + k for k in range(3)]
    files = []
    for k, pixels in enumerate(values):
        files.append(folder / f"{k}.png")
        Image.fromarray(pixels).save(files[-1])
    cache = folder / ".fedhpro-cache"
    old = images.decode_files(files, 4, cache)  # the 8-bit format, cached first
    assert old.dtype == np.uint8
    deep = images.decode_files(files, 4, cache, depth=True)
    assert deep.dtype == np.uint16 and all(np.array_equal(deep[k, c], values[k]) for k in range(3) for c in range(3))
    assert len(list(cache.glob("*.npy"))) == 2
    calls = []
    real = images.decode_file
    monkeypatch.setattr(images, "decode_file", lambda path, size, depth=False: calls.append(path) or real(
        path, size, depth))
    assert np.array_equal(images.decode_files(files, 4, cache, depth=True), deep) and calls == []
    assert np.array_equal(images.decode_files(files, 4, cache), old) and calls == []


def test_the_bit_depth_is_the_data_sets_not_each_images(tmp_path):
    def deep(largest: int) -> np.ndarray:
        return np.full((1, 3, 2, 2), largest, dtype=np.uint16)

    assert images.detected_depth([np.zeros((1, 3, 2, 2), np.uint8)]) is None  # 8-bit: as always
    assert images.detected_depth([deep(4095)]) == 12 and images.detected_depth([deep(4096)]) == 14
    assert images.detected_depth([deep(200)]) == 8 and images.detected_depth([deep(1023)]) == 10
    assert images.detected_depth([deep(1000), np.full((1, 3, 2, 2), 255, np.uint8)]) == 16  # 255 is 65535
    root = tmp_path / "scans"
    for name, level in (("dark", 1000), ("bright", 60000)):
        for split in ("train", "test"):
            for i in range(6):
                (root / split / name).mkdir(parents=True, exist_ok=True)
                Image.fromarray(np.full((4, 4), level + i, dtype=np.uint16)).save(root / split / name / f"{i}.png")
    federation = _build(root, "data.image_size=4")
    x, y = federation.test_sets["all"]
    dark = x[y == federation.partition["classes"].index("dark")]
    # a dark image of a 16-bit data set stays dark: scaled by 1/65535, not stretched as if it were 12-bit
    torch.testing.assert_close(dark[0, 0, 0, 0], torch.tensor(1000 / 32767.5 - 1), rtol=0, atol=1e-6)
    assert federation.partition["bit_depth"] == 16
    assert any("read as 16-bit (detected; values 1000..60005)" in note for note in federation.notes)


def test_a_bit_depth_too_small_for_the_values_is_refused_in_one_line(tmp_path):
    root = _two_classes(tmp_path / "twelve", 1500, 2500, 300, 4095)
    with pytest.raises(DataError, match="exceed 10 bits.*data.bit_depth=16") as error:
        _build(root, "data.image_size=4", "data.bit_depth=10")
    assert "\n" not in str(error.value)
    eight = _eight_bit_folder(tmp_path / "eight")
    federation = _build(eight, "data.image_size=4", "data.bit_depth=12")
    assert any("data.bit_depth=12 not used: every image is 8-bit" in note for note in federation.notes)


def test_standardize_federated_gives_the_training_images_mean_0_and_std_1_per_channel(tmp_path):
    """data.standardize has one meaning on images and tables: federated is the pooled training statistics
    (per channel here), train its former image-folder name (the same bytes), client refused in one line."""
    root = _eight_bit_folder(tmp_path / "eight")
    federation = _build(root, "data.image_size=6", "data.standardize=federated")
    former = _build(root, "data.image_size=6", "data.standardize=train")
    assert all(torch.equal(a.x, b.x) for a, b in zip(federation.clients, former.clients, strict=True))
    plain, auto = _build(root, "data.image_size=6", "data.standardize=none"), _build(root, "data.image_size=6")
    assert all(torch.equal(a.x, b.x) for a, b in zip(plain.clients, auto.clients, strict=True))
    assert "standardize" not in auto.partition
    with pytest.raises(ConfigError, match="data.standardize=client .* use data.standardize=federated") as error:
        _build(root, "data.image_size=6", "data.standardize=client")
    assert "\n" not in str(error.value)
    x = torch.cat([client.x for client in federation.clients]).double()
    torch.testing.assert_close(x.mean(dim=(0, 2, 3)), torch.zeros(3, dtype=torch.float64), rtol=0, atol=1e-5)
    torch.testing.assert_close(x.std(dim=(0, 2, 3)), torch.ones(3, dtype=torch.float64), rtol=0, atol=1e-4)
    statistics = federation.partition["standardize"]
    assert len(statistics["mean"]) == 3 and all(0 < s < 1 for s in statistics["std"])
    assert any("standardised per channel (data.standardize=federated)" in note for note in federation.notes)


@pytest.mark.slow
def test_predict_scales_new_images_as_the_run_did(tmp_path):
    """fedhpro predict decodes new images as the run decoded its own: the detected bit depth (12-bit values in
    16-bit PNGs), so its accuracy on the test images is the run's (50 % when read as 8-bit data)."""
    root = _two_classes(tmp_path / "twelve", 1500, 2500, 300, 4095)
    summary = _run(tmp_path, root, "run")
    assert summary["accuracy"] >= 90
    text = fedhpro.predict(tmp_path / "run", [root / "test"])
    rows = [line.split(",") for line in text.splitlines()[1:]]
    assert sum(row[1] == Path(row[0]).parent.name for row in rows) >= 0.9 * len(rows)  # 50 % as 8-bit data


@pytest.mark.slow
def test_12_bit_sites_are_learned_once_their_depth_is_said(tmp_path):
    """``dataset=clients``: each site decodes alone, so a depth it detected could differ from its neighbour's:
    a site whose 16-bit images all fit 12 bits is refused in one line naming data.bit_depth; with
    data.bit_depth=12 for every site the 12-bit data learn as their 8-bit version does (50 % when scaled by
    255/65535 into 8 bits)."""
    from fedhpro.errors import FedHProError

    root = _two_classes(tmp_path / "source", 1500, 2500, 300, 4095)
    sites = tmp_path / "sites"
    for k, site in enumerate(("site-a", "site-b")):
        for split in ("train", "test"):
            for name in ("a", "b"):
                target = sites / site / split / name
                target.mkdir(parents=True)
                for path in sorted((root / split / name).iterdir())[k::2]:
                    (target / path.name).write_bytes(path.read_bytes())
    settings = {"dataset": "clients", "partition": None}
    with pytest.raises(FedHProError, match=r"set data.bit_depth=12 for every site") as raised:
        _run(tmp_path, sites, "refused", **settings)
    assert "\n" not in str(raised.value)
    summary = _run(tmp_path, sites, "twelve", **settings, **{"data.bit_depth": 12})
    assert summary["accuracy"] >= 90
    # and predict reads new images of a site at that depth: its accuracy on a site's test images is the run's
    site = sites / "site-a" / "test"
    text = fedhpro.predict(tmp_path / "twelve", [site])
    rows = [line.split(",") for line in text.splitlines()[1:]]
    assert sum(row[1] == Path(row[0]).parent.name for row in rows) >= 0.9 * len(rows)
