"""Fuzzing the data loaders with malformed files: only fedhpro's one-line DataError may come out, no code may run.

Hypothesis (derandomized: the same examples on every run, no deadline) writes ``dataset=clients`` tensor
files (``train.pt`` / ``train.npz``) with wrong dtypes and shapes, NaN and infinities, huge, negative and
fractional labels, missing keys, objects that are not arrays, sparse and expanded tensors, pickled payloads
(inside ``.npz`` object arrays and ``.pt`` pickles) and truncated or corrupted bytes, and reads them through
the loading and validation functions. A second harness corrupts CIFAR batch pickles and reads them through the
restricted unpickler. Every payload would ``touch`` a marker file: it must never exist.
"""

from __future__ import annotations

import io
import os
import pickle
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedhpro.data.clients import ClientsOptions, load_client, resolve_classes, scan_client
from fedhpro.data.loaders import read_pickle
from fedhpro.errors import DataError

MAX_CLASSES = 50
MARKER = Path(tempfile.gettempdir()) / f"fedhpro-fuzz-marker-{os.getpid()}"
FUZZ = settings(max_examples=320, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
COUNT = {"tensor files": 0, "pickles": 0}


class Payload:
    """Unpickling this would run ``touch MARKER``."""

    def __reduce__(self):
        return os.system, (f"touch {MARKER}",)


DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
          "uint64", "bool", "complex64"]
SPECIAL = [0.0, 1.0, 2.0, -1.0, 0.5, float("nan"), float("inf"), -float("inf"), 1e30, 1e300, 2.0**31 - 1,
           2.0**63, -(2.0**63), 49.0, 50.0, 2.0**24 + 1]


@st.composite
def arrays(draw) -> np.ndarray:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
    count = int(np.prod(shape)) if shape else 1
    values = draw(st.lists(st.sampled_from(SPECIAL) | st.integers(-3, 5).map(float), min_size=count,
                           max_size=count))
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.array(values, dtype=np.float64).reshape(shape).astype(dtype)


