"""The trained model in the user's hands (issue 26, stumble 10): model.pt / models/client_<k>.pt with model.json,
``RunResult.model``, ``fedhpro.load_model`` and ``fedhpro predict``.

The references are independent of the code under test: the run's own evaluation (summary.json's accuracy, which
the engine measured on its own modules) for the rebuilt models, and a forward pass of the model on tensors this
test builds from the same pixels for the predictions read from PNG files."""

from __future__ import annotations

import csv
import io
import json
import pickle
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import fedhpro
from fedhpro.cli import main as cli_main
from fedhpro.data import get_dataset
from fedhpro.data.federation import normalize_images
from fedhpro.errors import ConfigError, DataError
from fedhpro.models import build_model
from fedhpro.trained import ModelFileError
from tests.conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION


def tiny(data_dir: Path, out: Path, **extra) -> dict:
    return {"rounds": 1, "clients": 3, "local_epochs": 1, "feature_dim": 16, "progress": False, "threads": 1,
            "device": "cpu", "seed": 1, "data_dir": str(data_dir), "out": str(out), "data.fraction": 0.02,
            "data.syn_size": DIGITS_SYN_SIZE, "data.test_fraction": DIGITS_TEST_FRACTION, **extra}


@pytest.fixture(scope="module")
def global_run(digits_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "run"
    return fedhpro.run(**tiny(digits_data_dir, out, method="fedavg"))


def federation_of(result):
    config = result.config
    return get_dataset(config.run.dataset).build(config.data, config.run.clients, config.run.seed,
                                                 data_dir=config.run.data_dir, partition=config.partition)


@torch.no_grad()
def accuracy(module, x, y) -> float:
    return 100.0 * float((module(x).argmax(1) == y).double().mean())


@pytest.mark.slow
def test_model_pt_is_a_plain_state_dict_and_load_model_gives_the_same_logits(global_run):
    folder = global_run.out
    state = torch.load(folder / "model.pt", weights_only=True)
    assert isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())
    info = json.loads((folder / "model.json").read_text())
    assert info["model"] == "cnn" and info["num_classes"] == 10 and info["input_shape"] == [3, 32, 32]
    assert info["global"] == "model.pt" and info["personal"] == {} and info["classes"] == [str(c) for c in range(10)]
    rebuilt = fedhpro.load_model(folder)
    assert not rebuilt.training and not global_run.model.training
    x = federation_of(global_run).test_sets["mnist"][0][:16]
    assert torch.equal(rebuilt(x), global_run.model(x))
    assert set(rebuilt.state_dict()) == set(state)


@pytest.mark.slow
def test_the_rebuilt_model_scores_what_the_run_reported(global_run):
    """Independent reference: the engine's own evaluation, in summary.json, per test set."""
    model = fedhpro.load_model(global_run.out)
    federation = federation_of(global_run)
    for name, (x, y) in federation.test_sets.items():
        assert accuracy(model, x, y) == pytest.approx(global_run.summary["per_domain"][name], abs=1e-9)


@pytest.mark.slow
def test_personal_models_are_written_per_client_and_score_what_the_run_reported(digits_data_dir, tmp_path):
    result = fedhpro.run(**tiny(digits_data_dir, tmp_path / "run", method="fedproto",
                                **{"fedproto.protocol": "proto-only", "fedproto.inference": "nearest-prototype"}))
    assert not (result.out / "model.pt").exists()
    assert sorted(p.name for p in (result.out / "models").iterdir()) == [
        f"client_{k}.{kind}" for k in range(3) for kind in ("pt", "safetensors")]  # safetensors: fedhpro[export]
    with pytest.raises(ConfigError, match="no global model.*client=0..2") as error:
        fedhpro.load_model(result.out)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="no global model"):
        result.model  # noqa: B018
    federation = federation_of(result)
    correct: dict[str, int] = {}
    total: dict[str, int] = {}
    for k in range(3):
        model = fedhpro.load_model(result.out, client=k)
        x, y = federation.test_sets[federation.client_domains[k]]
        assert torch.equal(model(x[:8]), result.client_model(k)(x[:8]))
        with torch.no_grad():
            hits = int((model(x).argmax(1) == y).sum())
        domain = federation.client_domains[k]
        correct[domain] = correct.get(domain, 0) + hits
        total[domain] = total.get(domain, 0) + int(y.shape[0])
    for domain in correct:  # the run pools each client's test counts per domain
        assert 100.0 * correct[domain] / total[domain] == pytest.approx(result.summary["per_domain"][domain], abs=1e-9)
    with pytest.raises(ConfigError, match="no personal model of client 7"):
        fedhpro.load_model(result.out, client=7)


