"""Payloads <-> Flower records, one to one and bit for bit.

A method's payload (see :mod:`fedhpro.methods.base`) is a dict whose values
are tensors, dicts of tensors (a model's weights) or plain numbers. On the
wire each entry becomes one record of the message's ``RecordDict`` under its
own key:

* a dict of tensors (``"weights"``)       -> an ``ArrayRecord`` with the same keys, in the same order;
* a tensor (``"hyper_prototypes"``)       -> an ``ArrayRecord`` holding that one array under the same key;
* numbers, bools and strings (``"num_examples"``) -> entries of the ``ConfigRecord`` ``fedhpro.scalars``
  (a ConfigRecord, not a MetricRecord, because it keeps bools and ints as they are);
* the layout (which key was which kind, and which tensors lived on an accelerator)
  -> the ``ConfigRecord`` ``fedhpro.layout``, so that the receiver rebuilds the exact dict.

Arrays travel as NumPy ``.npy`` bytes: dtype, shape and every bit are kept,
so a payload decodes to tensors equal to the ones encoded. Training metrics go
separately into the ``MetricRecord`` ``fedhpro.metrics``.

A receiver that knows what a payload must hold (the server, from the method's
:meth:`~fedhpro.methods.base.Server.reply_layout`) passes that layout to
:func:`decode_payload`, which first compares it with the records' metadata
alone (:func:`check_layout`: record keys, ``Array.dtype``, ``Array.shape``,
``len(Array.data)``, the layout and scalar entries) and refuses, with one
line, a payload with an extra or missing key, a wrong kind, dtype or shape, or
more bytes than the shape's values and a ``.npy`` header take: no byte of a
refused payload is handed to ``np.load``.

The names of a message's other records (:data:`HEADER`, a node's answers :data:`NODE_RECORD` and
:data:`EVAL_RECORD`) are the ServerApp's and the ClientApp's, both read them from here.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import Tensor

from fedhpro.engines.replies import metric_problem
from fedhpro.errors import ConfigError, UpdateError

#: record names this module reserves in a RecordDict (payload keys may not take them)
LAYOUT = "fedhpro.layout"
SCALARS = "fedhpro.scalars"
METRICS = "fedhpro.metrics"
RESERVED_PREFIX = "fedhpro."

# the records of a message between the ServerApp and the ClientApp besides its payload's
#: the ConfigRecord every fedhpro message carries: the resolved config (JSON), the round and the client
HEADER = "fedhpro.header"
#: record-name prefix of the server state sent with client-side evaluation (inference may need it)
SERVER_STATE = "server-state/"
#: what a node answers to a query: its partition (partition mode) or its folder's description (own data)
NODE_RECORD = "fedhpro.node"
#: what a node answers to an evaluation: test-set name, correct and total counts
EVAL_RECORD = "fedhpro.eval"
#: header entry under ``privacy=client``: the round protocol's ClientPrivacy (JSON), which the node privatizes with
PRIVACY = "privacy"

_TENSOR, _TENSORS, _SCALAR = "tensor", "tensors", "scalar"

#: bounds on a reply's training metrics (``fedhpro.metrics``): how many a node may name, the characters of one
#: name and of all names together (the methods report a handful; SecAgg+'s metric names have the same bounds)
MAX_METRICS = 256
MAX_METRIC_NAME = 128
MAX_METRIC_CHARS = 8192


def to_array(tensor: Tensor) -> Array:
    """A tensor as a Flower Array (``.npy`` bytes: dtype, shape and bits kept)."""
    return Array.from_numpy_ndarray(tensor.detach().cpu().numpy())


def _tensor(array: Array, device: torch.device | None, name: str = "array") -> Tensor:
    try:
        values = array.numpy()
    except (ValueError, TypeError, OSError, EOFError) as error:  # bytes that are not one .npy array
        raise UpdateError(f"'{name}' is not a readable .npy array ({_first_line(error)})") from None
    if str(values.dtype) != array.dtype or tuple(values.shape) != tuple(array.shape):
        raise UpdateError(f"'{name}' holds a {values.dtype} array of shape {tuple(values.shape)} but announces "
                          f"{array.dtype} {tuple(array.shape)}")
    # np.load over bytes gives a read-only view; copy so that torch owns writable memory
    tensor = torch.from_numpy(np.array(values, copy=True))
    return tensor if device is None else tensor.to(device)


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def encode_payload(payload: Mapping[str, Any], prefix: str = "") -> dict[str, ArrayRecord | ConfigRecord]:
    """The records of ``payload``, named ``prefix + key`` (plus the ``fedhpro.*`` layout/scalars records).

    Raises UpdateError (one line) for a value that cannot travel (a nested dict
    holding something else than tensors, a list, an object).
    """
    records: dict[str, ArrayRecord | ConfigRecord] = {}
    layout: dict[str, str] = {}
    on_device: list[str] = []
    scalars: dict[str, Any] = {}
    for key, value in payload.items():
        if not isinstance(key, str) or key.startswith(RESERVED_PREFIX):
            raise UpdateError(f"payload key {key!r} cannot travel: keys must be strings not starting with "
                              f"{RESERVED_PREFIX!r}")
        if isinstance(value, Tensor):
            records[prefix + key] = ArrayRecord({key: to_array(value)})
            layout[key] = _TENSOR
            if value.device.type != "cpu":
                on_device.append(key)
        elif isinstance(value, Mapping):
            bad = [name for name, item in value.items() if not isinstance(item, Tensor)]
            if bad:
                raise UpdateError(f"payload entry '{key}' holds non-tensors (e.g. '{bad[0]}'); "
                                  "only dicts of tensors can travel as an ArrayRecord")
            records[prefix + key] = ArrayRecord({name: to_array(item) for name, item in value.items()})
            layout[key] = _TENSORS
            if any(item.device.type != "cpu" for item in value.values()):
                on_device.append(key)
        elif isinstance(value, (bool, int, float, str)):
            scalars[key] = value
            layout[key] = _SCALAR
        else:
            raise UpdateError(f"payload entry '{key}' is a {type(value).__name__}; only tensors, dicts of tensors, "
                              "numbers, bools and strings can travel")
    # an empty list has no element type for Flower to check: store the layout as one entry per key instead
    records[prefix + LAYOUT] = ConfigRecord({**{f"kind.{k}": v for k, v in layout.items()},
                                             **{f"device.{k}": True for k in on_device}})
    records[prefix + SCALARS] = ConfigRecord(scalars)
    return records


def decode_payload(content: RecordDict, device: torch.device | str | None = None, prefix: str = "",
                   expected: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The payload that :func:`encode_payload` encoded into ``content`` (same keys, order, dtypes and bits).

    Tensors that lived on an accelerator at the sender move to ``device``;
    the rest stay on the CPU, exactly as the in-process simulator hands them over.
    With ``expected`` (a reply layout, see :meth:`~fedhpro.methods.base.Server.reply_layout`)
    the records are first checked against it (:func:`check_layout`), before any array is read.
    """
    if prefix + LAYOUT not in content.config_records:
        raise UpdateError(f"the message has no '{prefix + LAYOUT}' record; it was not sent by a fedhpro app")
    if expected is not None:
        check_layout(content, expected, prefix)
    layout = content.config_records[prefix + LAYOUT]
    scalars = content.config_records.get(prefix + SCALARS, ConfigRecord())
    target = None if device is None else torch.device(device)
    payload: dict[str, Any] = {}
    for entry, kind in layout.items():
        if not entry.startswith("kind."):
            continue
        key = entry[len("kind."):]
        move = target if layout.get(f"device.{key}", False) else None
        if kind == _SCALAR:
            payload[key] = scalars[key]
        elif kind in (_TENSOR, _TENSORS):
            record = content.array_records.get(prefix + key)
            if record is None:
                raise UpdateError(f"the message lacks the ArrayRecord '{prefix + key}' its layout announces")
            tensors = {name: _tensor(array, move, name) for name, array in record.items()}
            payload[key] = tensors[key] if kind == _TENSOR else tensors
        else:
            raise UpdateError(f"unknown payload kind {kind!r} for '{key}'")
    return payload


