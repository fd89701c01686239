"""Flower's ``run_config`` -> a fedhpro :class:`~fedhpro.config.Config`, and the app's default config table.

Flower's run config is flat, with dotted keys (``fedhpro.tau``) and TOML
values (int, float, bool, str). Every fedhpro config key is accepted under its
own name (``resume=<out folder>`` too: the ServerApp continues that run from
its newest checkpoint). Values are taken as they come, except:

* strings are read like the CLI's ``KEY=VALUE`` (as YAML): ``"[0, 1]"`` is a list,
  ``"null"`` is None; a string that is not valid YAML is kept as it is;
* the empty string ``""`` means "the default" (TOML has no null: the app's
  ``pyproject.toml`` declares ``clients = ""`` etc. for keys whose default is None).

Keys under ``flower.`` configure the Flower layer itself, not the experiment:
``flower.node-wait`` (seconds the ServerApp waits for the nodes to connect),
``flower.round-timeout`` (seconds it waits for the replies of one round; unset or ``auto``: sized from
the run, :func:`auto_round_timeout`), ``flower.min-clients`` (own data: the fewest admitted nodes a run
goes on with once ``flower.node-wait`` has passed without all of them; unset: those it waited for less
the ones refused, at least 2, :func:`fedhpro.flower.nodes.needed_nodes`) and
``flower.node-auth`` (true: the SuperLink authenticates its SuperNodes,
``--enable-supernode-auth``, so a node's public key is its identity: a node
that comes back with a new node id takes its client back only with the key
that client's node had at the start). ``flower.roster`` (own-data runs): the
path, on the SuperLink host, of the operator's roster of sites
(:mod:`fedhpro.flower.roster`): only nodes whose name, sizes and key agree
with it take part.

``flower.secure-aggregation=secagg+`` sums the clients' uploads with Flower's SecAgg+ (the server
learns only the sum; :mod:`fedhpro.flower.secagg`), tuned by ``flower.secagg-clipping-range`` (every
summed value must lie within it), ``flower.secagg-quantization-range`` (integers each value is
quantized to), ``flower.secagg-shares`` (the share of the other participants a node shares its keys
with) and ``flower.secagg-threshold`` (the share of those needed to recover a node that dropped out).

One default differs from ``fedhpro run``'s: unless the run sets
``checkpoint_every``, a Flower run writes a checkpoint after every round
(:data:`FLOWER_CHECKPOINT_EVERY`): a SuperLink or ServerApp killed mid-run
is then resumed from the last completed round. The run's ``config.yaml``
records the value used.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from fedhpro.bounded import LimitError, load_yaml
from fedhpro.config import OBSERVER_KEYS, Config, load_config
from fedhpro.data import DATASETS, get_dataset
from fedhpro.errors import ConfigError

FLOWER_PREFIX = "flower."


#: the values of ``flower.secure-aggregation``
SECURE_AGGREGATION = ("none", "secagg+")


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


#: ``flower.round-timeout`` unset (``auto``): a round waits ``SECONDS_PER_BATCH`` for every local batch of the
#: largest (capped) client times the clients asked in a round (Flower's simulation runs them on one machine),
#: within [floor, ceiling]: the floor leaves a node time to start (torch, its data, its models), the ceiling
#: is the old fixed default
SECONDS_PER_BATCH = 2.0
ROUND_TIMEOUT_FLOOR = 300.0
ROUND_TIMEOUT_CEILING = 3600.0


def auto_round_timeout(local_epochs: int, batch_size: int, largest: int, participants: int) -> float:
    """The ``auto`` round timeout in seconds: ``SECONDS_PER_BATCH * local_epochs * ceil(largest / batch_size)
    * participants``, within ``[ROUND_TIMEOUT_FLOOR, ROUND_TIMEOUT_CEILING]``. ``largest``: the largest
    training set of a client as it weighs (declared sizes capped by ``aggregation.max_share``: a claim buys no
    longer wait than the ceiling), ``participants``: the clients asked in a round."""
    batches = math.ceil(max(0, largest) / max(1, batch_size))
    wanted = SECONDS_PER_BATCH * max(1, local_epochs) * batches * max(1, participants)
    return min(ROUND_TIMEOUT_CEILING, max(ROUND_TIMEOUT_FLOOR, wanted))


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


_FLOWER_KEYS = {"flower.node-wait": "node_wait", "flower.round-timeout": "round_timeout",
                "flower.node-auth": "node_auth", "flower.secure-aggregation": "secure_aggregation",
                "flower.secagg-clipping-range": "clipping_range", "flower.secagg-quantization-range":
                "quantization_range", "flower.secagg-shares": "shares", "flower.secagg-threshold": "threshold",
                "flower.roster": "roster", "flower.min-clients": "min_clients"}
#: the largest flower.secagg-quantization-range: SecAgg+ quantizes to 32-bit integers
MAX_QUANTIZATION_RANGE = 2 ** 31 - 1
#: ``checkpoint_every`` of a Flower run that does not set it: a checkpoint after every round, so that a run
#: whose SuperLink or ServerApp dies can be resumed (``fedhpro run``'s default, 5, would lose up to 4 rounds
#: and leave nothing to resume before round 5)
FLOWER_CHECKPOINT_EVERY = 1

#: opt-in measurements that only the in-process simulator takes (they observe its internals)
SIMULATOR_ONLY = OBSERVER_KEYS


def _value(raw: Any) -> Any:
    if isinstance(raw, str):
        if raw == "":
            return None
        try:
            return load_yaml(raw)
        except LimitError:  # past a bound (a billion laughs): one line, never kept as text
            raise
        except (yaml.YAMLError, ValueError, OverflowError, RecursionError):  # text YAML cannot read stays text
            return raw
    return raw


def split_run_config(run_config: Mapping[str, Any]) -> tuple[dict[str, Any], FlowerSettings]:
    """``(fedhpro overrides, FlowerSettings)`` from a Flower run config; raises ConfigError on a bad value."""
    overrides: dict[str, Any] = {}
    flower: dict[str, Any] = {}
    secure: dict[str, Any] = {}
    for key, raw in run_config.items():
        if key.startswith(FLOWER_PREFIX):
            if key not in _FLOWER_KEYS:
                raise ConfigError(f"unknown Flower setting '{key}'; valid: {', '.join(_FLOWER_KEYS)}")
            value = _value(raw)
            if key == "flower.node-auth":
                if not isinstance(value, bool):
                    raise ConfigError(f"{key}={raw!r} must be true or false")
                flower["node_auth"] = value
                continue
            if key == "flower.secure-aggregation":
                if value not in SECURE_AGGREGATION:
                    raise ConfigError(f"{key}={raw!r} must be one of {', '.join(SECURE_AGGREGATION)}")
                flower["secure_aggregation"] = value
                continue
            if key == "flower.roster":
                if value is not None and (not isinstance(value, str) or not value.strip()):
                    raise ConfigError(f"{key}={raw!r} must be the path of the roster file on the SuperLink host")
                flower["roster"] = value
                continue
            if key == "flower.min-clients":
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    raise ConfigError(f"{key}={raw!r} must be a whole number of SuperNodes >= 1 (or \"\" for "
                                      "those the run waits for less the ones refused, at least 2)")
                flower["min_clients"] = value
                continue
            if key == "flower.round-timeout" and (value is None or value == "auto"):
                flower["round_timeout"] = None
                continue
            if key.startswith("flower.secagg-"):
                secure[_FLOWER_KEYS[key]] = _secagg_value(key, raw, value)
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{key}={raw!r} must be a number of seconds > 0")
            flower[_FLOWER_KEYS[key]] = float(value)
            continue
        value = _value(raw)
        if value is None:
            continue  # "" = the default
        overrides[key] = value
    return overrides, FlowerSettings(**flower, secagg=SecureSettings(**secure))


def _secagg_value(key: str, raw: Any, value: Any) -> float | int:
    """A ``flower.secagg-*`` value within its bounds; ConfigError (one line) otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{key}={raw!r} must be a number")
    if key == "flower.secagg-quantization-range":
        if value != int(value) or not 2 ** 8 <= value <= MAX_QUANTIZATION_RANGE:
            raise ConfigError(f"{key}={raw!r} must be a whole number in [256, {MAX_QUANTIZATION_RANGE}]")
        return int(value)
    if key == "flower.secagg-clipping-range":
        if value <= 0:
            raise ConfigError(f"{key}={raw!r} must be > 0")
        return float(value)
    if not 0 < value <= 1:
        raise ConfigError(f"{key}={raw!r} must be a share in (0, 1]")
    return float(value)


