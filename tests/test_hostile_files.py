"""Hostile and stale files: each test reproduces a way a data folder once ran code, exhausted memory, served
stale pixels or ended in a traceback, and checks the one line (or the right pixels) the user now gets.

The fixtures are written here in the data sets' real on-disk formats (CIFAR pickled batches, SVHN ``.mat``,
``dataset=clients`` tensor files, a Hugging Face ``save_to_disk`` folder, image folders).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedhpro.cli import main
from fedhpro.config import load_config
from fedhpro.data import get_dataset
from fedhpro.data.clients import ClientInfo, ClientsOptions, load_client, resolve_classes, scan_client
from fedhpro.data.images import decode_files
from fedhpro.data.loaders import image_arrays, open_loader, read_pickle
from fedhpro.errors import ConfigError, DataError

CIFAR10_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]


class Payload:
    """Unpickling this runs ``touch <marker>`` (what a tampered data file would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def write_cifar10(root: Path, n: int = 20, protocol: int = pickle.DEFAULT_PROTOCOL) -> np.ndarray:
    """A small CIFAR-10 folder in the official format (not the official bytes); returns the training pixels."""
    folder = root / "cifar10" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    xs = []
    for name in CIFAR10_FILES[:6]:
        x = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        xs.append(x)
        (folder / name).write_bytes(pickle.dumps({"data": x, "labels": [i % 10 for i in range(n)],
                                                  "batch_label": "fixture"}, protocol=protocol))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"c{i}" for i in range(10)]},
                                                       protocol=protocol))
    return np.concatenate(xs[:5])


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


# ----------------------------------------------------------------------------- CIFAR: no pickle runs code


@pytest.mark.slow
@pytest.mark.parametrize("verify", [True, False])
def test_tampered_cifar_folder_runs_no_code_and_is_one_line(tmp_path, capsys, verify):
    marker = tmp_path / "MARKER"
    folder = tmp_path / "cifar10" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in CIFAR10_FILES:  # seven pickles, each with a payload
        (folder / name).write_bytes(pickle.dumps({"data": Payload(marker), "labels": [0], "label_names": ["a"]}))
    code = main(["run", "dataset=cifar10", f"data_dir={tmp_path}", *([] if verify else ["data.verify=false"]),
                 "rounds=1", "local_epochs=1", "progress=false", "device=cpu", f"out={tmp_path / 'run'}"])
    err = one_line_error(capsys)
    assert code == 2 and not marker.exists()
    if verify:  # the first wall: the file is not torchvision's
        assert "data_batch_1 does not match torchvision's published checksum; delete the folder and download " \
               "again" in err
    else:  # the second wall: the unpickler builds no callable but numpy's array reconstruction
        assert "data_batch_1 is not a data file: its pickle calls posix.system" in err or "calls os.system" in err
        assert "nothing was run" in err


def test_checksum_mismatch_is_one_line_for_cifar_and_svhn(tmp_path):
    from scipy.io import savemat

    write_cifar10(tmp_path)
    with pytest.raises(DataError) as raised:
        open_loader("cifar10", tmp_path, True)
    message = str(raised.value)
    assert "\n" not in message and "does not match torchvision's published checksum" in message
    assert str(tmp_path / "cifar10" / "cifar-10-batches-py" / "data_batch_1") in message
    (tmp_path / "svhn").mkdir()
    savemat(tmp_path / "svhn" / "test_32x32.mat", {"X": np.zeros((32, 32, 3, 2), np.uint8), "y": np.ones((2, 1))})
    with pytest.raises(DataError, match=r"svhn: file .*test_32x32.mat does not match torchvision's published "
                                        r"checksum; delete the folder and download again"):
        open_loader("svhn", tmp_path, False)
    assert len(open_loader("svhn", tmp_path, False, verify=False)) == 2  # a copy of one's own: data.verify=false


