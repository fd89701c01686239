"""``fedhpro predict`` and ``fedhpro report`` on hostile inputs and run folders: each refused in one line.

* an input ``.npz`` that is a zip bomb (1.9 MB declaring 1.92 GB) and a ``model.pt`` whose zip member
  declares 1.92 GB of deflated zeros: refused from what they declare, at once and without allocating;
* a ``standardize.json`` of finite but absurd statistics (every mean 1e308, every std 1e-308): refused when
  read, where it used to print rows of ``nan``; a model whose outputs are not finite: refused, nothing printed;
* a run folder's ``model.json`` or ``summary.json`` that is a symbolic link leading out of the folder.

The reference for an honest folder is computed here by hand: the model's softmax of the rows scaled with
numpy by the training rows' mean and std, printed as predict documents (``%.6g``).
"""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_array_bounds import at_once, torch_bomb, write_bomb_npz

import fedhpro
from fedhpro.arrays import MAX_ARRAY_BYTES_VARIABLE
from fedhpro.cli import main
from fedhpro.trained import ModelFileError, predict

pytestmark = pytest.mark.slow

TINY = {"rounds": 1, "local_epochs": 1, "feature_dim": 8, "progress": False, "threads": 1, "device": "cpu",
        "seed": 1, "method": "fedavg", "model": "mlp", "batch_size": 4}
FEATURES = 5


@pytest.fixture(scope="module")
def tabular(tmp_path_factory):
    """A finished run on two sites of 5 float features of different scales (data.standardize=client)."""
    base = tmp_path_factory.mktemp("tabular")
    rng = np.random.default_rng(3)
    for k, name in enumerate(("north", "south")):
        site = base / "data" / name
        site.mkdir(parents=True)
        x = (rng.normal(size=(24, FEATURES)) * [1, 10, 100, 0.1, 5] + k).astype(np.float32)
        np.savez(site / "train.npz", x=x, y=np.arange(24) % 3)
        np.savez(site / "test.npz", x=x[:6], y=np.arange(6) % 3)
    result = fedhpro.run(**TINY, dataset="clients", data_dir=str(base / "data"), out=str(base / "run"),
                         **{"data.standardize": "client"})
    return base / "data", result


def copy_run(result, tmp_path: Path) -> Path:
    folder = tmp_path / "copy"
    shutil.copytree(result.out, folder, ignore=shutil.ignore_patterns("checkpoints"))
    return folder


def cli_error(capsys, *args: str) -> str:
    capsys.readouterr()
    code = main(["predict", *args])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "", captured.out
    err = captured.err
    assert err.count("\n") == 1 and err.startswith("fedhpro: error:") and "Traceback" not in err, err
    return err


def test_an_honest_folder_predicts_what_the_model_gives_by_hand(tabular, capsys):
    """The CSV, byte for byte: softmax of the model on rows scaled by the pooled training mean and std
    (numpy, float64, as float32), each probability printed %.6g; the CLI prints the same text."""
    data, result = tabular
    train = np.concatenate([np.load(data / name / "train.npz")["x"] for name in ("north", "south")])
    mean, std = train.astype(np.float64).mean(0), train.astype(np.float64).std(0)
    x = np.load(data / "south" / "test.npz")["x"]
    scaled = torch.from_numpy(((x.astype(np.float64) - mean) / std).astype(np.float32))
    with torch.no_grad():
        probabilities = torch.softmax(fedhpro.load_model(result.out, preprocess=False)(scaled).double(), dim=1)
    classes = json.loads((result.out / "model.json").read_text())["classes"]
    lines = ["path,predicted," + ",".join(f"p_{name}" for name in classes)]
    for i, row in enumerate(probabilities.tolist()):
        lines.append(",".join([f"{data / 'south' / 'test.npz'}[{i}]", classes[int(np.argmax(row))]]
                              + [f"{p:.6g}" for p in row]))
    expected = "\n".join(lines) + "\n"
    assert predict(result.out, [data / "south" / "test.npz"]) == expected
    assert main(["predict", str(result.out), str(data / "south" / "test.npz")]) == 0
    assert capsys.readouterr().out == expected


def test_predict_refuses_a_zip_bomb_input_at_once(tabular, tmp_path, capsys):
    _, result = tabular
    bomb = write_bomb_npz(tmp_path / "bomb.npz", with_y=False)
    with at_once():
        err = cli_error(capsys, str(result.out), str(bomb))
    assert f"{bomb} declares x.npy: 60000000 x 8 float32, 1,920,000,000 bytes uncompressed, over fedhpro's limit" in err
    assert f"{MAX_ARRAY_BYTES_VARIABLE}=BYTES" in err


def test_predict_refuses_a_model_pt_whose_member_declares_gigabytes(tabular, tmp_path, capsys):
    data, result = tabular
    folder = copy_run(result, tmp_path)
    torch_bomb(folder / "model.pt", (folder / "model.pt").read_bytes())
    with at_once():
        err = cli_error(capsys, str(folder), str(data / "north" / "test.npz"))
    assert "model.pt: its member" in err and "is compressed" in err and "declaring 1,920,000,000" in err
    with pytest.raises(ModelFileError, match="not written by torch.save"):
        fedhpro.load_model(folder)


