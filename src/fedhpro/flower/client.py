"""The fedhpro ClientApp: a method's client part on a Flower SuperNode.

What a node holds depends on the run (see :mod:`fedhpro.flower.engine`):

* partition mode (a named data set): partition ``partition-id`` of its
  ``node_config``, i.e. client ``partition-id`` of the federation the config
  builds, the data the in-process simulator gives that client;
* own-data mode (``dataset=clients``): only its own folder, ``data-dir`` in
  its ``node_config`` (the :mod:`fedhpro.data.clients` layout of one client:
  ``train/<class>/*`` and ``test/<class>/*`` images, or ``train.npz|pt`` and
  ``test.npz|pt``). Its client name is the folder's name (``name=`` in the
  node_config overrides it) and its domain that of the folder (``domain.txt``
  or the name's prefix).

The config itself comes with every message from the ServerApp (so the nodes
need no run config of their own); a node may set its own ``data-dir`` and
``device`` in its node_config.

Between rounds the client's state lives in ``Context.state``: the method's
per-client state (MOON's previous model, FedSA's last prototypes) under
``state/...`` records and, with personal models (heterogeneous or
prototype-only federations), the client's whole model under ``personal/...``.

Handlers: ``query`` (which partition this node holds, or what its folder
holds: name, domain, classes, input shape, sizes; never the data), ``train``
(the method's ``fit``), ``evaluate`` (the global model, or its personal model
with the global shared part, on its own test data: correct and total counts).
A failing handler answers with an error reply whose reason is one line,
``raised <Error>: <message>``, as the simulator reports a crashing client;
the server drops that client (in a query: stops with that line).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import traceback
from typing import Any, cast

from flwr.app import ConfigRecord, ConfigRecordValues, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fedhpro.engines.simulator import count_correct
from fedhpro.errors import ConfigError
from fedhpro.flower import records
from fedhpro.flower.engine import NodeCache, NodeSide, check_partition, config_from_text, node_folder, own_data
from fedhpro.flower.server import EVAL_RECORD, HEADER, NODE_RECORD, SERVER_STATE
from fedhpro.methods.base import load_weights

logger = logging.getLogger("fedhpro.flower")

#: Context.state record names
STATE_PREFIX = "state/"  # the method's per-client state
MODEL_PREFIX = "personal/"  # the personal model (its weights under the key MODEL)
MODEL = "model"
#: the client's state and personal model as they were before its latest fit, and that fit's round: restored when
#: the server refuses that round's reply (as the simulator restores a client whose update it rejects)
BACKUP_PREFIX = "before/"
BACKUP_ROUND = "fedhpro.backup"

#: node_config keys a SuperNode may set for itself (where its data is, which device it trains on)
NODE_OVERRIDES = {"data-dir": "data_dir", "device": "device"}

app = ClientApp()
_nodes = NodeCache()


def _node_overrides(node_config: dict[str, Any]) -> dict[str, Any]:
    overrides: dict[str, Any] = {"progress": False}  # no progress bars in a node's log
    for key, name in NODE_OVERRIDES.items():
        if key in node_config and node_config[key] != "":
            overrides[name] = node_config[key]
    return overrides


def _check_dataset(node_config: dict[str, Any], dataset: str) -> None:
    """A node that names its data set must be asked for that one."""
    declared = node_config.get("dataset")
    if declared not in (None, "") and declared != dataset:
        raise ConfigError(f"this SuperNode holds dataset={declared} but the run is dataset={dataset}; start the run "
                          f"with dataset={declared} or the node with --node-config \"dataset={dataset} ...\"")


def _setup(msg: Message, context: Context) -> tuple[NodeSide, int]:
    """``(node side, round)`` for a message: this node's client of the config the message carries."""
    node_config = dict(context.node_config)
    header = msg.content.config_records[HEADER]
    client = int(cast(int, header["client"]))
    text = str(header["config"])
    overrides = _node_overrides(node_config)
    config = config_from_text(text, overrides)
    _check_dataset(node_config, config.run.dataset)
    if not own_data(config):
        partition, _ = check_partition(node_config)
        if client != partition:
            raise ConfigError(f"the server addressed client {client} but this SuperNode holds partition {partition}")
    else:
        node_folder(node_config)
    node = _nodes.get(text, overrides, client, int(cast(int, header["num-clients"])))
    _restore_if_refused(context, int(cast(int, header.get("refused-round", -1))))
    return node, int(cast(int, header["round"]))


def _held(context: Context, *prefixes: str) -> list[str]:
    return [name for name in list(context.state.keys()) if name.startswith(prefixes)]


def _keep_backup(context: Context, round: int) -> None:
    """Keep what the client holds now (before ``round``'s fit) beside it, replacing the older backup."""
    for name in _held(context, BACKUP_PREFIX):
        del context.state[name]
    for name in _held(context, STATE_PREFIX, MODEL_PREFIX):
        context.state[BACKUP_PREFIX + name] = context.state[name]
    context.state[BACKUP_ROUND] = ConfigRecord({"round": round})


