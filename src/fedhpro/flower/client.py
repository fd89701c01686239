"""The fedhpro ClientApp: a method's client part on a Flower SuperNode.

The node's data is partition ``partition-id`` of its ``node_config``: client
``partition-id`` of the federation the config builds, the data the in-process
simulator gives that client. The config itself comes with every message from
the ServerApp (so the nodes need no run config of their own); a node may set
its own ``data-dir`` and ``device`` in its node_config.

Between rounds the client's state lives in ``Context.state``: the method's
per-client state (MOON's previous model, FedSA's last prototypes) under
``state/...`` records and, with personal models (heterogeneous or
prototype-only federations), the client's whole model under ``personal/...``.

Handlers: ``query`` (which partition this node holds), ``train`` (the method's
``fit``), ``evaluate`` (personal models only: this client's model with the
global shared part, on its own test set). A failing handler answers with an
error reply whose reason is one line, ``raised <Error>: <message>``, as the
simulator reports a crashing client; the server drops that client.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fedhpro.engines.simulator import Simulator, evaluate
from fedhpro.errors import ConfigError
from fedhpro.flower import records
from fedhpro.flower.engine import EngineCache, check_partition, train_generator
from fedhpro.flower.server import HEADER, SERVER_STATE
from fedhpro.methods.base import load_weights

logger = logging.getLogger("fedhpro.flower")

#: Context.state record names
STATE_PREFIX = "state/"  # the method's per-client state
MODEL_PREFIX = "personal/"  # the personal model (its weights under the key MODEL)
MODEL = "model"

#: node_config keys a SuperNode may set for itself (where its data is, which device it trains on)
NODE_OVERRIDES = {"data-dir": "data_dir", "device": "device"}

app = ClientApp()
_engines = EngineCache()


def _node_overrides(node_config: dict[str, Any]) -> dict[str, Any]:
    overrides: dict[str, Any] = {"progress": False}  # no progress bars in a node's log
    for key, name in NODE_OVERRIDES.items():
        if key in node_config and node_config[key] != "":
            overrides[name] = node_config[key]
    return overrides


def _setup(msg: Message, context: Context) -> tuple[Simulator, int, int]:
    """``(engine, round, client)`` for a message: the engine of the config it carries, and this node's client."""
    partition, _ = check_partition(dict(context.node_config))
    header = msg.content.config_records[HEADER]
    client = int(header["client"])
    if client != partition:
        raise ConfigError(f"the server addressed client {client} but this SuperNode holds partition {partition}")
    engine = _engines.get(str(header["config"]), _node_overrides(dict(context.node_config)))
    return engine, int(header["round"]), client


def _client_model(engine: Simulator, client: int, context: Context) -> nn.Module:
    """The model client ``client`` trains: the engine's shared working model (a global model is loaded whole
    from the payload), or its own personal model, restored from Context.state (first time: its seeded init)."""
    if not engine.heterogeneous:
        return engine.working_model
    model = engine.working_models[engine.client_architectures[client]]
    if MODEL_PREFIX + records.LAYOUT in context.state.config_records:
        weights = records.decode_payload(context.state, engine.device, prefix=MODEL_PREFIX)[MODEL]
    else:
        weights = engine.client_weights[client]  # never changed on a node: the initial weights
    model.load_state_dict(weights)
    return model


def _failure(msg: Message, error: BaseException) -> Message:
    logger.error("fedhpro client failed:\n%s", "".join(traceback.format_exception(error)))
    reason = f"raised {type(error).__name__}: {error}".splitlines()[0]
    return Message(Error(code=1, reason=reason), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Which partition this node holds (the server maps partitions to nodes with it)."""
    try:
        partition, count = check_partition(dict(context.node_config))
    except Exception as error:  # noqa: BLE001 - every failure becomes an error reply
        return _failure(msg, error)
    return Message(RecordDict({"fedhpro.node": ConfigRecord({"partition-id": partition, "num-partitions": count})}),
                   reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of the method's local training on this node's partition."""
    try:
        engine, round, client = _setup(msg, context)
        payload = records.decode_payload(msg.content, engine.device)
        state = _load_state(context, engine)
        model = _client_model(engine, client, context)
        data = engine.federation.clients[client]
        # fit mutates ``state``, a copy decoded from Context.state: a failing fit leaves the stored state as it was
        reply, metrics = engine.client.fit(model, payload, data, state, train_generator(engine, round, client))
        content = RecordDict({**records.encode_payload(reply), records.METRICS: records.encode_metrics(metrics)})
    except Exception as error:  # noqa: BLE001 - a crashing client is a dropped client
        return _failure(msg, error)
    _save_state(context, state)
    if engine.heterogeneous:  # the personal model persists to the client's next round
        for name, record in records.encode_payload({MODEL: model.state_dict()}, prefix=MODEL_PREFIX).items():
            context.state[name] = record
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate_personal(msg: Message, context: Context) -> Message:
    """Accuracy of this client's personal model with the global shared part, on its own test set."""
    try:
        engine, _, client = _setup(msg, context)
        shared = records.decode_payload(msg.content, engine.device)["weights"]
        # the server's inference rule (nearest prototype) needs the server's state: load it into the node's copy
        engine.server.load_state_dict(records.decode_payload(msg.content, engine.device, prefix=SERVER_STATE))
        model = _client_model(engine, client, context)
        load_weights(model, shared)
        name = engine.federation.client_test_name(client)
        accuracy = evaluate(engine.server.inference_model(model), {name: engine.federation.test_sets[name]})[name]
    except Exception as error:  # noqa: BLE001
        return _failure(msg, error)
    return Message(RecordDict({"fedhpro.eval": ConfigRecord({"test-set": name}),
                               "fedhpro.eval-metrics": MetricRecord({"accuracy": accuracy})}), reply_to=msg)


def _load_state(context: Context, engine: Simulator) -> dict[str, Any]:
    if STATE_PREFIX + records.LAYOUT not in context.state.config_records:
        return {}
    return records.decode_payload(context.state, engine.device, prefix=STATE_PREFIX)


def _save_state(context: Context, state: dict[str, Any]) -> None:
    for name, record in records.encode_payload(state, prefix=STATE_PREFIX).items():
        context.state[name] = record