def test_files_with_the_published_checksums_load_verified(tmp_path, monkeypatch):
    """The verified path itself: with the fixture's md5 in torchvision's list, the folder loads with verify on."""
    from torchvision import datasets

    pixels = write_cifar10(tmp_path)
    folder = tmp_path / "cifar10" / "cifar-10-batches-py"

    def md5(name: str) -> str:
        return hashlib.md5((folder / name).read_bytes()).hexdigest()

    monkeypatch.setattr(datasets.CIFAR10, "train_list", [[n, md5(n)] for n in CIFAR10_FILES[:5]])
    monkeypatch.setattr(datasets.CIFAR10, "test_list", [["test_batch", md5("test_batch")]])
    monkeypatch.setattr(datasets.CIFAR10, "meta", {"filename": "batches.meta", "key": "label_names",
                                                   "md5": md5("batches.meta")})
    x, y = image_arrays(open_loader("cifar10", tmp_path, True))
    assert np.array_equal(x.reshape(len(x), -1), pixels) and len(y) == 100


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar_pickled_with_any_protocol_loads_through_the_restricted_unpickler(tmp_path, protocol):
    pixels = write_cifar10(tmp_path, protocol=protocol)
    dataset = open_loader("cifar10", tmp_path, True, verify=False)
    assert np.array_equal(image_arrays(dataset)[0].reshape(100, -1), pixels) and dataset.classes[3] == "c3"


@pytest.mark.parametrize("payload", [
    (eval, ("1",)), (getattr, ("os", "system")), (np.load, ("x.npy",)), (Path, ("x",)), (torch.load, ("x",)),
])
def test_the_restricted_unpickler_refuses_every_other_global(tmp_path, payload):
    class Call:
        def __reduce__(self):
            return payload

    path = tmp_path / "batch"
    path.write_bytes(pickle.dumps({"data": Call()}))
    with pytest.raises(DataError, match=r"cifar10: .*batch is not a data file: its pickle calls .*nothing was run"):
        read_pickle(path, "cifar10")


def test_truncated_cifar_pickle_is_one_line(tmp_path):
    write_cifar10(tmp_path)
    batch = tmp_path / "cifar10" / "cifar-10-batches-py" / "data_batch_2"
    batch.write_bytes(batch.read_bytes()[:500])
    with pytest.raises(DataError, match=r"cifar10: cannot read .*data_batch_2 \(") as raised:
        open_loader("cifar10", tmp_path, True, verify=False)
    assert "\n" not in str(raised.value)


# ----------------------------------------------------------------------------- labels bounded


def _tensor_client(root: Path, name: str, x, y, test: tuple | None = None) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    torch.save({"x": x, "y": y}, folder / "train.pt")
    if test is not None:
        torch.save({"x": test[0], "y": test[1]}, folder / "test.pt")
    return folder


@pytest.mark.slow
def test_huge_label_in_a_tensor_client_is_refused_before_allocating(tmp_path, capsys):
    _tensor_client(tmp_path / "fed", "site-0", torch.randn(4, 3), torch.tensor([0, 1, 2, 2**31 - 1]),
                   (torch.randn(2, 3), torch.tensor([0, 1])))
    _tensor_client(tmp_path / "fed", "site-1", torch.randn(4, 3), torch.tensor([0, 1, 1, 0]))
    code = main(["run", "dataset=clients", f"data_dir={tmp_path / 'fed'}", "model=mlp", "rounds=1",
                 "local_epochs=1", "progress=false", "device=cpu", f"out={tmp_path / 'run'}"])
    err = one_line_error(capsys)
    assert code == 2 and "site-0" in err and "train.pt" in err and "label 2147483647" in err
    assert "data.max_classes=100000" in err and "data.num_classes" in err


def test_a_nodes_description_with_a_huge_or_odd_label_is_refused():
    options = ClientsOptions()

    def info(label) -> ClientInfo:
        return ClientInfo("node-3", None, "tensors", None, None, label, [3], 4, 0)

    for label, text in ((2**31 - 1, "label 2147483647"), (-1, "label -1"), (2.5, "type float"),
                        (True, "type bool")):
        with pytest.raises(DataError, match=f"client node-3: .*{text}.*data.max_classes=100000"):
            resolve_classes([info(label)], options)
    with pytest.raises(ConfigError, match="data.num_classes=200000 is above data.max_classes=100000"):
        resolve_classes([info(3)], ClientsOptions(num_classes=200_000))
    assert len(resolve_classes([info(150_000)], ClientsOptions(max_classes=200_000))) == 150_001


def test_negative_and_fractional_labels_in_a_tensor_file_are_one_line(tmp_path):
    for name, y, text in (("neg", torch.tensor([0, -3]), "label -3 is negative"),
                          ("frac", torch.tensor([0.0, 1.5]), "not whole numbers"),
                          ("nan", torch.tensor([0.0, float("nan")]), "not whole numbers"),
                          ("big", torch.tensor([0.0, 1e30]), "data.max_classes"),
                          ("bool", torch.tensor([True, False]), "integer class labels")):
        folder = _tensor_client(tmp_path, name, torch.randn(2, 3), y)
        with pytest.raises(DataError, match=text):
            scan_client(folder, ClientsOptions())


