"""What a SuperNode may say about itself, checked before the server uses a word of it.

A node answers the server's queries with one ConfigRecord: which partition it holds (partition mode),
a description of its own folder (own-data mode: :class:`~fedhpro.data.clients.ClientInfo`, as JSON) or
its evaluation counts. Each answer is refused, in one line (UpdateError), unless it holds exactly the
expected entries, each of its type and within the bounds below; :mod:`fedhpro.flower.nodes` then
refuses the node, not the run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from flwr.app import ConfigRecord

from fedhpro.bounded import LimitError, load_json
from fedhpro.config import Config
from fedhpro.data.clients import ClientInfo
from fedhpro.data.feature_statistics import FeatureSums, sums_from_json
from fedhpro.engines.evaluation import TestCount
from fedhpro.errors import UpdateError
from fedhpro.flower.records import EVAL_RECORD, NODE_RECORD

#: bounds on what a node may say about itself (a node's answer is refused beyond them: see :func:`client_info`)
MAX_NAME = 128  # characters of a client's name or domain
MAX_CLASS_NAME = 256  # characters of one class name
MAX_INPUT_DIMS = 4  # dimensions of one input (images: 3 x S x S)
MAX_INPUT_VALUES = 2 ** 28  # values in one input
MAX_SAMPLES = 10 ** 9  # training or test samples of one client
MAX_CLIENTS = 100_000  # num-partitions a node may name
MAX_INFO_CHARS = 16 * 2 ** 20  # characters of a node's JSON description (read before it is parsed)
#: the entries of a node's answer to the data query that carry its feature sums (data.standardize=federated)
SUMS_KEYS = ("feature-count", "feature-sum", "feature-sum-squares")
#: what a node holding its own data may be: image folders or tensor files (fedhpro.data.clients)
CLIENT_KINDS = ("images", "tensors")


def _integer(value: Any, what: str, least: int, most: int) -> int:
    """``value`` as an int in ``[least, most]`` (a whole-number float passes, a bool does not); UpdateError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UpdateError(f"{what} is a {type(value).__name__}, not a whole number")
    if isinstance(value, float) and (not math.isfinite(value) or value != math.floor(value)):
        raise UpdateError(f"{what}={value!r} is not a whole number")
    if not least <= value <= most:
        raise UpdateError(f"{what}={int(value)} is not in [{least}, {most}]")
    return int(value)


def _text(value: Any, what: str, most: int) -> str:
    """``value`` as a short printable string without path separators; UpdateError otherwise."""
    if not isinstance(value, str):
        raise UpdateError(f"{what} is a {type(value).__name__}, not a string")
    if not 1 <= len(value) <= most:
        raise UpdateError(f"{what} has {len(value)} characters, not 1 to {most}")
    if not value.isprintable() or "/" in value or "\\" in value or value in (".", ".."):
        raise UpdateError(f"{what} {value[:40]!r} holds a character that is not printable or a path separator")
    return value


def _names(value: Any, what: str, most: int) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise UpdateError(f"{what} is a {type(value).__name__}, not a list of class names")
    if len(value) > most:
        raise UpdateError(f"{what} names {len(value)} classes, more than data.max_classes={most}")
    return [_text(name, f"a class name in {what}", MAX_CLASS_NAME) for name in value]


def _answer(record: ConfigRecord | None, keys: tuple[str, ...]) -> ConfigRecord:
    """The node's answer record holding exactly ``keys``; UpdateError naming what is wrong."""
    if record is None:
        raise UpdateError(f"its reply holds no ConfigRecord '{NODE_RECORD}'")
    if set(record) != set(keys):
        extra = sorted(set(record) - set(keys))
        missing = sorted(set(keys) - set(record))
        raise UpdateError(f"its answer holds {sorted(record)[:8]}, not {list(keys)}"
                          f"{f' (unknown: {extra[:4]})' if extra else ''}{f' (missing: {missing})' if missing else ''}")
    return record


