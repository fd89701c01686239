"""What the ServerApp and the ClientApp build from a Config: the same pieces the in-process engine uses.

Two ways to give the nodes their data:

* **partition mode** (a named data set: ``digits-offline``, ``cifar10``, ...,
  for simulation and reproduction): every node and the server build the
  federation of the config, exactly as :func:`fedhpro.api.run` does, and node
  ``partition-id = k`` keeps client ``k``; the server evaluates the global
  model on the test sets it built. A node keeps the latest engine in memory.
* **own-data mode** (``dataset=clients``: a real federation): a SuperNode
  started with ``--node-config "data-dir=/its/folder"`` loads only its own
  folder (:mod:`fedhpro.data.clients` layout); the server builds no data at
  all: the number of classes and the input shape come from the nodes' first
  answer (a ``query``), and evaluation is federated (each node tests on its
  own split, the server pools the counts per domain).

Either way the method's parts, the models and every random stream are built
by the in-process engine's own code (:class:`~fedhpro.engines.simulator.ClientModels`,
:func:`~fedhpro.engines.simulator.build_method`,
:class:`~fedhpro.engines.protocol.RoundProtocol`), so both engines compute
the same numbers.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fedhpro.bounded import load_json
from fedhpro.config import Config, load_config
from fedhpro.data.clients import load_client
from fedhpro.data.federation import ClientData, Federation
from fedhpro.engines.client_tests import ClientTests
from fedhpro.engines.interface import InProcessEngine
from fedhpro.engines.protocol import RoundProtocol
from fedhpro.engines.simulator import ClientModels, build_method
from fedhpro.errors import ConfigError
from fedhpro.experiment import (
    build_experiment,
    build_simulator,
    check_precision,
    model_factories,
    protocol_settings,
    resolve_device,
)
from fedhpro.methods import get_method
from fedhpro.privacy import ledger_for, sample_level
from fedhpro.runtime import configure_cpu_runtime

#: the data set whose nodes hold their own data (own-data mode)
OWN_DATA = "clients"

#: the environment under which a local Ray (Flower's simulation engine) binds every service to 127.0.0.1:
#: ray 2.55 on Linux resolves ``_node_ip_address="127.0.0.1"`` (``init_args``) to the machine's own address
#: and listens on all interfaces unless it is told it is no cluster. It must be set before ray is imported
#: (``flwr.simulation`` imports it), e.g. in the shell that starts ``flwr run ... local`` or the SuperLink.
RAY_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
#: ``backend_config["init_args"]`` for ``flwr.simulation.run_simulation`` on one machine (with RAY_LOOPBACK_ENV)
RAY_LOOPBACK_INIT_ARGS = {"_node_ip_address": "127.0.0.1", "include_dashboard": False}


def own_data(config: Config) -> bool:
    """Whether the nodes of this run hold their own data (``dataset=clients``) rather than a partition."""
    return config.run.dataset == OWN_DATA


def config_text(config: Config) -> str:
    """The resolved config as JSON text: what the ServerApp sends, so every node runs the same experiment."""
    return json.dumps(config.to_dict(), sort_keys=True)


def config_from_text(text: str, node_overrides: dict[str, Any] | None = None) -> Config:
    """The Config the server sent, with this node's own ``data_dir`` / ``device`` if its node_config sets them."""
    values = load_json(text, "the run config the server sent")
    if not isinstance(values, dict):
        raise ConfigError(f"the run config the server sent is a JSON {type(values).__name__}, not a mapping of "
                          "settings; run the same fedhpro version on the server and the nodes")
    values.update(node_overrides or {})
    return load_config(values)


def prepare_torch(device: torch.device) -> None:
    """The process-wide torch settings ``fedhpro run`` uses (they change the numbers, so every node sets them)."""
    if device.type == "cpu":
        configure_cpu_runtime()  # as api.run: denormals flushed, freed memory reused (fedhpro.runtime)