def _hf_text(tmp_path: Path, labels: list) -> str:
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "hf"
    datasets.Dataset.from_dict({"text": [f"word{i} thing" for i in range(len(labels))],
                                "label": labels}).save_to_disk(str(path))
    return str(path)


def _hf_build(path: str, *overrides: str):
    config = load_config(None, ["dataset=huggingface", f"data.path={path}", "data.text_column=text", "clients=2",
                                "partition=iid", *overrides])
    return get_dataset("huggingface").build(config.data, config.run.clients, config.run.seed,
                                            partition=config.partition)


def test_huge_label_in_a_hugging_face_column_is_refused_before_allocating(tmp_path):
    path = _hf_text(tmp_path, [0, 1, 0, 1, 2**31 - 1] * 4)
    with pytest.raises(DataError, match=r"the 'label' column has label 2147483647, not below "
                                        r"data.max_classes=100000; .*raise data.max_classes") as raised:
        _hf_build(path)
    assert "\n" not in str(raised.value)


def test_hugging_face_class_names_beyond_max_classes_are_refused(tmp_path):
    path = _hf_text(tmp_path, [f"name{i}" for i in range(12)])
    with pytest.raises(DataError, match="12 distinct class names, above data.max_classes=10"):
        _hf_build(path, "data.max_classes=10")


# ----------------------------------------------------------------------------- caches keyed by content


def _bmp(path: Path, colour: tuple[int, int, int], size: int = 6) -> None:
    """An uncompressed image: the same size in bytes whatever its pixels."""
    Image.new("RGB", (size, size), colour).save(path, format="BMP")


def _rewrite_keeping_size_and_mtime(path: Path, colour: tuple[int, int, int]) -> None:
    before = path.stat()
    _bmp(path, colour)
    assert path.stat().st_size == before.st_size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # the mtime put back, as a copy tool would
    assert path.stat().st_mtime_ns == before.st_mtime_ns


def test_builtin_image_file_cache_reads_replaced_pixels(tmp_path):
    for split in ("train", "val"):
        for digit in range(10):
            folder = tmp_path / "syn" / split / str(digit)
            folder.mkdir(parents=True)
            _bmp(folder / "a.bmp", (digit * 20, 0, 0))
    cache = tmp_path / ".fedhpro-cache" / "syn"
    first, _ = image_arrays(open_loader("syn", tmp_path, True), 6, cache)
    assert int(first[3, 0, 0, 0]) == 60
    _rewrite_keeping_size_and_mtime(tmp_path / "syn" / "train" / "3" / "a.bmp", (0, 200, 0))
    again, _ = image_arrays(open_loader("syn", tmp_path, True), 6, cache)
    assert int(again[3, 0, 0, 0]) == 0 and int(again[3, 1, 0, 0]) == 200  # the new pixels, not the cached ones
    assert np.array_equal(again[:3], first[:3])


def test_own_folder_cache_reads_replaced_pixels(tmp_path):
    root = tmp_path / "fed"
    for split in ("train", "test"):
        for name in ("cat", "dog"):
            (root / "site-0" / split / name).mkdir(parents=True)
            _bmp(root / "site-0" / split / name / "1.bmp", (10, 20, 30))
    files = sorted((root / "site-0" / "train").rglob("*.bmp"))
    cache = root / ".fedhpro-cache"
    assert int(decode_files(files, 6, cache)[0, 0, 0, 0]) == 10
    _rewrite_keeping_size_and_mtime(files[0], (250, 20, 30))
    assert int(decode_files(files, 6, cache)[0, 0, 0, 0]) == 250
    (train_x, _), _, _ = load_client(root / "site-0", ClientsOptions(image_size=6), ["cat", "dog"])
    assert float(train_x[0, 0, 0, 0]) == pytest.approx(250 / 127.5 - 1)


# ----------------------------------------------------------------------------- tensor inputs: one line each


def _run_clients(tmp_path: Path, capsys, *args: str) -> tuple[int, str]:
    code = main(["run", "dataset=clients", f"data_dir={tmp_path / 'fed'}", "rounds=1", "local_epochs=1",
                 "progress=false", "device=cpu", "feature_dim=8", f"out={tmp_path / 'run'}", *args])
    return code, capsys.readouterr().err


