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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import Tensor

from fedhpro.errors import UpdateError

#: record names this module reserves in a RecordDict (payload keys may not take them)
LAYOUT = "fedhpro.layout"
SCALARS = "fedhpro.scalars"
METRICS = "fedhpro.metrics"
RESERVED_PREFIX = "fedhpro."

_TENSOR, _TENSORS, _SCALAR = "tensor", "tensors", "scalar"


def to_array(tensor: Tensor) -> Array:
    """A tensor as a Flower Array (``.npy`` bytes: dtype, shape and bits kept)."""
    return Array.from_numpy_ndarray(tensor.detach().cpu().numpy())


def _tensor(array: Array, device: torch.device | None) -> Tensor:
    # np.load over bytes gives a read-only view; copy so that torch owns writable memory
    tensor = torch.from_numpy(np.array(array.numpy(), copy=True))
    return tensor if device is None else tensor.to(device)


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


def decode_payload(content: RecordDict, device: torch.device | str | None = None, prefix: str = "") -> dict[str, Any]:
    """The payload that :func:`encode_payload` encoded into ``content`` (same keys, order, dtypes and bits).

    Tensors that lived on an accelerator at the sender move to ``device``;
    the rest stay on the CPU, exactly as the in-process simulator hands them over.
    """
    if prefix + LAYOUT not in content.config_records:
        raise UpdateError(f"the message has no '{prefix + LAYOUT}' record; it was not sent by a fedhpro app")
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
            tensors = {name: _tensor(array, move) for name, array in record.items()}
            payload[key] = tensors[key] if kind == _TENSOR else tensors
        else:
            raise UpdateError(f"unknown payload kind {kind!r} for '{key}'")
    return payload


def encode_metrics(metrics: Mapping[str, float]) -> MetricRecord:
    """A client's training metrics (floats) as a MetricRecord."""
    return MetricRecord({name: float(value) for name, value in metrics.items()})


def decode_metrics(content: RecordDict) -> dict[str, float]:
    record = content.metric_records.get(METRICS)
    return {} if record is None else {name: float(cast(float, value)) for name, value in record.items()}


def payload_record_dict(payload: Mapping[str, Any], **extra: Any) -> RecordDict:
    """A fresh RecordDict holding ``payload`` and the ``extra`` records (one per message: see the module doc)."""
    return RecordDict({**encode_payload(payload), **extra})
