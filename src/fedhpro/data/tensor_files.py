"""One split file of a client's tensors, read and checked: a ``.pt`` or ``.npz`` file's ``x`` and ``y``
(:func:`read_tensor_file`: bounded, no file runs code, each refusal one line naming the file and the fix), a
table's rows as the same tensors (:func:`rows_tensors`), and integer features made float32 exactly
(:func:`as_float`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedhpro.arrays import ArrayFileError, load_npz, load_torch
from fedhpro.data.tables import Rows
from fedhpro.errors import DataError

#: the most elements a sparse or expanded (stride-0) x or y may densify to: 2**28 (1 GiB of float32)
MAX_DENSE = 1 << 28
#: integers a float32 holds exactly: integer x mixed with float x is converted only within this range
EXACT_FLOAT32 = 1 << 24
_FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_TYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
_UNSIGNED_TYPES = (torch.uint16, torch.uint32, torch.uint64)


def _as_tensor(value: Any, name: str, path: Path, how: str) -> Tensor:
    """``x`` or ``y`` of a tensor file as a plain CPU tensor (a tensor, an array or a list of numbers)."""
    if isinstance(value, Tensor):
        if value.device.type != "cpu":
            raise DataError(f"{path}: {name} is a {value.device.type} tensor without data; save it with {how}")
        return value.detach()
    if isinstance(value, (np.ndarray, list, tuple)):
        try:
            array = np.asarray(value)
        except (TypeError, ValueError, OverflowError) as error:
            raise DataError(f"{path}: {name} must be a numeric array ({str(error).splitlines()[0]}); save it with "
                            f"{how}") from None
        if array.dtype.kind not in "biuf":
            raise DataError(f"{path}: {name} holds {array.dtype} values, not numbers; save it with {how}")
        return torch.from_numpy(np.ascontiguousarray(array))
    raise DataError(f"{path}: {name} is a {type(value).__name__}, not an array; save it with {how}")


def _dense(value: Tensor, name: str, path: Path) -> Tensor:
    """A sparse tensor densified, an expanded (stride-0) view copied: both only up to :data:`MAX_DENSE`
    elements, so a small file cannot ask for more memory than the machine has."""
    sparse = value.layout != torch.strided
    expanded = not sparse and value.numel() * value.element_size() > value.untyped_storage().nbytes()
    if not (sparse or expanded):
        return value
    if value.numel() > MAX_DENSE:
        shape = " x ".join(map(str, value.shape))
        what = "a sparse" if sparse else "an expanded (stride-0)"
        raise DataError(f"{path}: {name} is {what} {shape} tensor; densified it would hold {value.numel():,} values "
                        f"(more than {MAX_DENSE:,}); save the dense array of the samples you use")
    try:
        return value.to_dense() if sparse else value.contiguous()
    except (RuntimeError, ValueError) as error:
        raise DataError(f"{path}: {name} is a malformed sparse tensor ({str(error).splitlines()[0]}); save a dense "
                        "array") from None


def _unsigned_to_int64(value: Tensor, name: str, path: Path) -> Tensor:
    array = value.numpy()
    if array.size and int(array.max()) > np.iinfo(np.int64).max:
        raise DataError(f"{path}: {name} holds {int(array.max())}, beyond int64; save smaller integers")
    return torch.from_numpy(array.astype(np.int64))


def read_tensor_file(path: Path, max_classes: int = 100_000) -> tuple[Tensor, Tensor]:
    """``(x, y)`` of a ``.npz`` or ``.pt`` file, checked; anything else is one DataError naming the file.

    ``y``: N integer labels in ``0 .. max_classes - 1`` (floats that are
    whole numbers are taken as integers). ``x``: N x ... float features
    (any float type -> float32; NaN, infinities and values beyond float32 are
    refused) or integer token ids (-> int64). Sparse ``x``/``y`` are
    densified (up to :data:`MAX_DENSE` elements). ``.npz`` files are read
    without pickles and ``.pt`` files with ``weights_only=True``: no file
    runs code; what either declares (shapes, sizes) is checked against
    ``FEDHPRO_MAX_ARRAY_BYTES`` before it is read (:mod:`fedhpro.arrays`).
    """
    client = f"client {path.parent.name}: {path}"
    how = (f"np.savez('{path.name}', x=x, y=y)" if path.suffix == ".npz"
           else f"torch.save({{'x': x, 'y': y}}, '{path.name}')")
    try:
        content = load_npz(path) if path.suffix == ".npz" else load_torch(path)
    except ArrayFileError:
        raise  # one line already: what the file declares, the limit and the fix
    except Exception as error:  # noqa: BLE001 - numpy and torch raise many types for a bad file; one line for all
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DataError(f"cannot read {path} ({reason[:300]}); save it with {how}") from None
    if not isinstance(content, dict):
        raise DataError(f"{path} holds a {type(content).__name__}, not a dict with x and y; save it with {how}")
    missing = [key for key in ("x", "y") if key not in content]
    if missing:
        held = sorted(map(str, content))
        listed = str(held[:20])[:-1] + (", ...]" if len(held) > 20 else "]")
        raise DataError(f"{path} has no {' and no '.join(missing)} (it holds {listed[:300]}); save it with {how}")
    x = _dense(_as_tensor(content["x"], "x", path, how), "x", path)
    y = _dense(_as_tensor(content["y"], "y", path, how), "y", path)
    if y.dim() != 1 or x.dim() < 2 or x.shape[0] != y.shape[0]:
        raise DataError(f"{path}: x {tuple(x.shape)} and y {tuple(y.shape)} do not match; give x as N x F "
                        "inputs and y as N labels")
    if 0 in x.shape[1:]:
        raise DataError(f"{path}: x {tuple(x.shape)} has an empty feature dimension; give x as N x F inputs, F >= 1")
    y = _labels(y, path, client, max_classes)
    if x.dtype in _FLOAT_TYPES:
        x = x.float()
        if not bool(torch.isfinite(x).all()):
            raise DataError(f"{client}: x holds NaN or infinite values (or values beyond float32's range); clean "
                            "the data")
    elif x.dtype in _INT_TYPES:
        x = x.long()
    elif x.dtype in _UNSIGNED_TYPES:
        x = _unsigned_to_int64(x, "x", path)
    else:
        raise DataError(f"{path}: x is {x.dtype}; save float features (pixels: x / 127.5 - 1) or integer "
                        "token ids (int64)")
    return x.contiguous(), y.contiguous()


def _labels(y: Tensor, path: Path, client: str, max_classes: int) -> Tensor:
    """``y`` as int64 class indices, each in ``0 .. max_classes - 1``; else one DataError naming the file."""
    if y.dtype in _FLOAT_TYPES:
        y64 = y.double()
        if not bool(torch.isfinite(y64).all()) or not bool(torch.all(y64 == y64.round())):
            raise DataError(f"{client}: y holds labels that are not whole numbers; labels are class indices 0..C-1")
    elif y.dtype in _UNSIGNED_TYPES:
        y64 = _unsigned_to_int64(y, "y", path)
    elif y.dtype in _INT_TYPES:
        y64 = y.long()
    else:
        raise DataError(f"{path}: y must hold integer class labels, got {y.dtype}")
    if not y64.numel():
        return y64.long()
    low, high = y64.min().item(), y64.max().item()
    if low < 0:
        raise DataError(f"{path}: label {int(low)} is negative; labels are class indices 0..C-1")
    if high >= max_classes:
        raise DataError(f"{client}: label {int(high)} is not below data.max_classes={max_classes}; fix the label, "
                        "or, if the data really has that many classes, raise data.max_classes (and set "
                        "data.num_classes)")
    return y64.long()


def rows_tensors(rows: Rows, max_classes: int) -> tuple[Tensor, Tensor | np.ndarray]:
    """A table's rows as float32 ``x`` and its labels: int64 class indices checked as a tensor file's ``y``
    (:func:`_labels`), or the names as they are (classes are named across clients:
    :func:`~fedhpro.data.clients.resolve_classes`)."""
    x = torch.from_numpy(rows.x)
    if rows.named:
        return x, rows.labels
    return x, _labels(torch.from_numpy(rows.labels), Path(rows.where), rows.where, max_classes)


def as_float(x: Tensor, path: Path) -> Tensor:
    """Integer features as float32 (beside float features of another split or client); exact, else refused."""
    if x.is_floating_point():
        return x
    largest = max(-int(x.min()), int(x.max())) if x.numel() else 0
    if largest > EXACT_FLOAT32:
        raise DataError(f"client {path.parent.name}: {path} holds integer x of magnitude {largest}, which "
                        "float32 cannot hold exactly, while other x are floats; save every x as float32 (features) "
                        "or every x as int64 (token ids)")
    return x.float()