def partition_answer(record: ConfigRecord | None) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` from a node's answer to the partition query; UpdateError (one
    line) unless it holds exactly those two whole numbers with ``0 <= partition-id < num-partitions``."""
    answer = _answer(record, ("partition-id", "num-partitions"))
    count = _integer(answer["num-partitions"], "num-partitions", 1, MAX_CLIENTS)
    return _integer(answer["partition-id"], "partition-id", 0, count - 1), count


def client_info(record: ConfigRecord | None, max_classes: int) -> Any:
    """The :class:`~fedhpro.data.clients.ClientInfo` a node's answer to the data query describes; UpdateError
    (one line) unless it is a JSON object of at most :data:`MAX_INFO_CHARS` characters holding exactly the
    ClientInfo fields, each of its type and within its bounds: a short printable name and domain, a known
    kind, at most ``max_classes`` class names (each at most :data:`MAX_CLASS_NAME` characters), ``max_label``
    below ``max_classes``, an input shape of 1 to :data:`MAX_INPUT_DIMS` positive sizes and sizes up to
    :data:`MAX_SAMPLES`. Nothing of it is used before it passed."""
    sums = record is not None and any(key in record for key in SUMS_KEYS)
    text = _answer(record, ("info", *SUMS_KEYS) if sums else ("info",))["info"]
    if not isinstance(text, str):
        raise UpdateError(f"its description is a {type(text).__name__}, not JSON text")
    if len(text) > MAX_INFO_CHARS:
        raise UpdateError(f"its description has {len(text)} characters, more than {MAX_INFO_CHARS}")
    try:
        values = load_json(text, "its description", max_chars=MAX_INFO_CHARS, max_depth=8, allow_nan=False)
    except LimitError as error:
        raise UpdateError(str(error)) from None
    except (ValueError, RecursionError) as error:  # JSONDecodeError, a number too long to convert, NaN
        raise UpdateError(f"its description is not valid JSON ({type(error).__name__})") from None
    fields = [field.name for field in dataclasses.fields(ClientInfo)]
    if not isinstance(values, dict) or set(values) != set(fields):
        held = sorted(map(str, values))[:8] if isinstance(values, dict) else type(values).__name__
        raise UpdateError(f"its description holds {held}, not the fields {fields}")
    if values["kind"] not in CLIENT_KINDS:
        raise UpdateError(f"its kind {str(values['kind'])[:40]!r} is not one of {list(CLIENT_KINDS)}")
    shape = values["input_shape"]
    if not isinstance(shape, list) or not 1 <= len(shape) <= MAX_INPUT_DIMS:
        raise UpdateError(f"its input_shape is not a list of 1 to {MAX_INPUT_DIMS} sizes")
    shape = [_integer(side, "an input_shape size", 1, MAX_INPUT_VALUES) for side in shape]
    if math.prod(shape) > MAX_INPUT_VALUES:
        raise UpdateError(f"its input_shape {shape} holds more than {MAX_INPUT_VALUES} values")
    return ClientInfo(
        name=_text(values["name"], "its name", MAX_NAME),
        domain=None if values["domain"] is None else _text(values["domain"], "its domain", MAX_NAME),
        kind=values["kind"],
        class_names=_names(values["class_names"], "class_names", max_classes),
        declared_classes=_names(values["declared_classes"], "declared_classes", max_classes),
        max_label=None if values["max_label"] is None else _integer(values["max_label"], "max_label", 0,
                                                                    max_classes - 1),
        input_shape=shape,
        train_size=_integer(values["train_size"], "train_size", 0, MAX_SAMPLES),
        test_size=_integer(values["test_size"], "test_size", 0, MAX_SAMPLES),
        train_classes=_names(values["train_classes"], "train_classes", max_classes),
        test_classes=_names(values["test_classes"], "test_classes", max_classes))


def sums_answer(record: ConfigRecord | None, features: int) -> FeatureSums | None:
    """The feature sums a node's answer to the data query carries (``data.standardize=federated``), checked
    for form (:func:`~fedhpro.data.feature_statistics.sums_from_json`: a count >= 1 and ``features`` numbers
    each for the sum and the sum of squares); None when it carries none. UpdateError (one line) otherwise;
    whether the numbers can be those of rows is :func:`~fedhpro.data.feature_statistics.sums_problem`'s."""
    if record is None or not any(key in record for key in SUMS_KEYS):
        return None
    count, total, squares = (record.get(key) for key in SUMS_KEYS)
    try:
        return sums_from_json({"count": count, "sum": total, "sum_squares": squares}, features)
    except ValueError as error:
        raise UpdateError(str(error)) from None


def sums_entries(sums: FeatureSums) -> dict[str, Any]:
    """The answer's entries carrying ``sums`` (float64 values: a ConfigRecord keeps them exactly)."""
    return dict(zip(SUMS_KEYS, (sums.count, sums.sum.tolist(), sums.sum_squares.tolist()), strict=True))


def max_classes(config: Config) -> int:
    """``data.max_classes`` of the run (the most classes a federation may have)."""
    return int(getattr(config.data, "max_classes", 100_000))


def eval_count(record: ConfigRecord | None, expected: tuple[str, int]) -> TestCount:
    """A node's evaluation answer as a :class:`TestCount`; UpdateError (one line) unless it holds exactly
    ``test-set``, ``correct`` and ``total`` with the test set and size ``expected`` for its client (what it
    declared at discovery, or the server's own copy in partition mode) and ``0 <= correct <= total``."""
    if record is None:
        raise UpdateError(f"its reply holds no ConfigRecord '{EVAL_RECORD}'")
    keys = ("test-set", "correct", "total")
    if set(record) != set(keys):
        raise UpdateError(f"its answer holds {sorted(record)[:8]}, not {list(keys)}")
    name, size = expected
    if record["test-set"] != name:
        raise UpdateError(f"it names the test set {str(record['test-set'])[:40]!r}, not its own {name!r}")
    total = _integer(record["total"], "total", size, size)
    return TestCount(name, _integer(record["correct"], "correct", 0, total), total)