def check_layout(content: RecordDict, expected: Mapping[str, Any], prefix: str = "") -> None:
    """Raise UpdateError (one line) unless the payload in ``content`` has exactly the ``expected`` layout.

    ``expected`` maps each payload key to ``{name: (shape, dtype)}`` (a dict of tensors), ``(shape,
    dtype)`` (one tensor) or a scalar type (``int``, ``float``, ``bool``, ``str``; an int passes for a
    float), dtypes as torch dtypes (or NumPy names). Only metadata is read: the ``fedhpro.layout`` and
    ``fedhpro.scalars`` entries, the ArrayRecords' keys and each Array's ``stype``, ``dtype``, ``shape``
    and ``len(data)``, which may not exceed the shape's values plus the ``.npy`` header NumPy writes
    for that shape and dtype (nor fall short of the values alone).
    """
    layout = content.config_records.get(prefix + LAYOUT)
    if layout is None:
        raise UpdateError(f"the message has no '{prefix + LAYOUT}' record; it was not sent by a fedhpro app")
    kinds = {entry[len("kind."):]: str(kind) for entry, kind in layout.items() if entry.startswith("kind.")}
    extra = [key for key in kinds if key not in expected]
    if extra:
        raise UpdateError(f"the reply holds '{extra[0]}', which the method's reply layout does not declare (a method "
                          "whose client uploads it must declare it in Server.reply_layout())")
    missing = [key for key in expected if key not in kinds]
    if missing:
        raise UpdateError(f"the reply lacks '{missing[0]}', which the method's reply layout declares")
    announced = {prefix + key for key, kind in kinds.items() if kind in (_TENSOR, _TENSORS)}
    stray = [name for name in content.array_records if name.startswith(prefix) and name not in announced]
    scalars = content.config_records.get(prefix + SCALARS, ConfigRecord())
    stray += [name for name in scalars if kinds.get(name) != _SCALAR]
    if stray:
        raise UpdateError(f"the reply holds '{stray[0]}', which its own layout does not announce")
    for key, form in expected.items():
        if isinstance(form, Mapping):
            _check_arrays(content.array_records.get(prefix + key), kinds[key], _TENSORS, key, form)
        elif isinstance(form, tuple):
            _check_arrays(content.array_records.get(prefix + key), kinds[key], _TENSOR, key, {key: form})
        elif isinstance(form, type):
            if kinds[key] != _SCALAR or key not in scalars:
                raise UpdateError(f"'{key}' must be a scalar of type {form.__name__}, the reply holds a {kinds[key]}")
            if not _scalar_fits(scalars[key], form):
                raise UpdateError(f"'{key}' must be of type {form.__name__}, the reply holds a "
                                  f"{type(scalars[key]).__name__}")
        else:
            raise ConfigError(f"the method's reply layout declares '{key}' as {form!r}; declare a dict "
                              "{name: (shape, dtype)}, a (shape, dtype) or a scalar type in Server.reply_layout()")


