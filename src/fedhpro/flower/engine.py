"""What the ServerApp and every ClientApp build from a Config: the in-process engine, as a reference.

Each Flower node (the ServerApp and every SuperNode) builds the same
:class:`~fedhpro.engines.simulator.Simulator` the in-process engine builds for
the config: the same federation (so client ``k``'s data is the partition the
simulator gives client ``k``), the same seeded initial models, the same method
server/client parts. The Flower apps then use its pieces instead of
re-implementing them: the server part, participant sampling and the global
evaluation on the server; client ``k``'s data, initial model and the method's
``fit`` on a node. Randomness comes from the same ``derive_seed`` streams, so
both engines compute the same numbers.

Cost: like ``fedhpro run``, every node loads the whole data set and (with
heterogeneous models) builds one model per client; a node keeps the latest
engine in memory so later rounds reuse it.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch

from fedhpro.api import build_experiment, resolve_device
from fedhpro.config import Config, load_config
from fedhpro.engines.simulator import _TRAIN, Faults, Simulator, derive_seed
from fedhpro.errors import ConfigError
from fedhpro.runtime import configure_cpu_runtime


def config_text(config: Config) -> str:
    """The resolved config as JSON text: what the ServerApp sends, so every node runs the same experiment."""
    return json.dumps(config.to_dict(), sort_keys=True)


def config_from_text(text: str, node_overrides: dict[str, Any] | None = None) -> Config:
    """The Config the server sent, with this node's own ``data_dir`` / ``device`` if its node_config sets them."""
    values = json.loads(text)
    values.update(node_overrides or {})
    return load_config(values)


def prepare_torch(device: torch.device) -> None:
    """The process-wide torch settings ``fedhpro run`` uses (they change the numbers, so every node sets them)."""
    if device.type == "cpu":
        configure_cpu_runtime()  # as api.run: denormals flushed, freed memory reused (fedhpro.runtime)


def build_engine(config: Config, on_drop=None) -> Simulator:
    """The in-process engine of ``config``, built exactly as :func:`fedhpro.api.run` builds it."""
    device = resolve_device(config.run.device)
    prepare_torch(device)
    parts = build_experiment(config, device)
    options = config.run
    return Simulator(parts.method, config.method_options, parts.federation, parts.model_factory, parts.train,
                     rounds=options.rounds, participation=options.participation, seed=options.seed,
                     eval_every=options.eval_every, device=device, client_architectures=parts.architectures,
                     architecture_factory=parts.architecture_factory, shared=parts.shared,
                     faults=Faults(config.faults.dropout, config.faults.corrupt),
                     min_clients=options.min_clients, on_drop=on_drop)


def train_generator(engine: Simulator, round: int, client: int) -> torch.Generator:
    """Client ``client``'s batch-order generator in ``round``: the simulator's stream for (seed, round, client)."""
    return torch.Generator().manual_seed(derive_seed(engine.seed, _TRAIN, round, client))


class EngineCache:
    """One engine per process, rebuilt only when the config changes (a Ray actor serves many nodes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: str | None = None
        self._engine: Simulator | None = None

    def get(self, text: str, node_overrides: dict[str, Any]) -> Simulator:
        key = text + json.dumps(node_overrides, sort_keys=True)
        with self._lock:
            if self._key != key:
                self._engine = None  # free the old one first: engines hold a whole data set
                self._engine = build_engine(config_from_text(text, node_overrides))
                self._key = key
            assert self._engine is not None
            return self._engine


def check_partition(node_config: dict[str, Any]) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` of a node; ConfigError naming the fix if they are missing or wrong."""
    try:
        partition, count = int(node_config["partition-id"]), int(node_config["num-partitions"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError("this SuperNode has no integer partition-id / num-partitions; start it with "
                          "--node-config 'partition-id=K num-partitions=N'") from None
    if not 0 <= partition < count:
        raise ConfigError(f"partition-id={partition} is not in [0, num-partitions={count})")
    return partition, count