def protocol_for(config: Config, server: Any, num_samples: list[int],
                 on_drop: Callable[[str], None] | None = None, ledger: Any = None,
                 sizes_claimed: bool = False, content_claimed: bool = False) -> RoundProtocol:
    """The run's round protocol, from the settings the simulator gets (:func:`fedhpro.experiment.protocol_settings`);
    ``num_samples``: the clients' declared training-set sizes, which cap a round's weights (sizes are claims);
    ``ledger``: privacy=sample's (built from the clients' sizes); ``sizes_claimed``: nobody vouches for the sizes
    (own data without a roster), so they are bounded by the median claim too (``aggregation.max_ratio``);
    ``content_claimed``: the nodes train on data the server never sees (own data, roster or not), so
    ``aggregation.update_bound=auto`` bounds what each reply's content buys."""
    return RoundProtocol(server, len(num_samples), on_drop=on_drop, ledger=ledger, client_sizes=num_samples,
                         sizes_claimed=sizes_claimed, content_claimed=content_claimed, **protocol_settings(config))


def build_engine(config: Config, on_drop=None) -> InProcessEngine:
    """The in-process engine of ``config`` (partition mode), built exactly as :func:`fedhpro.api.run` builds it."""
    device = resolve_device(config.run.device)
    prepare_torch(device)
    return build_simulator(config, build_experiment(config, device), device, on_drop=on_drop)


@dataclass
class ServerSide:
    """What the ServerApp runs: the method's server part, its round protocol and the clients' models; in
    partition mode also the federation it built and how its clients are tested on the server (no simulator:
    the nodes train); in own-data mode it holds no data."""

    config: Config
    server: Any
    protocol: RoundProtocol
    models: ClientModels
    device: torch.device
    num_samples: list[int]  # each client's training-set size (weights of its training metrics)
    federation: Federation | None = None  # partition mode: the whole federation, as the simulator has it
    tests: ClientTests | None = None  # partition mode: its clients' tests (engines.client_tests)

    @property
    def personal(self) -> bool:
        return self.models.personal

    @property
    def federated_evaluation(self) -> bool:
        """Whether the nodes evaluate (personal models, or own data) rather than the server."""
        return self.tests is None or self.personal


def build_server_side(config: Config, *, num_classes: int | None = None, input_shape: tuple[int, ...] | None = None,
                      num_samples: list[int] | None = None, on_drop=None, sizes_claimed: bool = False,
                      content_claimed: bool = True) -> ServerSide:
    """Partition mode: the federation (data included), the method's server part and the clients' models as the
    simulator builds them, and no client part. Own-data mode: the method's server part for ``num_classes`` and
    ``input_shape`` (as the nodes reported them), and no data; ``sizes_claimed``: the nodes' declared sizes are
    claims nobody vouches for (no roster); ``content_claimed`` (own data only): the server sees each node's reply,
    whose content nobody vouches for (False under SecAgg+, where it sees only the sum)."""
    device = resolve_device(config.run.device)
    prepare_torch(device)
    method, options = get_method(config.run.method), config.run
    if not own_data(config):
        parts = build_experiment(config, device)
        federation = parts.federation
        models = ClientModels(parts.model_factory, num_clients=federation.num_clients, seed=options.seed,
                              device=device, client_architectures=parts.architectures,
                              architecture_factory=parts.architecture_factory, shared=parts.shared)
        server, _ = build_method(parts.method, config.method_options, models, federation.num_classes, parts.train,
                                 options.seed, device)
        sizes = [len(client) for client in federation.clients]
        protocol = protocol_for(config, server, sizes, on_drop, parts.ledger)
        return ServerSide(config, server, protocol, models, device, sizes, federation,
                          ClientTests(federation, models, server, protocol, parts.train.amp))
    assert num_classes is not None and input_shape is not None and num_samples is not None
    model_factory, architecture_factory, architectures, shared, train = model_factories(
        config, method, num_classes, tuple(input_shape), len(num_samples))
    models = ClientModels(model_factory, num_clients=len(num_samples), seed=options.seed, device=device,
                          client_architectures=architectures, architecture_factory=architecture_factory,
                          shared=shared, clients=[])
    server, _ = build_method(method, config.method_options, models, num_classes, train, options.seed, device)
    ledger = None
    if sample_level(config.privacy):
        if config.privacy.target_epsilon > 0:  # each node would calibrate sigma on its own size alone
            raise ConfigError("privacy=sample with privacy.target_epsilon on Flower's own-data mode: the nodes "
                              "cannot calibrate one sigma without every client's size; give "
                              "privacy.noise_multiplier instead (the run reports the epsilon it reaches)")
        ledger = ledger_for(config, list(num_samples), train)
    protocol = protocol_for(config, server, list(num_samples), on_drop, ledger, sizes_claimed, content_claimed)
    return ServerSide(config, server, protocol, models, device, list(num_samples))


