"""``Federation.from_datasets(..., test=[tA, tB, None])``: ``None`` is a site without a test set.

Such a site trains but is not tested, as a client folder without ``test/`` in ``dataset=clients``: its own
test split is empty, the federation's notes name it, and the accuracy is that of the global model on the
other sites' test sets pooled, which the test computes by hand from the saved model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedhpro.data.federation import Federation
from fedhpro.errors import DataError

#: one colour per class: a class is told apart by its colour alone
COLOURS = {"cat": (200, 40, 40), "dog": (40, 200, 40), "owl": (40, 40, 200)}


def _folder(root: Path, counts: dict[str, int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    for name, n in counts.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            pixels = np.clip(rng.normal(COLOURS[name], 20, (6, 6, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")


def _sites(tmp_path: Path):
    """Three ImageFolder sites (each numbering its own class folders) and test sets for the first two."""
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import ToTensor

    _folder(tmp_path / "a" / "train", {"cat": 6, "dog": 6}, 1)
    _folder(tmp_path / "b" / "train", {"dog": 6, "owl": 6}, 2)
    _folder(tmp_path / "c" / "train", {"cat": 6, "owl": 6}, 3)
    _folder(tmp_path / "a" / "test", {"cat": 3, "dog": 2}, 4)
    _folder(tmp_path / "b" / "test", {"dog": 2, "owl": 4}, 5)
    train = [ImageFolder(str(tmp_path / s / "train"), transform=ToTensor()) for s in "abc"]
    tests = [ImageFolder(str(tmp_path / s / "test"), transform=ToTensor()) for s in "ab"]
    return train, tests


def test_none_is_a_site_without_a_test_set(tmp_path):
    train, (test_a, test_b) = _sites(tmp_path)
    federation = Federation.from_datasets(train, [test_a, test_b, None], names=["a", "b", "c"])
    assert federation.num_clients == 3 and federation.partition["classes"] == ["cat", "dog", "owl"]
    assert federation.untested_clients == [2]
    assert federation.client_tests is not None
    x, y = federation.client_tests[2]
    assert tuple(x.shape) == (0, 3, 6, 6) and y.numel() == 0
    # the tested sites keep their test sets, labels matched by class name: a's test is 3 cats, 2 dogs; b's
    # own numbering (dog 0, owl 1) becomes the federation's (dog 1, owl 2)
    assert federation.client_tests[0][1].tolist() == [0, 0, 0, 1, 1]
    assert federation.client_tests[1][1].tolist() == [1, 1, 2, 2, 2, 2]
    assert any("not tested" in note and note.endswith(": c") for note in federation.notes), federation.notes


def test_a_domain_without_any_tested_site_is_named(tmp_path):
    train, (test_a, test_b) = _sites(tmp_path)
    federation = Federation.from_datasets(train, [test_a, test_b, None], domains=["clinic", "clinic", "lab"])
    assert federation.untested_clients == [2]
    assert "no client of lab has test data: no accuracy of its own is measured" in federation.notes
    # from tensors alike: None is the same as the empty split a client folder without test/ gives
    pairs = [(torch.rand(4, 2), torch.tensor([0, 1, 0, 1])) for _ in range(3)]
    given = Federation.from_tensors(pairs, [pairs[0], None, pairs[2]], domains=["x", "y", "x"])
    assert given.untested_clients == [1] and tuple(given.client_tests[1][0].shape) == (0, 2)
    assert "no client of y has test data: no accuracy of its own is measured" in given.notes


def test_no_test_set_anywhere_or_in_a_mapping_is_one_line(tmp_path):
    train, (test_a, _) = _sites(tmp_path)
    with pytest.raises(DataError, match="no client has a test set"):
        Federation.from_datasets(train, [None, None, None])
    with pytest.raises(DataError, match="test set 'all' is None"):
        Federation.from_datasets(train, {"all": None})


@pytest.mark.slow
def test_a_run_tests_only_the_sites_with_a_test_set(tmp_path):
    """The run's accuracy is the global model's on a's and b's test images pooled, counted here by hand."""
    import fedhpro

    train, (test_a, test_b) = _sites(tmp_path)
    federation = Federation.from_datasets(train, [test_a, test_b, None], names=["a", "b", "c"])
    result = fedhpro.run(federation=federation, method="fedavg", model="mlp", rounds=2, local_epochs=1,
                         feature_dim=8, batch_size=4, progress=False, threads=1, device="cpu",
                         out=str(tmp_path / "run"))
    model = fedhpro.load_model(result.out).eval()
    tested = federation.client_tests
    assert tested is not None
    x = torch.cat([tested[0][0], tested[1][0]])
    y = torch.cat([tested[0][1], tested[1][1]])
    with torch.no_grad():
        correct = int((model(x).argmax(dim=1) == y).sum())
    assert result.summary["per_domain"]["all"] == pytest.approx(100.0 * correct / 11, abs=1e-6)
    assert any(note.endswith(": c") and "not tested" in note for note in result.summary["notes"])