@pytest.mark.slow
def test_integer_x_with_mlp_is_one_line(tmp_path, capsys):
    for k in range(2):
        _tensor_client(tmp_path / "fed", f"site-{k}", torch.randint(0, 5, (8, 4)), torch.arange(8) % 2,
                       (torch.randint(0, 5, (4, 4)), torch.arange(4) % 2))
    code, err = _run_clients(tmp_path, capsys, "model=mlp")
    assert code == 2 and "Traceback" not in err
    assert "model=mlp takes float features, but the inputs are torch.int64" in err.strip().splitlines()[-1]


@pytest.mark.slow
def test_integer_and_float_x_across_clients_become_float32(tmp_path, capsys):
    ints = torch.randint(0, 5, (8, 4))
    _tensor_client(tmp_path / "fed", "site-0", ints, torch.arange(8) % 2, (torch.randint(0, 5, (4, 4)),
                                                                            torch.arange(4) % 2))
    _tensor_client(tmp_path / "fed", "site-1", torch.randn(8, 4), torch.arange(8) % 2)
    code, err = _run_clients(tmp_path, capsys, "model=mlp")
    assert code == 0, err
    config = load_config(None, ["dataset=clients", f"data_dir={tmp_path / 'fed'}", "data.standardize=none"])
    fed = get_dataset("clients").build(config.data, None, 0, data_dir=config.run.data_dir)
    assert fed.clients[0].x.dtype == torch.float32 and torch.equal(fed.clients[0].x, ints.float())
    assert any("integer x of site-0 converted to float32" in note for note in fed.notes)


def test_integer_x_beyond_float32_beside_float_x_is_one_line(tmp_path):
    _tensor_client(tmp_path / "fed", "site-0", torch.full((2, 3), 2**40), torch.tensor([0, 1]),
                   (torch.randn(2, 3), torch.tensor([0, 1])))
    with pytest.raises(DataError, match=r"client site-0: .*train.pt holds integer x of magnitude 1099511627776"):
        load_client(tmp_path / "fed" / "site-0", ClientsOptions(), ["0", "1"])


@pytest.mark.slow
def test_sparse_x_is_densified_and_a_huge_one_refused(tmp_path, capsys):
    dense = torch.randn(8, 4) * (torch.rand(8, 4) > 0.5)
    _tensor_client(tmp_path / "fed", "site-0", dense.to_sparse(), torch.arange(8) % 2,
                   (dense[:4].to_sparse_csr(), torch.arange(4) % 2))
    code, err = _run_clients(tmp_path, capsys, "model=mlp")
    assert code == 0, err
    (x, _), (test_x, _), _ = load_client(tmp_path / "fed" / "site-0", ClientsOptions(standardize="none"), ["0", "1"])
    assert torch.equal(x, dense) and torch.equal(test_x, dense[:4]) and x.layout == torch.strided
    huge = torch.sparse_coo_tensor(torch.tensor([[0, 1], [0, 0]]), torch.tensor([1.0, 2.0]), (2, 2**30))
    folder = _tensor_client(tmp_path / "huge", "site-0", huge, torch.tensor([0, 1]))
    with pytest.raises(DataError, match=r"x is a sparse 2 x 1073741824 tensor; densified it would hold"):
        scan_client(folder, ClientsOptions())


def test_an_expanded_x_cannot_ask_for_more_memory_than_its_file(tmp_path):
    folder = _tensor_client(tmp_path, "site-0", torch.zeros(1, 1).expand(2**20, 2**10), torch.zeros(2**20,
                                                                                                     dtype=torch.long))
    with pytest.raises(DataError, match=r"x is an expanded \(stride-0\) 1048576 x 1024 tensor"):
        scan_client(folder, ClientsOptions())


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e300])
def test_nan_or_infinite_x_is_one_line_naming_the_client_and_file(tmp_path, value):
    x = torch.randn(4, 3, dtype=torch.float64)
    x[2, 1] = value
    folder = _tensor_client(tmp_path, "site-7", x, torch.tensor([0, 1, 0, 1]))
    with pytest.raises(DataError, match=r"client site-7: .*site-7/train.pt: x holds NaN or infinite values"):
        scan_client(folder, ClientsOptions())