@pytest.mark.slow
def test_damaged_or_foreign_model_files_are_one_line_and_never_unpickled(global_run, tmp_path):
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(global_run.out, folder)
    state = torch.load(folder / "model.pt", weights_only=True)
    key = next(k for k in state if k.endswith("weight"))
    torch.save({**state, key: torch.zeros(2, 2)}, folder / "model.pt")
    with pytest.raises(ModelFileError, match=f"does not fit.*shape of {key}") as error:
        fedhpro.load_model(folder)
    assert "\n" not in str(error.value)
    torch.save({k: v for k, v in state.items() if k != key}, folder / "model.pt")
    with pytest.raises(ModelFileError, match=f"missing {key}"):
        fedhpro.load_model(folder)
    marker = tmp_path / "unpickled"
    (folder / "model.pt").write_bytes(pickle.dumps(Touch(str(marker)), protocol=2))
    with pytest.raises(ModelFileError, match="not a state dict fedhpro can read"):
        fedhpro.load_model(folder)
    assert not marker.exists()  # weights_only refused the object before it ran
    (folder / "model.json").unlink()
    with pytest.raises(ModelFileError, match="has no model.json"):
        fedhpro.load_model(folder)
    with pytest.raises(ModelFileError, match="no such folder"):
        fedhpro.load_model(tmp_path / "nowhere")


class Touch:
    """Unpickling this creates a file: proof that a loader unpickled it."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def tiny_mlp(num_classes, input_shape, feature_dim):
    return build_model("mlp", num_classes, input_shape, feature_dim)


@pytest.mark.slow
def test_a_model_from_python_needs_the_callable_again(digits_data_dir, tmp_path):
    result = fedhpro.run(**tiny(digits_data_dir, tmp_path / "run", method="fedavg"), model=tiny_mlp)
    with pytest.raises(ConfigError, match="came from Python.*model=tiny_mlp") as error:
        fedhpro.load_model(result.out)
    assert "\n" not in str(error.value)
    x = torch.randn(4, 3, 32, 32)
    assert torch.equal(fedhpro.load_model(result.out, model=tiny_mlp)(x), result.model(x))


def digit_pixels(count: int) -> np.ndarray:
    """``uint8`` count x 3 x 32 x 32: scikit-learn's real 8x8 digits (0..16) scaled to 0..255, upsampled
    bilinearly by Pillow and made RGB (the digits-offline format)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    images = load_digits().images[:count]
    out = []
    for image in images:
        grey = Image.fromarray((image * 255.0 / 16.0).round().astype(np.uint8)).resize((32, 32),
                                                                                     Image.Resampling.BILINEAR)
        out.append(np.asarray(grey.convert("RGB")).transpose(2, 0, 1))
    return np.stack(out)