def _check_arrays(record: ArrayRecord | None, kind: str, expected_kind: str, key: str,
                  forms: Mapping[str, tuple[Any, Any]]) -> None:
    """UpdateError unless ``record`` is of ``expected_kind`` and holds exactly ``forms``' arrays, each of its
    declared dtype, shape and byte size (metadata only)."""
    if kind != expected_kind or record is None:
        what = "a dict of tensors" if expected_kind == _TENSORS else "one tensor"
        raise UpdateError(f"'{key}' must be {what}, the reply holds a {kind}"
                          f"{'' if record is not None else ' without its ArrayRecord'}")
    extra = [name for name in record if name not in forms]
    if extra:
        raise UpdateError(f"'{key}' holds '{extra[0]}', which the method's reply layout does not declare")
    missing = [name for name in forms if name not in record]
    if missing:
        raise UpdateError(f"'{key}' lacks '{missing[0]}', which the method's reply layout declares")
    for name, (shape, dtype) in forms.items():
        array, want = record[name], numpy_dtype_name(dtype)
        where = f"'{name}'" if name == key else f"'{key}' entry '{name}'"
        if array.stype != "numpy.ndarray":
            raise UpdateError(f"{where} is serialised as {array.stype!r}, not as a .npy array")
        if array.dtype != want:
            raise UpdateError(f"{where} is {array.dtype}, the method expects {want}")
        if tuple(array.shape) != tuple(shape):
            raise UpdateError(f"{where} has shape {tuple(array.shape)}, the method expects {tuple(shape)}")
        least, most = npy_size_bounds(tuple(shape), want)
        if not least <= len(array.data) <= most:
            raise UpdateError(f"{where} is {len(array.data)} bytes, a {want} array of shape {tuple(shape)} takes "
                              f"{least} to {most}")