def experiment_keys(settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """``settings`` without the ``flower.*`` keys (what configures the experiment itself)."""
    return {key: value for key, value in (settings or {}).items() if not key.startswith(FLOWER_PREFIX)}


def config_from_run_config(run_config: Mapping[str, Any], base: Mapping[str, Any] | None = None
                           ) -> tuple[Config, FlowerSettings]:
    """The fedhpro Config of a run: the defaults, then ``base`` (the app's own settings), then ``run_config``.

    An empty ``run_config`` (as ``flwr.simulation.run_simulation`` passes) gives
    the defaults plus ``base`` (and :data:`FLOWER_CHECKPOINT_EVERY` unless either sets
    ``checkpoint_every``). ``base`` may hold ``flower.*`` settings too (``run_config``'s win).
    Every key error is a one-line ConfigError.
    """
    base, flower_base = experiment_keys(base), {key: value for key, value in (base or {}).items()
                                                 if key.startswith(FLOWER_PREFIX)}
    overrides, flower = split_run_config({**flower_base, **run_config})
    config = load_config(base, overrides)
    if "checkpoint_every" not in config.given:  # Flower's own default (see the module doc), not the user's
        config = config.updated({"checkpoint_every": FLOWER_CHECKPOINT_EVERY})
    for name in SIMULATOR_ONLY:
        value = getattr(config.run, name, False)
        if value and value != "none":  # a switch, or tracker= naming a tracker
            shown = "true" if value is True else value
            raise ConfigError(f"{name}={shown} is measured only by the in-process simulator (fedhpro run); "
                              f"drop it on Flower")
    return config, flower


def default_app_config_toml() -> str:
    """The ``[tool.flwr.app.config]`` table that declares every fedhpro config key.

    ``flwr run --run-config`` only accepts keys the app declares, so the example
    app's ``pyproject.toml`` carries this table (a test checks that it is
    current). Every key is declared as ``""`` (= fedhpro's default, shown in the
    comment), so the app's table never shadows a default and a value given with
    ``--run-config`` is the only thing that changes the experiment. Mapping-valued
    keys (``data.clients_per_domain``) are also declared entry by entry
    (``data.clients_per_domain.mnist``), the config layer's way of setting one entry.
    """
    defaults: dict[str, Any] = dict(dataclasses.asdict(load_config(None).run))
    defaults["checkpoint_every"] = FLOWER_CHECKPOINT_EVERY  # what "" gives on Flower
    defaults_config = load_config(None)
    # every section, privacy too (config.yaml leaves it out while it is off, the app must still declare it)
    sections = {**defaults_config.to_dict(), "privacy": dataclasses.asdict(defaults_config.privacy)}
    for section, values in sections.items():
        if isinstance(values, Mapping) and section not in ("data",):
            defaults.update({f"{section}.{knob}": value for knob, value in values.items()})
    for name in DATASETS:  # every data set's layout options (a run uses those of its dataset=)
        for field in dataclasses.fields(get_dataset(name).options):
            defaults.setdefault(f"data.{field.name}", dataclasses.asdict(get_dataset(name).options())[field.name])
    lines = ["[tool.flwr.app.config]",
             '# Every fedhpro config key; "" means fedhpro\'s default (in the comment). Set values with',
             "# flwr run ... --run-config 'rounds=5 method=\"moon\" fedhpro.tau=0.1'"]
    for key, value in defaults.items():
        lines.append(f'"{key}" = ""  # {_comment(value)}')
        if isinstance(value, Mapping):
            lines += [f'"{key}.{item}" = ""  # {_comment(inner)}' for item, inner in value.items()]
    lines.append(f'"flower.node-wait" = {FlowerSettings.node_wait!r}  # seconds to wait for the SuperNodes')
    lines.append('"flower.round-timeout" = ""  # seconds to wait for a round\'s replies; "": auto, sized from the run')
    lines.append('"flower.min-clients" = ""  # own data: fewest admitted nodes to go on with; "": auto')
    lines.append('"flower.node-auth" = false  # true: the SuperLink runs with --enable-supernode-auth (keys checked)')
    lines.append('"flower.roster" = ""  # own data: the operator\'s roster file of sites (names, sizes, keys)')
    secure = SecureSettings()
    lines.append('"flower.secure-aggregation" = "none"  # "secagg+": Flower\'s SecAgg+, the server learns only sums')
    lines.append(f'"flower.secagg-clipping-range" = {secure.clipping_range!r}  # every summed value lies within it')
    lines.append(f'"flower.secagg-quantization-range" = {secure.quantization_range!r}  # integers per summed value')
    lines.append(f'"flower.secagg-shares" = {secure.shares!r}  # share of the participants a node shares keys with')
    lines.append(f'"flower.secagg-threshold" = {secure.threshold!r}  # share of those needed to recover a dropout')
    return "\n".join(lines) + "\n"


def _comment(value: Any) -> str:
    return "default: " + yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()


APP_PYPROJECT_HEAD = '''# A Flower app running fedhpro (any method) with `flwr run`.
# Generated by `python -m fedhpro.flower new-app DIR`; regenerate it after adding config keys.
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedhpro-flower"
version = "0.1.0"
description = "fedhpro methods on Flower"
license = "Apache-2.0"
# installed beforehand in the environment of the SuperLink/SuperNodes (pip install "fedhpro[flower]");
# start the SuperLink with --disable-runtime-dependency-installation so that flwr does not reinstall them
dependencies = ["flwr[simulation]==1.42.*"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedhpro"

[tool.flwr.app.components]
serverapp = "fedhpro.flower.server:app"
clientapp = "fedhpro.flower.client:app"

'''


def app_pyproject_toml() -> str:
    """The whole ``pyproject.toml`` of a Flower app running fedhpro (``examples/flower/pyproject.toml``)."""
    return APP_PYPROJECT_HEAD + default_app_config_toml()