def test_a_corrupt_image_in_a_builtin_image_set_is_one_line(tmp_path):
    for digit in range(10):
        (tmp_path / "syn" / "train" / str(digit)).mkdir(parents=True)
        _bmp(tmp_path / "syn" / "train" / str(digit) / "a.bmp", (digit, 0, 0))
    (tmp_path / "syn" / "train" / "3" / "b.png").write_bytes(b"not an image")
    with pytest.raises(DataError, match=r"cannot decode the image .*3/b.png .*replace or remove the file"):
        image_arrays(open_loader("syn", tmp_path, True), 6, tmp_path / ".fedhpro-cache")
    assert not any((tmp_path / ".fedhpro-cache").iterdir())  # no half-written cache is left


# ----------------------------------------------------------------------------- run folders: untrusted input

#: ten levels of ten aliases: 10**10 values once expanded (the YAML "billion laughs")
BOMB = "\n".join(["a0: &a0 [" + ", ".join(["lol"] * 10) + "]"]
                 + [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]) + "\n"


def _report_folder(folder: Path, config: str = "method: fedavg\nseed: 0\n", rows: list | None = None) -> Path:
    """A run folder as ``fedhpro report`` reads it: metrics.jsonl (one evaluated row) and config.yaml."""
    import json

    folder.mkdir(parents=True)
    rows = rows if rows is not None else [{"round": 0, "bytes_up": 10, "accuracy": {"a": 50.0, "AVG": 50.0}}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "config.yaml").write_text(config)
    return folder


def test_report_of_a_config_yaml_with_a_python_tag_runs_nothing_and_is_one_line(tmp_path, capsys):
    marker = tmp_path / "MARKER"
    folder = _report_folder(tmp_path / "run", f"method: !!python/object/apply:os.system ['touch {marker}']\n")
    code = main(["report", str(folder), f"out={tmp_path / 'report'}"])
    err = one_line_error(capsys)
    assert code == 2 and not marker.exists()
    assert "config.yaml is not valid YAML at line 1" in err and "python/object/apply:os.system" in err


@pytest.mark.parametrize("row, message", [
    ({"round": 0, "accuracy": "high"}, "accuracy is not a mapping of test sets"),
    ({"round": 0, "accuracy": {"a": 50.0}}, "accuracy is not a mapping of test sets"),
    ({"round": "0", "accuracy": {"AVG": 50.0}}, "round is '0', not a whole number"),
    ({"round": 0, "accuracy": {"AVG": 50.0}, "bytes_up": "many"}, "bytes_up is not a number"),
    ({"round": 0, "accuracy": {"AVG": 50.0}, "fairness": {"mean": 1}}, "fairness is not a mapping with the numbers"),
    ({"round": 0, "accuracy": {"AVG": 50.0}, "server": {"gm_loss_before": 1.0}}, "server is not a mapping whose"),
    ({"round": 0, "accuracy": {"AVG": 50.0}, "prototype_distance": {"server": 3}}, "prototype_distance is not"),
    ([1, 2], "not an object"),
])
def test_report_of_a_metrics_row_of_another_shape_is_one_line(tmp_path, capsys, row, message):
    folder = _report_folder(tmp_path / "run", rows=[row])
    code = main(["report", str(folder), f"out={tmp_path / 'report'}"])
    err = one_line_error(capsys)
    assert code == 2 and message in err and "metrics.jsonl" in err, err


def test_report_of_a_deep_summary_or_report_record_is_one_line(tmp_path, capsys):
    folder = _report_folder(tmp_path / "run")
    (folder / "summary.json").write_text("[" * 50_000 + "]" * 50_000)
    code = main(["report", str(folder), f"out={tmp_path / 'report'}"])
    err = one_line_error(capsys)
    assert code == 2 and "summary.json nests lists and objects more than 100 levels deep" in err
    (folder / "summary.json").write_text('{"accuracy": 50.0}')
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "table.md").write_text("other")
    (tmp_path / "report" / "report.json").write_text('{"runs": ' + "[" * 50_000 + "]" * 50_000 + "}")
    code = main(["report", str(folder), f"out={tmp_path / 'report'}"])
    err = one_line_error(capsys)  # a record that is no report's: another report, kept unless force=true
    assert code == 2 and "already holds another report" in err


def _in_a_fresh_process(code: str, timeout: int = 60) -> str:
    """Run ``code`` in a new interpreter; its stdout (a hang past ``timeout`` s fails the test)."""
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"did not finish within {timeout} s: a hang")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
def test_compare_reading_back_a_stored_run_whose_config_is_a_bomb_is_one_line(tmp_path):
    folder = _report_folder(tmp_path / "run", "method: fedavg\n" + BOMB)
    (folder / "summary.json").write_text('{"accuracy": 50.0}')
    out = _in_a_fresh_process(f"""
from pathlib import Path
from fedhpro.compare import check_stored_run
from fedhpro.config import load_config
from fedhpro.errors import ConfigError
try:
    check_stored_run(Path({str(folder)!r}), load_config(None, ["method=fedavg"]))
except ConfigError as error:
    print(error)
""")
    assert out.count("\n") == 1 and "config.yaml cannot be read" in out and "aliases" in out, out