@pytest.mark.parametrize("part, value", [("mean", 1e308), ("std", 1e-308), ("std", 1e308), ("mean", -3.5e38)])
def test_absurd_statistics_are_refused_when_read(tabular, tmp_path, capsys, part, value):
    """Finite numbers no float32 features give as their mean or std: every site's and the pooled ones."""
    data, result = tabular
    folder = copy_run(result, tmp_path)
    statistics = json.loads((folder / "standardize.json").read_text())
    for entry in [*statistics["sites"].values(), statistics["pooled"]]:
        entry[part] = [value] * FEATURES
    (folder / "standardize.json").write_text(json.dumps(statistics))
    err = cli_error(capsys, str(folder), str(data / "north" / "test.npz"))
    assert f"standardize.json: sites.north.{part} is [{value!r}, " in err
    assert "what float32 features give as their" in err
    with pytest.raises(ModelFileError, match=f"{part} is"):
        predict(folder, [data / "north" / "test.npz"], site="south")


def test_statistics_that_scale_an_input_to_infinity_are_refused(tabular, tmp_path, capsys):
    """Plausible numbers each (a std of 1e-40 is float32's), yet rows of ordinary size scaled by them overflow
    float32 (1 / 1e-40 > 3.4e38): refused rather than given to the model."""
    data, result = tabular
    folder = copy_run(result, tmp_path)
    statistics = json.loads((folder / "standardize.json").read_text())
    statistics["pooled"]["std"] = [1e-40] * FEATURES
    (folder / "standardize.json").write_text(json.dumps(statistics))
    err = cli_error(capsys, str(folder), str(data / "north" / "test.npz"))
    assert re.search(r"standardize.json: its pooled mean and std scale the input at \[\d+, \d+\] beyond float32's "
                     "range", err), err


def test_a_model_giving_nan_is_refused_and_nothing_is_written(tabular, tmp_path, capsys):
    """Whatever the cause (here weights of NaN, as a diverged run leaves them), no CSV of NaN: one line."""
    data, result = tabular
    folder = copy_run(result, tmp_path)
    state = torch.load(folder / "model.pt", weights_only=True)
    state = {key: torch.full_like(value, float("nan")) if value.is_floating_point() else value
             for key, value in state.items()}
    torch.save(state, folder / "model.pt")
    out = tmp_path / "predictions.csv"
    err = cli_error(capsys, str(folder), str(data / "north" / "test.npz"), "--out", str(out))
    assert f"the probabilities of {data / 'north' / 'test.npz'}[0] are not finite numbers" in err
    assert "model's weights give NaN" in err and not out.exists()


def test_a_model_json_symlinked_out_of_the_folder_is_refused(tabular, tmp_path, capsys):
    data, result = tabular
    folder = copy_run(result, tmp_path)
    outside = tmp_path / "elsewhere.json"
    shutil.move(folder / "model.json", outside)
    (folder / "model.json").symlink_to(outside)
    err = cli_error(capsys, str(folder), str(data / "north" / "test.npz"))
    assert f"{folder / 'model.json'} is a symbolic link that leads outside the run folder (to {outside})" in err
    # a link that stays in the folder is the folder's file
    (folder / "model.json").unlink()
    shutil.move(outside, folder / "kept.json")
    (folder / "model.json").symlink_to(folder / "kept.json")
    assert predict(folder, [data / "north" / "test.npz"]) == predict(result.out, [data / "north" / "test.npz"])


def test_summary_json_symlinked_out_of_the_folder_is_refused_by_report_and_class_accuracy(tabular, tmp_path,
                                                                                         capsys):
    from fedhpro.trained import class_accuracy

    _, result = tabular
    folder = copy_run(result, tmp_path)
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"accuracy": 12.5, "secret": "not the run's"}))
    (folder / "summary.json").unlink()
    (folder / "summary.json").symlink_to(secret)
    code = main(["report", str(folder), f"out={tmp_path / 'report'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{folder / 'summary.json'} is a symbolic link that leads outside the run folder (to {secret})" in err
    assert not (tmp_path / "report" / "table.md").exists()
    with pytest.raises(ModelFileError, match="summary.json is a symbolic link that leads outside"):
        class_accuracy(folder)
    (folder / "summary.json").unlink()
    (folder / "metrics.jsonl").rename(tmp_path / "metrics.jsonl")
    (folder / "metrics.jsonl").symlink_to(tmp_path / "metrics.jsonl")
    assert main(["report", str(folder), f"out={tmp_path / 'report'}"]) == 2
    assert "metrics.jsonl is a symbolic link that leads outside" in capsys.readouterr().err


def test_rows_in_the_csv_are_parsed_back(tabular):
    """The honest CSV is what csv reads: one row per input, probabilities summing to 1."""
    data, result = tabular
    rows = list(csv.DictReader(io.StringIO(predict(result.out, [data / "north" / "test.npz"]))))
    assert len(rows) == 6
    for row in rows:
        assert abs(sum(float(v) for k, v in row.items() if k.startswith("p_")) - 1) < 1e-5
