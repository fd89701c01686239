"""Typed, validated option groups.

Every group of settings (the run, a method's knobs, a data set's layout) is a
dataclass whose fields carry their checks in ``metadata``: ``choices``,
``min``/``max`` (inclusive) or ``gt`` (exclusive), ``help``, and ``search`` (where ``fedhpro tune``
may look for the knob: a :mod:`fedhpro.search_space` range). ``coerce``
turns strings from the command line or YAML into the field's type and checks
them, raising :class:`~fedhpro.errors.ConfigError` with one clear message.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Sequence
from typing import Any

from fedhpro.errors import ConfigError
from fedhpro.registry import did_you_mean
from fedhpro.search_space import SPACES

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


#: what a key's ``tags`` may say about it (key metadata declared once, with the key)
TAGS = frozenset({
    "presentation",  # changes where and how a run is shown or stored, never its numbers
    "resumable",  # a resumed run may set it to another value than the interrupted run had
    "observer",  # switches a measurement on (an observer of the in-process simulator)
})


def option(default: Any = dataclasses.MISSING, *, help: str = "", choices: Sequence[Any] | None = None,
           min: float | None = None, max: float | None = None, gt: float | None = None,
           default_factory: Any = dataclasses.MISSING, tags: Sequence[str] = (), search: Any = None,
           alias_of: str | None = None) -> Any:
    """A dataclass field with validation metadata. ``choices`` may be a live sequence (read at each use:
    :class:`fedhpro.registry.LiveChoices`); ``tags`` (of :data:`TAGS`) say what kind of key it is; ``search``
    (a :mod:`fedhpro.search_space` range) is where ``fedhpro tune`` searches it; ``alias_of`` (a method's knob
    only) names the run key this knob is the old spelling of: the config warns when the run's method has it
    off its default, and refuses it beside that run key set to another value
    (:func:`fedhpro.config.check_aliases`)."""
    unknown = set(tags) - TAGS
    if unknown:
        raise ValueError(f"unknown option tags {sorted(unknown)}; choose from {sorted(TAGS)}")
    if search is not None and not isinstance(search, SPACES):
        kinds = ", ".join(kind.__name__ for kind in SPACES)
        raise ValueError(f"search={search!r} is not a range of fedhpro.search_space ({kinds})")
    metadata = {"help": help, "choices": choices, "min": min, "max": max, "gt": gt, "tags": frozenset(tags),
                "search": search, "alias_of": alias_of}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce_scalar(key: str, value: Any, tp: Any, choices: Sequence[Any] | None = None) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, str)) and str(value).strip().lower() in _TRUE | _FALSE:
            return str(value).strip().lower() in _TRUE
        raise ConfigError(f"{key}={value!r} is not a boolean; use true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r} is not an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not a number")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} is not a number") from None
        if not math.isfinite(number):
            raise ConfigError(f"{key}={value!r} must be a finite number")
        return number
    if tp is str:
        if isinstance(value, bool):
            # YAML 1.1 reads on/off/yes/no as booleans: give back the word the user most likely wrote
            words = ("true", "on", "yes") if value else ("false", "off", "no")
            matches = [w for w in words if w in (choices or ())]
            return matches[0] if matches else words[0]
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}={value!r} must be a single word, not a {type(value).__name__}")
        return str(value)
    return value


def coerce(key: str, value: Any, field: dataclasses.Field, tp: Any) -> Any:
    """Convert ``value`` to the field type ``tp`` and check the field's limits."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and type(None) in args:
        if value is None or (isinstance(value, str) and value.strip().lower() in {"none", "null", "~", ""}):
            return None
        inner = [a for a in args if a is not type(None)]
        tp = inner[0] if len(inner) == 1 else inner
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(tp, list):  # a union like int | dict: keep the value if it fits one of them
        for candidate in tp:
            try:
                return coerce(key, value, field, candidate)
            except ConfigError:
                continue
        raise ConfigError(f"{key}={value!r} must be one of the types {[_type_name(t) for t in tp]}")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping, e.g. {key}={{a: 1, b: 2}}")
        value_type = args[1] if args else Any
        return {str(k): (_coerce_scalar(f"{key}.{k}", v, value_type) if value_type is not Any else v)
                for k, v in value.items()}
    if origin in (list, tuple):
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} must be a list, e.g. {key}=[0,1,2]")
        item_type = args[0] if args else Any
        return [(_coerce_scalar(f"{key}[{i}]", v, item_type) if item_type is not Any else v)
                for i, v in enumerate(value)]
    meta = field.metadata
    value = _coerce_scalar(key, value, tp, meta.get("choices"))
    if meta.get("choices") is not None and value not in meta["choices"]:
        choices = [str(choice) for choice in meta["choices"]]
        raise ConfigError(f"{key}={value!r} is not valid{did_you_mean(value, choices)}; choose one of: "
                          f"{', '.join(choices)}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if meta.get("min") is not None and value < meta["min"]:
            raise ConfigError(f"{key}={value!r} is too small; it must be >= {meta['min']}")
        if meta.get("max") is not None and value > meta["max"]:
            raise ConfigError(f"{key}={value!r} is too large; it must be <= {meta['max']}")
        if meta.get("gt") is not None and value <= meta["gt"]:
            raise ConfigError(f"{key}={value!r} is too small; it must be > {meta['gt']}")
    return value


def tagged(cls: type, tag: str) -> frozenset[str]:
    """The names of the fields of options ``cls`` that carry ``tag`` (:data:`TAGS`)."""
    return frozenset(f.name for f in dataclasses.fields(cls) if tag in f.metadata.get("tags", ()))


def fields_of(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """``{name: (field, resolved type)}`` of an options dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls)}


def build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    """Instantiate options ``cls`` from ``values`` (unknown names raise ConfigError)."""
    known = fields_of(cls)
    kwargs = {}
    for name, value in values.items():
        if name not in known:
            valid = ", ".join(prefix + k for k in known)
            raise ConfigError(f"unknown config key '{prefix}{name}'; valid keys: {valid}")
        field, tp = known[name]
        kwargs[name] = coerce(prefix + name, value, field, tp)
    return cls(**kwargs)


def as_dict(options: Any) -> dict[str, Any]:
    return dataclasses.asdict(options)