def read_csv(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


@pytest.mark.slow
def test_predict_on_a_folder_of_pngs_matches_the_model_on_the_same_pixels(global_run, tmp_path, capsys):
    from PIL import Image

    pixels = digit_pixels(12)
    images = tmp_path / "digits"
    images.mkdir()
    for i, array in enumerate(pixels):
        Image.fromarray(array.transpose(1, 2, 0)).save(images / f"digit_{i:02d}.png")
    with torch.no_grad():
        expected = torch.softmax(global_run.model(normalize_images(torch.from_numpy(pixels))).double(), dim=1)
    out = tmp_path / "predictions.csv"
    assert cli_main(["predict", str(global_run.out), str(images), "--out", str(out)]) == 0
    rows = read_csv(out.read_text())
    assert [Path(row["path"]).name for row in rows] == [f"digit_{i:02d}.png" for i in range(12)]
    for row, probabilities in zip(rows, expected):
        got = [float(row[f"p_{c}"]) for c in range(10)]
        assert got == pytest.approx(probabilities.tolist(), rel=1e-5, abs=1e-7)
        assert row["predicted"] == str(int(probabilities.argmax()))
    # a tensor file of the same inputs gives the same rows; stdout without --out
    tensors = tmp_path / "inputs.pt"
    torch.save(normalize_images(torch.from_numpy(pixels)), tensors)
    capsys.readouterr()
    assert cli_main(["predict", str(global_run.out), str(tensors)]) == 0
    from_tensors = read_csv(capsys.readouterr().out)
    assert [row["predicted"] for row in from_tensors] == [row["predicted"] for row in rows]
    assert from_tensors[3]["path"] == f"{tensors}[3]"


@pytest.mark.slow
def test_predict_refuses_wrong_inputs_in_one_line(global_run, tmp_path, capsys):
    from PIL import Image

    small = tmp_path / "small.png"
    Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(small)
    wrong = tmp_path / "wrong.pt"
    torch.save(torch.zeros(2, 1, 32, 32), wrong)
    cases = [([str(tmp_path / "missing.png")], "no such file or folder"),
             ([str(small)], "8x8 pixels; this run's model takes 32x32 images"),
             ([str(wrong)], r"shape \(2, 1, 32, 32\); this run's model takes N x 3 x 32 x 32"),
             ([str(tmp_path / "empty")], "holds no image files")]
    (tmp_path / "empty").mkdir()
    for paths, message in cases:
        capsys.readouterr()
        assert cli_main(["predict", str(global_run.out), *paths]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("fedhpro: error:"), err
        assert re.search(message, err), err
    with pytest.raises(DataError):
        fedhpro.predict(global_run.out, [str(small)])


def test_the_flower_writers_give_what_load_model_rebuilds(digits_data_dir, tmp_path):
    """The functions the Flower ServerApp and a SuperNode call (fedhpro.trained.server_models with write_models /
    write_node_model), on the parts the Flower apps build, against those parts' own modules."""
    pytest.importorskip("flwr")
    from fedhpro.config import load_config
    from fedhpro.flower.engine import build_engine, build_server_side, node_from_engine
    from fedhpro.reports import write_yaml
    from fedhpro.trained import server_models, write_models, write_node_model

    settings = {k: v for k, v in tiny(digits_data_dir, tmp_path / "unused").items() if k != "out"}
    config = load_config(None, settings)
    side = build_server_side(config)
    federation = side.federation
    write_yaml(tmp_path / "server" / "config.yaml", config.to_dict())  # what the ServerApp's run folder holds
    write_models(tmp_path / "server", server_models(side, federation.partition))
    network = side.models.global_model
    network.load_state_dict(side.server.global_weights())
    x = federation.test_sets["mnist"][0][:8]
    assert torch.equal(fedhpro.load_model(tmp_path / "server")(x), network.eval()(x))

    personal = load_config(None, {**settings, "method": "fedproto", "fedproto.protocol": "proto-only"})
    side = build_server_side(personal)
    write_yaml(tmp_path / "personal" / "config.yaml", personal.to_dict())
    write_models(tmp_path / "personal", server_models(side, side.federation.partition))
    assert not (tmp_path / "personal" / "model.pt").exists()
    with pytest.raises(ModelFileError, match="written on its node's own disk"):
        fedhpro.load_model(tmp_path / "personal", client=1)
    node = node_from_engine(build_engine(personal), 1)  # what a node in partition mode builds
    model = node.model(None)
    written = write_node_model(tmp_path / "node", personal, node, model, side.federation.partition)
    assert written == tmp_path / "node" / "models" / "client_1.pt"
    assert torch.equal(fedhpro.load_model(tmp_path / "node", client=1)(x), model.eval()(x))


@pytest.mark.slow
def test_predict_resizes_as_an_image_folder_run_did_and_names_its_classes(tmp_path):
    """dataset=imagefolder resizes every image to data.image_size: predict does too. Reference: Pillow's
    RGB conversion and bilinear resize, and the [-1, 1] scaling, written out here."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for name, digit in (("one", 1), ("seven", 7)):
        (tmp_path / "images" / name).mkdir(parents=True)
        for i, image in enumerate(digits.images[digits.target == digit][:20]):
            size = 12 if i % 2 else 20
            pixels = Image.fromarray((image * 255 / 16).astype(np.uint8)).resize((size, size))
            pixels.save(tmp_path / "images" / name / f"{i}.png")
    result = fedhpro.run(dataset="imagefolder", data_dir=str(tmp_path / "images"), out=str(tmp_path / "run"),
                         rounds=1, clients=2, local_epochs=1, feature_dim=16, progress=False, threads=1,
                         device="cpu", **{"data.image_size": 16})
    new = tmp_path / "new.png"
    grey = Image.fromarray((digits.images[digits.target == 7][30] * 255 / 16).astype(np.uint8)).resize((24, 24))
    grey.save(new)
    expected_pixels = np.asarray(grey.convert("RGB").resize((16, 16), Image.Resampling.BILINEAR), dtype=np.float32)
    x = torch.from_numpy(expected_pixels.transpose(2, 0, 1).copy()).unsqueeze(0) / 127.5 - 1.0
    with torch.no_grad():
        expected = torch.softmax(result.model(x).double(), dim=1)[0]
    rows = read_csv(fedhpro.predict(result.out, [new]))
    assert list(rows[0]) == ["path", "predicted", "p_one", "p_seven"]
    assert [float(rows[0]["p_one"]), float(rows[0]["p_seven"])] == pytest.approx(expected.tolist(), rel=1e-5)
    assert rows[0]["predicted"] == ["one", "seven"][int(expected.argmax())]


class ScaledLogits(torch.nn.Module):
    """A plug-in method's own inference rule: the model's logits doubled (argmax unchanged)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return 2.0 * self.model(x)


@pytest.mark.slow
def test_a_plug_in_inference_rule_is_not_saved_and_says_so(digits_data_dir, tmp_path, capsys):
    import dataclasses

    from fedhpro.methods import register
    from fedhpro.methods.base import Server
    from fedhpro.methods.fedavg import METHOD

    class ScalingServer(Server):
        def inference_model(self, model):
            return ScaledLogits(model)

    register("fedavg-scaled-logits", dataclasses.replace(METHOD, server=ScalingServer), replace=True)
    result = fedhpro.run(**tiny(digits_data_dir, tmp_path / "run", method="fedavg-scaled-logits"))
    info = json.loads((result.out / "model.json").read_text())
    assert info["inference"] == "head" and "ScaledLogits" in info["note"]
    assert "ScaledLogits" in capsys.readouterr().err  # the user is warned; the run finished
    x = torch.randn(3, 3, 32, 32)
    model = fedhpro.load_model(result.out)
    assert not isinstance(model, ScaledLogits) and torch.equal(model(x), result.model(x))


# ---------------------------------------------------------------------------- a run folder is untrusted input


def hostile_copy(global_run, tmp_path, **changes) -> Path:
    """A copy of the run's folder whose model.json has ``changes`` (``input__size`` sets ``input.size``)."""
    import shutil

    folder = tmp_path / "hostile"
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(global_run.out, folder)
    info = json.loads((folder / "model.json").read_text())
    for key, value in changes.items():
        if key.startswith("input__"):
            info["input"][key.removeprefix("input__")] = value
        else:
            info[key] = value
    (folder / "model.json").write_text(json.dumps(info))
    return folder


def predict_error(folder: Path, capsys, *inputs: str) -> str:
    capsys.readouterr()
    code = cli_main(["predict", str(folder), *inputs])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("fedhpro: error:"), err
    return err


@pytest.mark.slow
@pytest.mark.parametrize("changes, message", [
    ({"num_classes": "abc"}, "num_classes is 'abc', not a whole number"),
    ({"num_classes": 10**12}, "num_classes is 1000000000000, not a whole number from 1 to 1,000,000"),
    ({"num_classes": True}, "num_classes is True"),
    ({"classes": ["a", "b"]}, "classes is .*not a list of 10 class names"),
    ({"input_shape": [3, -32, 32]}, "input_shape is"),
    ({"input_shape": "3x32x32"}, "input_shape is"),
    ({"input_shape": [3, 65536, 65536]}, "input_shape is .*16,777,216 values"),
    ({"input__size": "32"}, "input.size is '32'"),
    ({"input__std": [0.5, 0.0, 0.5]}, r"input.std is .*three finite numbers > 0"),
    ({"personal": []}, "personal is"),
    ({"inference": 3}, "inference is 3, not a name"),
])
def test_a_model_json_of_wrong_types_or_ranges_is_one_line(global_run, tmp_path, capsys, changes, message):
    folder = hostile_copy(global_run, tmp_path, **changes)
    err = predict_error(folder, capsys, str(tmp_path))
    assert re.search(message, err) and "model.json" in err, err
    with pytest.raises(ModelFileError, match=message):
        fedhpro.load_model(folder)


@pytest.mark.slow
def test_model_json_cannot_name_files_outside_its_folder(global_run, tmp_path, capsys):
    """The weights read are the folder's own: an absolute path, a ``..`` path or a symbolic link that leads
    out of the folder is refused, even when the file it names is a valid model of the right shapes."""
    import shutil

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(global_run.out / "model.pt", outside / "model.pt")
    shutil.copy(global_run.out / "config.yaml", outside / "config.yaml")
    cases = [({"global": str(outside / "model.pt")}, "global is .*points outside the run folder"),
             ({"global": "../elsewhere/model.pt"}, "global is .*points outside the run folder"),
             ({"config": str(outside / "config.yaml")}, "config is .*points outside the run folder"),
             ({"config": "../elsewhere/config.yaml"}, "config is .*points outside the run folder"),
             ({"global": "link.pt"}, "global is 'link.pt', which leads outside the run folder")]
    for changes, message in cases:
        folder = hostile_copy(global_run, tmp_path, **changes)
        (folder / "link.pt").symlink_to(outside / "model.pt")
        err = predict_error(folder, capsys, str(tmp_path / "elsewhere"))
        assert re.search(message, err), err
        with pytest.raises(ModelFileError, match=message):
            fedhpro.load_model(folder)
    folder = hostile_copy(global_run, tmp_path, **{"global": None, "personal": {"0": {"file": "../../x.pt",
                                                                                    "architecture": "cnn"}}})
    with pytest.raises(ModelFileError, match=r"personal.0.file is '../../x.pt', which points outside"):
        fedhpro.load_model(folder, client=0)
    # a link that stays inside the folder is a file of the folder
    folder = hostile_copy(global_run, tmp_path, **{"global": "inside.pt"})
    (folder / "inside.pt").symlink_to(folder / "model.pt")
    x = torch.zeros(2, 3, 32, 32)
    assert torch.equal(fedhpro.load_model(folder)(x), global_run.model(x))


@pytest.mark.slow
def test_a_model_json_past_the_bounds_is_one_line(global_run, tmp_path, capsys):
    folder = hostile_copy(global_run, tmp_path)
    (folder / "model.json").write_text('{"format": "fedhpro-model/1", "x": ' + "[" * 50_000 + "]" * 50_000 + "}")
    assert "levels deep" in predict_error(folder, capsys, str(tmp_path))
    (folder / "model.json").write_text('{"format": "fedhpro-model/1", "num_classes": 1' + "0" * 5000 + "}")
    assert "not valid JSON" in predict_error(folder, capsys, str(tmp_path))


@pytest.mark.slow
def test_summary_json_of_another_shape_is_one_line_in_class_accuracy(global_run, tmp_path):
    from fedhpro.trained import class_accuracy

    folder = hostile_copy(global_run, tmp_path)
    (folder / "summary.json").write_text('{"accuracy": "high"}')
    with pytest.raises(DataError, match="summary.json: accuracy is 'high', not a number"):
        class_accuracy(folder)


def huge_png(path: Path, side: int) -> Path:
    """A valid 1-bit PNG of ``side`` x ``side`` black pixels, written row by row (a few KB for 144 MP)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    compressor = zlib.compressobj(9)
    row = b"\x00" + b"\x00" * ((side + 7) // 8)  # filter byte, then the packed bits
    data = b"".join(compressor.compress(row) for _ in range(side)) + compressor.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b""))
    return path


@pytest.mark.slow
def test_predict_refuses_an_image_of_too_many_pixels_before_decoding_it(global_run, tmp_path, capsys, monkeypatch):
    """A model that resizes its inputs (an image-folder run) takes images of any size: a 144-megapixel PNG
    of a few KB is refused from its header, and no pixel of it is decoded (decoding is made to fail)."""
    from PIL import Image, ImageFile

    big = huge_png(tmp_path / "big.png", 12_000)
    assert big.stat().st_size < 200_000
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # Pillow's warning: opening reads the header
        with Image.open(big) as image:
            assert image.size == (12_000, 12_000)
    folder = hostile_copy(global_run, tmp_path, input__resize=True)
    decoded = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self) or pytest.fail("decoded"))
    err = predict_error(folder, capsys, str(big))
    assert "big.png is 12000x12000 = 144,000,000 pixels, over the limit of 89,478,485" in err, err
    assert "FEDHPRO_MAX_IMAGE_PIXELS" in err and not decoded