@dataclass
class NodeSide:
    """What a SuperNode runs for client ``client``: the method's parts, its models and its own data."""

    client: int
    seed: int
    device: torch.device
    models: ClientModels
    server: Any  # the method's server part: its inference rule (nearest prototype) needs the server's state
    method_client: Any
    data: ClientData
    test_name: str
    test: tuple[Tensor, Tensor]

    def model(self, personal_weights: dict[str, Tensor] | None) -> nn.Module:
        """The model this client trains: the working model (the global one is loaded from the payload),
        or its personal model (``personal_weights`` as stored on the node, else its seeded init)."""
        if not self.models.personal:
            return self.models.working_model
        return self.models.model_for(self.client, personal_weights)


def node_from_engine(engine: InProcessEngine, client: int) -> NodeSide:
    """Partition mode: client ``client`` of the whole engine this node built."""
    name, test = engine.client_test(client)
    return NodeSide(client, engine.seed, engine.device, engine.models, engine.server, engine.client,
                    engine.federation.clients[client], name, test)


def build_own_node(config: Config, client: int, num_clients: int) -> NodeSide:
    """Own-data mode: the node's own folder (``data_dir``, with ``data.classes`` as the server resolved
    them) as client ``client`` of ``num_clients``; the same tensors the simulator loads for it."""
    device = resolve_device(config.run.device)
    prepare_torch(device)
    folder = node_folder({"data-dir": config.run.data_dir})
    classes = config.data.classes
    train, test, info = load_client(folder, config.data, classes)
    # the same checks and conversions as the simulator's federation
    own = Federation.from_tensors([train], [test], num_classes=len(classes), domains=[info.domain],
                                  names=[info.name], name=OWN_DATA).to(device)
    method, options = get_method(config.run.method), config.run
    check_precision(config, device)  # as build_experiment checks it for the simulator and partition mode
    model_factory, architecture_factory, architectures, shared, train_settings = model_factories(
        config, method, len(classes), own.input_shape, num_clients)
    models = ClientModels(model_factory, num_clients=num_clients, seed=options.seed, device=device,
                          client_architectures=architectures, architecture_factory=architecture_factory,
                          shared=shared, clients=[client])
    server, method_client = build_method(method, config.method_options, models, len(classes), train_settings,
                                         options.seed, device)
    assert own.client_tests is not None
    return NodeSide(client, options.seed, device, models, server, method_client, own.clients[0],
                    own.client_test_name(0), own.client_tests[0])


class NodeCache:
    """One node side per process and message key, rebuilt only when the config changes (a Ray actor
    serves many simulated nodes; a partition-mode engine holds a whole data set)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: str | None = None
        self._value: Any = None

    def get(self, text: str, node_overrides: dict[str, Any], client: int, num_clients: int) -> NodeSide:
        config = config_from_text(text, node_overrides)
        own = own_data(config)
        key = text + json.dumps(node_overrides, sort_keys=True) + (f"#{client}" if own else "")
        with self._lock:
            if self._key != key:
                self._value = None  # free the old one first
                self._value = build_own_node(config, client, num_clients) if own else build_engine(config)
                self._key = key
            value = self._value
        return value if own else node_from_engine(value, client)


def check_partition(node_config: dict[str, Any]) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` of a node; ConfigError naming the fix if they are missing or wrong."""
    try:
        partition, count = int(node_config["partition-id"]), int(node_config["num-partitions"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError("this SuperNode has no integer partition-id / num-partitions; start it with "
                          "--node-config 'partition-id=K num-partitions=N' (a named data set), or run "
                          "dataset=clients with --node-config 'data-dir=/its/folder' (nodes with their own data)"
                          ) from None
    if not 0 <= partition < count:
        raise ConfigError(f"partition-id={partition} is not in [0, num-partitions={count})")
    return partition, count


def node_folder(node_config: dict[str, Any]) -> Path:
    """The folder an own-data node holds (its ``data-dir``); ConfigError naming the fix if it has none."""
    folder = node_config.get("data-dir")
    if not folder:
        raise ConfigError("this SuperNode has no data-dir; start it with --node-config \"data-dir=/path/to/its/"
                          "folder\" (the folder holding its train/ and test/ data)")
    return Path(str(folder)).expanduser()