def _restore_if_refused(context: Context, refused_round: int) -> None:
    """The server refused this client's reply of ``refused_round`` (an invalid update): go back to the state
    and personal model from before that fit, once."""
    backup = context.state.config_records.get(BACKUP_ROUND)
    if refused_round < 0 or backup is None or int(cast(int, backup["round"])) != refused_round:
        return
    for name in _held(context, STATE_PREFIX, MODEL_PREFIX):
        del context.state[name]
    for name in _held(context, BACKUP_PREFIX):
        context.state[name[len(BACKUP_PREFIX):]] = context.state.pop(name)
    del context.state[BACKUP_ROUND]


def _personal_weights(node: NodeSide, context: Context) -> dict[str, Any] | None:
    """This client's personal model as stored on the node (None: not trained yet, or one global model)."""
    if not node.models.personal or MODEL_PREFIX + records.LAYOUT not in context.state.config_records:
        return None
    return records.decode_payload(context.state, node.device, prefix=MODEL_PREFIX)[MODEL]


def _model(node: NodeSide, context: Context) -> nn.Module:
    return node.model(_personal_weights(node, context))


def _failure(msg: Message, error: BaseException) -> Message:
    logger.error("fedhpro client failed:\n%s", "".join(traceback.format_exception(error)))
    reason = f"raised {type(error).__name__}: {error}".splitlines()[0]
    return Message(Error(code=1, reason=reason), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """What this node holds: its partition (partition mode), or a description of its own folder
    (own-data mode: name, domain, classes, input shape and sizes; no sample leaves the node)."""
    try:
        node_config = dict(context.node_config)
        header = msg.content.config_records[HEADER]
        answer: dict[str, ConfigRecordValues]
        if str(header["query"]) == "data":
            from fedhpro.data.clients import scan_client

            config = config_from_text(str(header["config"]), _node_overrides(node_config))
            _check_dataset(node_config, config.run.dataset)
            info = scan_client(node_folder(node_config), config.data)
            if node_config.get("name"):
                info = dataclasses.replace(info, name=str(node_config["name"]))
            answer = {"info": json.dumps(dataclasses.asdict(info))}
        else:
            partition, count = check_partition(node_config)
            answer = {"partition-id": partition, "num-partitions": count}
    except Exception as error:  # noqa: BLE001 - every failure becomes an error reply
        return _failure(msg, error)
    return Message(RecordDict({NODE_RECORD: ConfigRecord(answer)}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of the method's local training on this node's data."""
    try:
        node, round = _setup(msg, context)
        payload = records.decode_payload(msg.content, node.device)
        state = _load_state(context, node)
        model = _model(node, context)
        # fit mutates ``state``, a copy decoded from Context.state: a failing fit leaves the stored state as it was
        reply, metrics = node.method_client.fit(model, payload, node.data, state, node.generator(round))
        content = RecordDict({**records.encode_payload(reply), records.METRICS: records.encode_metrics(metrics)})
    except Exception as error:  # noqa: BLE001 - a crashing client is a dropped client
        return _failure(msg, error)
    _keep_backup(context, round)
    _save_state(context, state)
    if node.models.personal:  # the personal model persists to the client's next round
        for name, record in records.encode_payload({MODEL: model.state_dict()}, prefix=MODEL_PREFIX).items():
            context.state[name] = record
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Correct and total counts on this client's own test data: the global model, or its personal model
    with the global shared part, through the server's inference rule (as the simulator tests client k)."""
    try:
        node, _ = _setup(msg, context)
        shared = records.decode_payload(msg.content, node.device)["weights"]
        # the server's inference rule (nearest prototype) needs the server's state: load it into the node's copy
        node.server.load_state_dict(records.decode_payload(msg.content, node.device, prefix=SERVER_STATE))
        if node.models.personal:
            model = _model(node, context)
            load_weights(model, shared)
        else:
            model = node.models.eval_model
            model.load_state_dict(shared)
        x, y = node.test
        correct = count_correct(node.server.inference_model(model), x, y)
    except Exception as error:  # noqa: BLE001
        return _failure(msg, error)
    return Message(RecordDict({EVAL_RECORD: ConfigRecord({"test-set": node.test_name, "correct": correct,
                                                          "total": int(y.shape[0])})}), reply_to=msg)


def _load_state(context: Context, node: NodeSide) -> dict[str, Any]:
    if STATE_PREFIX + records.LAYOUT not in context.state.config_records:
        return {}
    return records.decode_payload(context.state, node.device, prefix=STATE_PREFIX)


def _save_state(context: Context, state: dict[str, Any]) -> None:
    for name, record in records.encode_payload(state, prefix=STATE_PREFIX).items():
        context.state[name] = record
