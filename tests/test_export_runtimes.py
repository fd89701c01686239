"""Models other runtimes load: ONNX with the run's preprocessing, checked by onnxruntime against PyTorch, and
safetensors weights read by safetensors' own loader.

References: onnxruntime (a second runtime) on the same inputs as ``fedhpro.load_model`` / ``predict``;
``safetensors.torch.load_file`` against ``torch.load`` of model.pt.
"""

from __future__ import annotations

import csv
import io
import shutil

import numpy as np
import onnxruntime
import pytest
import torch
from safetensors.torch import load_file

import fedhpro
from fedhpro.cli import main as cli_main
from fedhpro.trained import ModelFileError, predict
from fedhpro.trained.onnx_export import export_onnx

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5  # absolute, on softmax probabilities


def _session(path) -> onnxruntime.InferenceSession:
    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def image_run(finished_runs, tmp_path_factory):
    return finished_runs.copy("image", tmp_path_factory.mktemp("image"))


def test_onnx_of_an_image_model_takes_uint8_pixels_as_load_model_does(image_run):
    exported = export_onnx(image_run.out)
    assert exported.path == image_run.out / "model.onnx" and exported.input == "uint8 pixels"
    pixels = torch.randint(0, 256, (9, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    session = _session(exported.path)
    theirs = session.run(None, {"input": pixels.numpy()})[0]
    with torch.no_grad():
        mine = fedhpro.load_model(image_run.out)(pixels)
    assert (theirs.argmax(1) == mine.argmax(1).numpy()).all()
    assert np.abs(torch.softmax(torch.from_numpy(theirs), 1).numpy() - torch.softmax(mine, 1).numpy()).max() \
        < TOLERANCE
    assert session.run(None, {"input": pixels[:1].numpy()})[0].shape == (1, 10)  # any batch size


def test_the_cli_exports_and_safetensors_hold_model_pt(image_run, tmp_path, capsys):
    assert cli_main(["export", str(image_run.out), "--out", str(tmp_path / "m.onnx")]) == 0
    assert "uint8 pixels" in capsys.readouterr().out and (tmp_path / "m.onnx").stat().st_size > 1000
    state = torch.load(image_run.out / "model.pt", weights_only=True)
    copy = load_file(image_run.out / "model.safetensors")
    assert list(copy) == sorted(state) or set(copy) == set(state)
    for name, tensor in state.items():
        assert torch.equal(copy[name], tensor), name


@pytest.mark.slow
def test_onnx_of_a_tabular_model_takes_raw_rows_and_matches_predict(tmp_path):
    from sklearn.datasets import load_breast_cancer

    x, y = load_breast_cancer(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    for k, part in enumerate(np.array_split(order, 3)):
        site = tmp_path / "data" / f"site-{k}"
        site.mkdir(parents=True)
        cut = int(len(part) * 0.7)
        np.savez(site / "train.npz", x=x[part[:cut]].astype(np.float32), y=y[part[:cut]])
        np.savez(site / "test.npz", x=x[part[cut:]].astype(np.float32), y=y[part[cut:]])
    run = fedhpro.run(dataset="clients", data_dir=str(tmp_path / "data"), model="mlp", method="fedavg", rounds=3,
                      local_epochs=2, batch_size=16, feature_dim=16, progress=False, threads=1,
                      out=str(tmp_path / "run"))
    for site in (None, "site-1"):
        exported = export_onnx(run.out, tmp_path / f"tab-{site}.onnx", site=site)
        assert exported.input == "raw rows"
        test = tmp_path / "data" / "site-1" / "test.npz"
        rows = np.load(test)["x"]
        theirs = torch.softmax(torch.from_numpy(_session(exported.path).run(None, {"input": rows})[0]), 1).numpy()
        reference = list(csv.DictReader(io.StringIO(predict(run.out, [test], site=site))))
        classes = [key.removeprefix("p_") for key in reference[0] if key.startswith("p_")]
        for row, p in zip(reference, theirs):
            assert row["predicted"] == classes[int(p.argmax())]
            assert max(abs(float(row[f"p_{c}"]) - float(p[i])) for i, c in enumerate(classes)) < TOLERANCE


def test_export_refuses_weights_that_are_not_finite_as_predict_does(image_run, tmp_path, capsys):
    """A run folder whose model.pt holds a NaN and an infinity (a damaged file, a diverged run): export writes no
    ONNX (before: one that answers NaN), one line naming the tensor; predict refuses the same folder."""
    folder = tmp_path / "run"
    shutil.copytree(image_run.out, folder, ignore=shutil.ignore_patterns("checkpoints", "*.onnx"))
    state = torch.load(folder / "model.pt", weights_only=True)
    name = next(key for key, value in state.items() if value.is_floating_point() and value.numel() > 1)
    state[name] = state[name].clone()
    state[name].view(-1)[:2] = torch.tensor([float("nan"), float("inf")])
    torch.save(state, folder / "model.pt")
    (folder / "model.safetensors").unlink(missing_ok=True)
    capsys.readouterr()
    assert cli_main(["export", str(folder), "--out", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"2 in {name}" in err and "NaN or infinite" in err and not (tmp_path / "m.onnx").exists()
    np.savez(tmp_path / "one.npz", x=np.zeros((1, 3, 32, 32), dtype=np.float32), y=np.zeros(1, dtype=np.int64))
    with pytest.raises(ModelFileError, match="not finite numbers"):
        predict(folder, [tmp_path / "one.npz"])
