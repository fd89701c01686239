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
from typing import Any

import yaml

from fedhpro.bounded import LimitError, load_yaml
from fedhpro.config import OBSERVER_KEYS, Config, load_config
from fedhpro.data import DATASETS, declared_dataset
from fedhpro.errors import ConfigError
from fedhpro.flower.options import (  # noqa: F401 (FLOWER_PREFIX, MAX_QUANTIZATION_RANGE, SECURE_AGGREGATION: kept importable here)
    FLOWER_KEYS,
    FLOWER_PREFIX,
    MAX_QUANTIZATION_RANGE,
    SECURE_AGGREGATION,
    FlowerSettings,
    SecureSettings,
    flower_settings,
)

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
    """``(fedhpro overrides, FlowerSettings)`` from a Flower run config; raises ConfigError on a bad value (the
    ``flower.*`` keys as :data:`fedhpro.flower.options.FLOWER_KEYS` declares them)."""
    overrides: dict[str, Any] = {}
    flower: dict[str, tuple[Any, Any]] = {}
    for key, raw in run_config.items():
        value = _value(raw)
        if key.startswith(FLOWER_PREFIX):
            flower[key] = (raw, value)
        elif value is not None:  # "" = the default
            overrides[key] = value
    return overrides, flower_settings(flower)


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
    # every section, privacy too (config.yaml leaves it out while it is off, the app must still declare it), and
    # every robust rule's knobs (config.yaml leaves out those of a later rule the run does not choose)
    sections = {**defaults_config.to_dict(), "privacy": dataclasses.asdict(defaults_config.privacy),
                "aggregation": dataclasses.asdict(defaults_config.aggregation)}
    for section, values in sections.items():
        if isinstance(values, Mapping) and section not in ("data",):
            defaults.update({f"{section}.{knob}": value for knob, value in values.items()})
    for name in DATASETS:  # every data set's layout options (a run uses those of its dataset=)
        options = declared_dataset(name).options
        for field in dataclasses.fields(options):
            defaults.setdefault(f"data.{field.name}", dataclasses.asdict(options())[field.name])
    lines = ["[tool.flwr.app.config]",
             '# Every fedhpro config key; "" means fedhpro\'s default (in the comment). Set values with',
             "# flwr run ... --run-config 'rounds=5 method=\"moon\" fedhpro.tau=0.1'"]
    for key, value in defaults.items():
        lines.append(f'"{key}" = ""  # {_comment(value)}')
        if isinstance(value, Mapping):
            lines += [f'"{key}.{item}" = ""  # {_comment(inner)}' for item, inner in value.items()]
    lines += [f'"{entry.key}" = {entry.declared}  # {entry.help}' for entry in FLOWER_KEYS]
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