@pytest.mark.slow
def test_resume_of_a_folder_whose_config_is_a_bomb_is_one_line(tmp_path):
    import subprocess
    import sys

    folder = _report_folder(tmp_path / "run", "method: fedavg\n" + BOMB)
    try:
        done = subprocess.run([sys.executable, "-m", "fedhpro", "run", f"resume={folder}"], capture_output=True,
                              text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("fedhpro run resume= did not finish within 60 s: a hang")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "config.yaml" in lines[0] and "aliases" in lines[0], \
        done.stderr[-2000:]


def test_a_checkpoint_or_partition_file_of_deep_json_is_one_line(tmp_path):
    from fedhpro.data.partition import Partition, PartitionError
    from fedhpro.engines import checkpoint

    deep = "[" * 100_000 + "]" * 100_000
    path = tmp_path / "checkpoints" / "round-000001.pt"
    path.parent.mkdir()
    torch.save({"format_version": 1, "completed_rounds": 1, "simulator": {}, "metrics": deep, "rng": {}}, path)
    with pytest.raises(DataError, match="its 'metrics' entry is damaged") as raised:
        checkpoint.load(path)
    assert "\n" not in str(raised.value)
    torch.save({"format_version": 1, "completed_rounds": 1, "simulator": {}, "metrics": "[1, 2]", "rng": {}}, path)
    with pytest.raises(DataError, match="its 'metrics' entry is damaged"):
        checkpoint.load(path)
    rows = '[{"round": 0, "accuracy": {"AVG": "high"}}]'  # rows the resumed run would write and report
    torch.save({"format_version": 1, "completed_rounds": 1, "simulator": {}, "metrics": rows, "rng": {}}, path)
    with pytest.raises(DataError, match="its metrics row 1: accuracy is not a mapping of test sets"):
        checkpoint.load(path)
    partition = tmp_path / "partition.json"
    partition.write_text(deep)
    with pytest.raises(PartitionError, match="partition.json: partition file nests .* more than 100 levels deep"):
        Partition.load(partition)


def _png(path: Path, width: int, height: int) -> Path:
    Image.new("L", (width, height), 7).save(path)
    return path


def test_training_images_over_the_pixel_limit_are_refused_before_decoding(tmp_path, monkeypatch):
    """Every training image reader (decode_file: imagefolder, clients; the built-in image sets' reader) checks
    the pixel count from the header; the limit is FEDHPRO_MAX_IMAGE_PIXELS (here 100: a 10x10 image fits, an
    11x10 one does not), and nothing of a refused image is decoded."""
    from PIL import ImageFile

    from fedhpro.data.images import MAX_IMAGE_PIXELS, decode_file, max_image_pixels
    from fedhpro.data.loaders import _pil_rgb

    assert max_image_pixels() == MAX_IMAGE_PIXELS == Image.MAX_IMAGE_PIXELS  # the default: Pillow's threshold
    monkeypatch.setenv("FEDHPRO_MAX_IMAGE_PIXELS", "100")
    fits, over = _png(tmp_path / "fits.png", 10, 10), _png(tmp_path / "over.png", 11, 10)
    assert decode_file(fits, 4).shape == (3, 4, 4) and _pil_rgb(fits).size == (10, 10)
    load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("decoded") if self.size == (11, 10)
                        else load(self))
    for read in (lambda: decode_file(over, 4), lambda: _pil_rgb(over),
                 lambda: decode_files([fits, over], 4, tmp_path / "cache")):
        with pytest.raises(DataError, match=r"over.png is 11x10 = 110 pixels, over the limit of 100; shrink the "
                                            r"image, or raise the limit with FEDHPRO_MAX_IMAGE_PIXELS=N") as raised:
            read()
        assert "\n" not in str(raised.value)
    monkeypatch.setenv("FEDHPRO_MAX_IMAGE_PIXELS", "lots")
    with pytest.raises(ConfigError, match="FEDHPRO_MAX_IMAGE_PIXELS='lots' is not a whole number"):
        decode_file(fits, 4)
