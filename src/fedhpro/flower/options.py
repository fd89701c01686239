"""The ``flower.*`` keys, declared once: how the ServerApp talks to the nodes (:class:`FlowerSettings`, SecAgg+'s
:class:`SecureSettings`), each key with its default, its help and its check (:data:`FLOWER_KEYS`). Read by
:func:`fedhpro.flower.settings.split_run_config` (a Flower run config), the app's default config table
(:func:`fedhpro.flower.settings.default_app_config_toml`) and ``fedhpro config --keys``. Torch-free, as every option
declaration (a refused ``flower.*`` value answers before torch loads)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fedhpro.errors import ConfigError

FLOWER_PREFIX = "flower."
#: the values of ``flower.secure-aggregation``
SECURE_AGGREGATION = ("none", "secagg+")
#: the largest flower.secagg-quantization-range: SecAgg+ quantizes to 32-bit integers
MAX_QUANTIZATION_RANGE = 2 ** 31 - 1


@dataclass(frozen=True)
class SecureSettings:
    """SecAgg+'s knobs (``flower.secagg-*``): the clipping range ``r`` and quantization range ``Q`` of every
    summed value, the share of the other participants each node shares its keys with, and the share of
    those needed to rebuild a dropped node's masks (SecAgg+'s threshold, at least 2 nodes)."""

    clipping_range: float = 64.0
    quantization_range: int = 2 ** 30
    shares: float = 1.0
    threshold: float = 0.5

    @property
    def step(self) -> float:
        """The quantization step ``2r / Q``: each client's value is off by less than this in the sum."""
        return 2.0 * self.clipping_range / self.quantization_range

    def modulus(self, participants: int) -> int:
        """The mask modulus: a power of two above ``participants * Q`` (the sum must not wrap)."""
        return 2 ** max(32, (participants * self.quantization_range).bit_length())


@dataclass(frozen=True)
class FlowerSettings:
    """How the ServerApp talks to the nodes (not part of what the experiment computes)."""

    node_wait: float = 600.0  # seconds until every partition's node must have connected (Ray + torch start slowly)
    #: seconds to wait for one round's replies; None (unset, "auto"): sized from the run by the ServerApp once it
    #: knows the clients (:func:`fedhpro.flower.strategy.round_timeout`), which hands the number on
    round_timeout: float | None = None
    node_auth: bool = False  # the SuperLink authenticates SuperNodes: a returning node must show its client's key
    secure_aggregation: str = "none"  # "secagg+": the server learns only the sum of the uploads
    secagg: SecureSettings = SecureSettings()
    roster: str | None = None  # own data: the operator's roster file of sites (fedhpro.flower.roster)
    min_clients: int | None = None  # own data: the fewest admitted nodes a run goes on with (None: auto)