@st.composite
def plausible(draw) -> dict:
    """x and y that are nearly right: N x F floats or ints, N labels, with one thing (or none) off."""
    n = draw(st.integers(0, 6))
    features = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
    x_dtype = draw(st.sampled_from(["float32", "float64", "int64", "int32", "float16", "uint8", "bool"]))
    y_dtype = draw(st.sampled_from(["int64", "int32", "float32", "float64", "uint64", "int8", "bool"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = rng.normal(size=(n, *features)).astype(x_dtype)
    y = rng.integers(0, 5, n).astype(y_dtype)
    flaw = draw(st.sampled_from(["none", "nan", "inf", "huge label", "negative label", "fraction", "short y",
                                 "flat x", "2d y", "big float"]))
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if n and flaw in ("nan", "inf", "big float") and x.dtype.kind == "f":
            x.flat[0] = {"nan": np.nan, "inf": np.inf, "big float": 1e300}[flaw]
        elif n and flaw == "huge label":
            y = y.astype(np.int64)
            y[-1] = 2**31 - 1
        elif n and flaw == "negative label":
            y = y.astype(np.int64)
            y[0] = -7
        elif n and flaw == "fraction":
            y = y.astype(np.float64) + 0.25
        elif flaw == "short y":
            y = y[:-1]
        elif flaw == "flat x":
            x = x.reshape(-1)
        elif flaw == "2d y":
            y = y.reshape(-1, 1)
    return {"x": x, "y": y}


SPECIAL_VALUES = st.sampled_from(["sparse", "huge sparse", "expanded", "huge expanded", "payload", "parameter"])
VALUES = st.one_of(arrays(), arrays(), st.none(), st.text(max_size=3), st.integers(-2**70, 2**70),
                   st.lists(st.integers(-3, 3), max_size=4), st.lists(st.text(max_size=2), max_size=2),
                   st.dictionaries(st.text(max_size=2), st.integers(), max_size=2), SPECIAL_VALUES)
CONTENT = st.one_of(
    plausible(), plausible(), plausible(),
    st.fixed_dictionaries({"x": VALUES, "y": VALUES}),
    st.dictionaries(st.sampled_from(["x", "y", "z", "X"]), VALUES, max_size=3),
    VALUES,
)
MUTATION = st.tuples(st.sampled_from(["none", "none", "none", "truncate", "flip", "garbage"]), st.floats(0, 1),
                     st.integers(0, 255))


def _tensor(value):
    """A value as ``torch.save`` would hold it: arrays as tensors, the special names as odd tensors/objects."""
    if isinstance(value, np.ndarray):
        try:
            return torch.from_numpy(value.copy())
        except TypeError:
            return value.tolist()
    if value == "sparse":
        return torch.eye(3).to_sparse()
    if value == "huge sparse":
        return torch.sparse_coo_tensor(torch.tensor([[0], [0]]), torch.tensor([1.0]), (3, 2**40))
    if value == "expanded":
        return torch.ones(1, 2).expand(3, 2)
    if value == "huge expanded":
        return torch.ones(1, 1).expand(2**20, 2**12)
    if value == "payload":
        return Payload()
    if value == "parameter":
        return torch.nn.Parameter(torch.randn(3, 2))
    return value


def _array(value):
    """A value as ``np.savez`` would hold it (objects pickled into the archive: the reader must refuse them)."""
    if isinstance(value, str) and value == "payload":
        return np.array([Payload()], dtype=object)
    if isinstance(value, str) and value in ("sparse", "huge sparse", "expanded", "huge expanded", "parameter"):
        return np.ones((3, 2), dtype=np.float32)
    if isinstance(value, (dict, list)) or value is None:
        return np.array([value], dtype=object)
    return value


def write(path: Path, content, mutation) -> None:
    buffer = io.BytesIO()
    if path.suffix == ".pt":
        torch.save({k: _tensor(v) for k, v in content.items()} if isinstance(content, dict) else _tensor(content),
                   buffer)
    elif isinstance(content, dict):
        np.savez(buffer, **{k: _array(v) for k, v in content.items()})
    else:
        np.save(buffer, _array(content), allow_pickle=True)
    data = bytearray(buffer.getvalue())
    how, where, byte = mutation
    at = min(int(where * len(data)), len(data) - 1)
    if how == "truncate":
        data = data[:at]
    elif how == "flip":
        data[at] ^= byte or 1
    elif how == "garbage":
        data[at:at + 16] = bytes([byte]) * 16
    path.write_bytes(bytes(data))


def check_loaded(x: torch.Tensor, y: torch.Tensor) -> None:
    """What a file that loads must give: dense N x ... float32 (finite) or int64 x, N int64 labels in range."""
    assert x.layout == torch.strided and y.layout == torch.strided
    assert x.dtype in (torch.float32, torch.int64) and y.dtype == torch.int64
    assert x.dim() >= 2 and y.dim() == 1 and x.shape[0] == y.shape[0]
    assert not x.is_floating_point() or bool(torch.isfinite(x).all())
    assert not y.numel() or (int(y.min()) >= 0 and int(y.max()) < MAX_CLASSES)


@pytest.fixture(scope="module", autouse=True)
def no_marker():
    MARKER.unlink(missing_ok=True)
    yield
    assert not MARKER.exists(), "a fuzzed file ran code"


@pytest.mark.slow
@FUZZ
@given(suffix=st.sampled_from([".pt", ".npz"]), content=CONTENT, mutation=MUTATION, test_too=st.booleans())
def test_malformed_tensor_files_give_one_line_errors_only(suffix, content, mutation, test_too):
    COUNT["tensor files"] += 1
    options = ClientsOptions(max_classes=MAX_CLASSES)
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        client = Path(folder) / "site-0"
        client.mkdir()
        write(client / f"train{suffix}", content, mutation)
        if test_too:
            write(client / f"test{suffix}", content, ("truncate", 0.5, 0) if mutation[0] == "none" else mutation)
        try:
            info = scan_client(client, options)
            classes = resolve_classes([info], options)
            (x, y), (test_x, test_y), _ = load_client(client, options, classes)
        except DataError as error:
            assert "\n" not in str(error) and str(error)
            return
        check_loaded(x, y)
        check_loaded(test_x, test_y)
    assert not MARKER.exists()


def _batch(protocol: int) -> bytes:
    rng = np.random.default_rng(protocol)
    return pickle.dumps({"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8), "labels": [1, 2, 3, 4],
                         "filenames": [b"a.png", "b.png"]}, protocol=protocol)


PAYLOAD_PICKLE = pickle.dumps({"data": Payload(), "labels": [0]})


@settings(max_examples=120, derandomize=True, deadline=None, database=None)
@given(source=st.sampled_from([2, 4, 5, "payload"]), mutation=MUTATION)
def test_corrupted_cifar_pickles_give_one_line_errors_only(source, mutation):
    COUNT["pickles"] += 1
    data = bytearray(PAYLOAD_PICKLE if source == "payload" else _batch(source))
    how, where, byte = mutation
    at = min(int(where * len(data)), len(data) - 1)
    if how == "truncate":
        data = data[:at]
    elif how == "flip":
        data[at] ^= byte or 1
    elif how == "garbage":
        data[at:at + 16] = bytes([byte]) * 16
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "data_batch_1"
        path.write_bytes(bytes(data))
        try:
            read_pickle(path, "cifar10")
        except DataError as error:
            assert "\n" not in str(error)
    assert not MARKER.exists()


def test_the_fuzzers_ran_their_examples():
    """Each fuzzer that ran in this session (the tensor files' is in the slow tier) made most of its examples."""
    if not any(COUNT.values()):
        pytest.skip("no fuzzer of this file ran in this session")
    least = {"tensor files": 300, "pickles": 100}
    assert all(count == 0 or count >= least[name] for name, count in COUNT.items()), COUNT