def _scalar_fits(value: Any, form: type) -> bool:
    """Whether ``value`` is of ``form`` (bools are no numbers; an int is a valid float)."""
    if form is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if form is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return type(value) is form


def numpy_dtype_name(dtype: torch.dtype | str | np.dtype) -> str:
    """The NumPy name (``Array.dtype``) of a torch dtype (or a NumPy dtype or name), e.g. ``"float32"``."""
    if isinstance(dtype, torch.dtype):
        try:
            return str(torch.empty(0, dtype=dtype).numpy().dtype)
        except TypeError:
            raise ConfigError(f"{dtype} has no NumPy dtype and cannot travel on Flower; declare and send "
                              "float32 (or another NumPy dtype) instead") from None
    return str(np.dtype(dtype))


@functools.lru_cache(maxsize=4096)
def npy_size_bounds(shape: tuple[int, ...], dtype: str) -> tuple[int, int]:
    """``(values, values + header)``: the bytes of a ``dtype`` array of ``shape`` without and with the
    longest ``.npy`` header NumPy writes for it (format 2.0, either memory order)."""
    numpy_dtype = np.dtype(dtype)
    values = math.prod(shape) * numpy_dtype.itemsize
    header = 0
    for fortran_order in (False, True):
        buffer = io.BytesIO()
        np.lib.format.write_array_header_2_0(buffer, {"descr": np.lib.format.dtype_to_descr(numpy_dtype),
                                                      "fortran_order": fortran_order, "shape": shape})
        header = max(header, len(buffer.getvalue()))
    return values, values + header


def encode_metrics(metrics: Mapping[str, float]) -> MetricRecord:
    """A client's training metrics (floats) as a MetricRecord."""
    return MetricRecord({name: float(value) for name, value in metrics.items()})


def decode_metrics(content: RecordDict) -> dict[str, float]:
    """A client's training metrics (``fedhpro.metrics``; none: ``{}``); UpdateError (one line) for a metric
    that is not one number (a MetricRecord may also hold lists), not finite or beyond
    :data:`~fedhpro.engines.replies.MAX_METRIC_VALUE` in magnitude, for more than :data:`MAX_METRICS` metrics, a
    name longer than :data:`MAX_METRIC_NAME` characters or names longer than :data:`MAX_METRIC_CHARS`
    together (counted before any is read: the metrics go into every round's row)."""
    record = content.metric_records.get(METRICS)
    if record is None:
        return {}
    if len(record) > MAX_METRICS:
        raise UpdateError(f"the reply holds {len(record)} training metrics, more than {MAX_METRICS}")
    metrics = {}
    chars = 0
    for name, value in record.items():
        chars += len(name)
        if len(name) > MAX_METRIC_NAME or chars > MAX_METRIC_CHARS:
            raise UpdateError(f"training metric names must be at most {MAX_METRIC_NAME} characters each and "
                              f"{MAX_METRIC_CHARS} together ({name[:40]!r}...)")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UpdateError(f"training metric '{name[:40]}' is a {type(value).__name__}, not a number")
        problem = metric_problem(name, value)  # inf, NaN, 1e308: the reply is refused whole
        if problem is not None:
            raise UpdateError(problem)
        metrics[name] = float(value)
    return metrics