def _seconds(key: str, raw: object, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{key}={raw!r} must be a number of seconds > 0")
    return float(value)


def _round_timeout(key: str, raw: object, value: object) -> float | None:
    return None if value is None or value == "auto" else _seconds(key, raw, value)


def _node_auth(key: str, raw: object, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={raw!r} must be true or false")
    return value


def _secure_aggregation(key: str, raw: object, value: object) -> str:
    if value not in SECURE_AGGREGATION:
        raise ConfigError(f"{key}={raw!r} must be one of {', '.join(SECURE_AGGREGATION)}")
    return str(value)


def _roster(key: str, raw: object, value: object) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(f"{key}={raw!r} must be the path of the roster file on the SuperLink host")
    return value


def _min_clients(key: str, raw: object, value: object) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{key}={raw!r} must be a whole number of SuperNodes >= 1 (or \"\" for "
                          "those the run waits for less the ones refused, at least 2)")
    return value


def _number(key: str, raw: object, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{key}={raw!r} must be a number")
    return float(value)


def _clipping_range(key: str, raw: object, value: object) -> float:
    number = _number(key, raw, value)
    if number <= 0:
        raise ConfigError(f"{key}={raw!r} must be > 0")
    return number


def _quantization_range(key: str, raw: object, value: object) -> int:
    number = _number(key, raw, value)
    if number != int(number) or not 2 ** 8 <= number <= MAX_QUANTIZATION_RANGE:
        raise ConfigError(f"{key}={raw!r} must be a whole number in [256, {MAX_QUANTIZATION_RANGE}]")
    return int(number)


def _share(key: str, raw: object, value: object) -> float:
    number = _number(key, raw, value)
    if not 0 < number <= 1:
        raise ConfigError(f"{key}={raw!r} must be a share in (0, 1]")
    return number


@dataclass(frozen=True)
class FlowerKey:
    """One ``flower.*`` key: the :class:`FlowerSettings` field it sets (``secagg``: of its
    :class:`SecureSettings`), what the app's table declares (``""``: unset), its help, and ``read(key, raw,
    value)``: the setting from the value as read, or a one-line ConfigError."""

    key: str
    field: str
    declared: str
    help: str
    read: Callable[[str, object, object], object]
    secagg: bool = False


_SECURE = SecureSettings()
#: every ``flower.*`` key, in the order the app's table declares them
FLOWER_KEYS: tuple[FlowerKey, ...] = (
    FlowerKey("flower.node-wait", "node_wait", repr(FlowerSettings.node_wait),
              "seconds to wait for the SuperNodes", _seconds),
    FlowerKey("flower.round-timeout", "round_timeout", '""',
              "seconds to wait for a round's replies; \"\": auto, sized from the run", _round_timeout),
    FlowerKey("flower.min-clients", "min_clients", '""',
              "own data: fewest admitted nodes to go on with; \"\": auto", _min_clients),
    FlowerKey("flower.node-auth", "node_auth", "false",
              "true: the SuperLink runs with --enable-supernode-auth (keys checked)", _node_auth),
    FlowerKey("flower.roster", "roster", '""',
              "own data: the operator's roster file of sites (names, sizes, keys)", _roster),
    FlowerKey("flower.secure-aggregation", "secure_aggregation", '"none"',
              "\"secagg+\": Flower's SecAgg+, the server learns only sums", _secure_aggregation),
    FlowerKey("flower.secagg-clipping-range", "clipping_range", repr(_SECURE.clipping_range),
              "every summed value lies within it", _clipping_range, secagg=True),
    FlowerKey("flower.secagg-quantization-range", "quantization_range", repr(_SECURE.quantization_range),
              "integers per summed value", _quantization_range, secagg=True),
    FlowerKey("flower.secagg-shares", "shares", repr(_SECURE.shares),
              "share of the participants a node shares keys with", _share, secagg=True),
    FlowerKey("flower.secagg-threshold", "threshold", repr(_SECURE.threshold),
              "share of those needed to recover a dropout", _share, secagg=True),
)
_BY_KEY = {entry.key: entry for entry in FLOWER_KEYS}


def flower_settings(values: Mapping[str, tuple[object, object]]) -> FlowerSettings:
    """The settings of ``{key: (raw, value)}`` (the ``flower.*`` keys of a run config, each as given and as read);
    a one-line ConfigError for an unknown key or a bad value."""
    flower: dict[str, Any] = {}
    secure: dict[str, Any] = {}
    for key, (raw, value) in values.items():
        entry = _BY_KEY.get(key)
        if entry is None:
            raise ConfigError(f"unknown Flower setting '{key}'; valid: {', '.join(_BY_KEY)}")
        (secure if entry.secagg else flower)[entry.field] = entry.read(key, raw, value)
    return FlowerSettings(**flower, secagg=SecureSettings(**secure))


def key_lines() -> list[str]:
    """``key: help (default: value)`` of every ``flower.*`` key, as ``fedhpro config --keys`` lists keys."""
    defaults = FlowerSettings()
    lines = []
    for entry in FLOWER_KEYS:
        value = getattr(defaults.secagg if entry.secagg else defaults, entry.field)
        shown = "unset" if value is None else str(value).lower() if isinstance(value, bool) else value
        lines.append(f"{entry.key}: Flower only: {entry.help} (default: {shown})")
    return lines


__all__ = ["FLOWER_KEYS", "FLOWER_PREFIX", "FlowerKey", "FlowerSettings", "MAX_QUANTIZATION_RANGE",
           "SECURE_AGGREGATION", "SecureSettings", "flower_settings", "key_lines"]
