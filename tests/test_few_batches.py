"""A client with fewer than three batches an epoch is named in the run's start-up notes, with a batch size
that gives it more (a small tabular data set over three sites, at the default batch_size=64, takes one SGD
step an epoch per site and learns next to nothing)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedhpro import cli
from fedhpro.data.federation import Federation, batches_per_epoch, few_batches_note


@pytest.mark.parametrize(("samples", "batch_size", "steps"), [
    (47, 64, 1),    # one batch of 47
    (47, 15, 4),    # 15 + 15 + 15 + 2
    (48, 16, 3),    # 16 + 16 + 16
    (129, 64, 2),   # 64 + 64, the last single sample skipped by the local loop
    (130, 64, 3),   # 64 + 64 + 2
    (10, 1, 0),     # every batch a single sample: all skipped
    (1, 64, 1),     # a client of one sample trains on it
])
def test_batches_per_epoch_counted_by_hand(samples, batch_size, steps):
    assert batches_per_epoch(samples, batch_size) == steps


def _federation(sizes: list[int]) -> Federation:
    generator = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(n, 5, generator=generator), torch.arange(n) % 3) for n in sizes]
    return Federation.from_tensors(pairs, pairs, names=[f"site-{k}" for k in range(len(sizes))])


def test_the_note_names_the_smallest_client_and_a_batch_size():
    federation = _federation([60, 47, 200])
    assert few_batches_note(federation, 64) == (
        "the smallest client, site-1, has 47 training samples: 1 batch an epoch at batch_size=64, too few SGD "
        "steps a round to learn much; batch_size=15 gives it 4")
    assert few_batches_note(federation, 16) is None  # 16 + 16 + 15: three batches
    assert few_batches_note(federation, 24) == (
        "the smallest client, site-1, has 47 training samples: 2 batches an epoch at batch_size=24, too few SGD "
        "steps a round to learn much; batch_size=15 gives it 4")
    assert few_batches_note(_federation([5, 40]), 64).endswith(
        "no batch size gives it 3 batches of 2 or more samples: give it more data")


def _sites(root: Path, sizes: list[int]) -> Path:
    """Client folders of 13 float features and 3 classes (a wine-like table), ``sizes`` training rows each."""
    rng = np.random.default_rng(5)
    for k, n in enumerate(sizes):
        folder = root / f"site-{k}"
        folder.mkdir(parents=True)
        for split, rows in (("train", n), ("test", 12)):
            np.savez(folder / f"{split}.npz", x=rng.normal(size=(rows, 13)).astype(np.float32),
                     y=np.arange(rows) % 3)
    return root


@pytest.mark.slow
def test_a_run_says_so_at_start_and_in_its_notes(tmp_path, capsys):
    root = _sites(tmp_path / "wine", [48, 47, 47])
    args = ["run", "dataset=clients", f"data_dir={root}", "model=mlp", "rounds=1", "local_epochs=1",
            "feature_dim=8", "progress=false", "threads=1", "device=cpu"]
    assert cli.main([*args, f"out={tmp_path / 'run'}"]) == 0
    expected = ("the smallest client, site-1, has 47 training samples: 1 batch an epoch at batch_size=64, too "
                "few SGD steps a round to learn much; batch_size=15 gives it 4")
    printed = capsys.readouterr()
    assert f"note: {expected}" in printed.out.splitlines()  # with the data's notes, before training
    assert "batch an epoch" not in printed.err
    assert expected in json.loads((tmp_path / "run" / "summary.json").read_text())["notes"]
    # at the batch size it suggests, no such note
    assert cli.main([*args, "batch_size=15", f"out={tmp_path / 'fine'}"]) == 0
    notes = json.loads((tmp_path / "fine" / "summary.json").read_text())["notes"]
    assert not [note for note in notes if "batches an epoch" in note or "batch an epoch" in note]


def test_the_note_from_sizes_alone_names_the_site_as_a_flower_server_knows_it():
    """A Flower server knows its own-data sites by their declared sizes and names only: the same note."""
    assert few_batches_note([54, 40, 66], 64, ["wine-a", "wine-b", "wine-c"]) == (
        "the smallest client, wine-b, has 40 training samples: 1 batch an epoch at batch_size=64, too few SGD "
        "steps a round to learn much; batch_size=13 gives it 3")  # 13 + 13 + 13 (a lone last sample is skipped)
    assert few_batches_note([200, 300], 64) is None
