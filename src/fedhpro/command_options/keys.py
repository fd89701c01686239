"""How a command's own keys are declared, read and listed: the ``KEY=VALUE`` settings a command (``fedhpro
compare``, ``tune``, ``report``, ``reproduce``) takes for itself, apart from the run keys it hands to its runs.

A command's keys are the fields of an options dataclass, each declared with :func:`command_option`: the checks of
:func:`fedhpro.options.option` (type, ``choices``, ``min``/``max``/``gt``, ``help``, default), plus ``key``, the
spelling on the command line where it is not the field's name (``ray.address``), and ``refuse``, what a refused
value is told after ``KEY=VALUE`` where the check's own words would say less (the fix, with an example).
:func:`take` moves a command's keys out of its command-line pairs, checked, into its options; the pairs left are
the run keys. :func:`key_lines` lists them as ``fedhpro config --keys`` does.

Torch-free, as every option declaration: a refused command key answers before torch loads.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

from fedhpro.errors import ConfigError
from fedhpro.options import coerce, fields_of, option


def command_option(default: Any = dataclasses.MISSING, *, key: str | None = None, refuse: str = "",
                   default_factory: Any = dataclasses.MISSING, **checks: Any) -> Any:
    """A command key: :func:`fedhpro.options.option` with ``key`` (its spelling on the command line; None: the
    field's name) and ``refuse`` (said after ``KEY=VALUE`` when the value is refused; empty: the check's own
    message)."""
    declared = option(default, default_factory=default_factory, **checks)
    metadata = {**declared.metadata, "key": key, "refuse": refuse}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def key_of(field: dataclasses.Field) -> str:
    """A command key as it is typed: its declared ``key``, else the field's name."""
    return field.metadata.get("key") or field.name


def as_list(value: Any, key: str) -> list[str]:
    """A list-valued ``key=`` setting as strings: ``"a,b"``, ``"[a,b]"`` or a YAML list; a ConfigError if empty."""
    if isinstance(value, str):
        items = [item.strip() for item in value.strip("[]").split(",") if item.strip()]
    elif isinstance(value, (list, tuple)):
        items = [str(item) for item in value]
    else:
        items = [str(value)]
    if not items:
        raise ConfigError(f"{key} is empty; give e.g. {key}=[a,b]")
    return items


def _is_list(tp: Any) -> bool:
    """Whether a field of type ``tp`` (``list[int]``, ``list[str] | None``) takes a list."""
    if typing.get_origin(tp) in (list, tuple):
        return True
    return any(typing.get_origin(arg) in (list, tuple) for arg in typing.get_args(tp) if arg is not type(None))


def read(cls: type, values: dict[str, Any]) -> Any:
    """Options ``cls`` from ``{key: value}`` (keys as typed, all of them ``cls``'s), each value checked: one
    ConfigError line naming the key and the fix for a bad one."""
    fields = {key_of(field): (field, tp) for field, tp in fields_of(cls).values()}
    kwargs = {}
    for key, raw in values.items():
        field, tp = fields[key]
        value = as_list(raw, key) if _is_list(tp) and raw is not None else raw  # its own line for an empty list
        try:
            kwargs[field.name] = coerce(key, value, field, tp)
        except ConfigError:
            if not field.metadata.get("refuse"):
                raise
            raise ConfigError(f"{key}={value!r} {field.metadata['refuse']}") from None
    return cls(**kwargs)


def take(cls: type, pairs: dict[str, Any]) -> Any:
    """Options ``cls`` of the command keys in ``pairs`` (command-line ``KEY=VALUE`` pairs), which are removed from
    ``pairs``: what stays there is the run keys the command hands on."""
    keys = [key_of(field) for field in dataclasses.fields(cls)]
    return read(cls, {key: pairs.pop(key) for key in keys if key in pairs})


def shown(value: Any) -> str:
    """A default as it is typed on the command line (``true``, ``[0, 1, 2]``, ``runs/compare``); ``unset`` for
    None, as the ``flower.*`` keys show theirs."""
    if value is None:
        return "unset"
    return value if isinstance(value, str) else json.dumps(value)


def defaults_of(cls: type) -> dict[str, Any]:
    """``{key: default}`` of options ``cls``, keys as typed."""
    made = cls()
    return {key_of(field): getattr(made, field.name) for field in dataclasses.fields(cls)}


def key_lines(command: str, cls: type) -> list[str]:
    """``command: key [choices]: help (default: value)`` of every key of options ``cls``, as ``fedhpro config
    --keys`` lists keys."""
    defaults = defaults_of(cls)
    lines = []
    for field in dataclasses.fields(cls):
        key = key_of(field)
        choices = field.metadata.get("choices")
        extra = f" [{'|'.join(map(str, choices))}]" if choices else ""
        lines.append(f"{command}: {key}{extra}: {field.metadata.get('help', '')} (default: {shown(defaults[key])})")
    return lines
