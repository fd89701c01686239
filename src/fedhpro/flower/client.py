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
It is also kept on the node's disk (:class:`StateStore`), one file per round
the client trained, so that a restarted SuperNode (empty ``Context.state``)
and a resumed run (a new Flower run, hence a new ``Context``) go on from the
state the client had before the round they (re)do.

Handlers: ``query`` (which partition this node holds, or what its folder
holds: name, domain, classes, input shape, sizes and, with ``data.standardize=federated``, the count,
sum and sum of squares of each feature of its training rows; never the data), ``train``
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
import re
import shutil
import traceback
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, ConfigRecordValues, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fedhpro.arrays import ArrayFileError, Bound, load_torch
from fedhpro.bounded import LimitError, load_json
from fedhpro.data.clients import scan_client, site_feature_sums, site_training_features
from fedhpro.data.digits_offline import default_data_dir
from fedhpro.data.feature_statistics import feature_ranges, packed_sums, range_sums
from fedhpro.engines import checkpoint
from fedhpro.engines.one_round import test_client
from fedhpro.engines.protocol import client_step
from fedhpro.errors import ConfigError, DataError, UpdateError
from fedhpro.files import write_atomic_with
from fedhpro.flower import records, secagg
from fedhpro.flower.answers import sums_entries
from fedhpro.flower.engine import NodeCache, NodeSide, check_partition, config_from_text, node_folder, own_data
from fedhpro.flower.server import EVAL_RECORD, HEADER, NODE_RECORD, PRIVACY, SERVER_STATE
from fedhpro.privacy.client import ClientPrivacy
from fedhpro.seeds import derive_seed
from fedhpro.trained import write_node_model

logger = logging.getLogger("fedhpro.flower")

#: the seed stream of a statistics round's stochastic rounding (data.standardize=federated under SecAgg+)
STATISTICS_STREAM = 0x57A75

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
#: node_config key of the folder where a node keeps its clients' state on disk (default: :func:`state_root`)
STATE_DIR = "state-dir"
#: Context.state record naming the run whose state the context holds (absent: a new context, read from disk)
LOADED = "fedhpro.loaded"

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


def _setup(msg: Message, context: Context, training: bool) -> tuple[NodeSide, int, StateStore | None]:
    """``(node side, round, the client's store on disk)`` for a message: this node's client of the config
    the message carries, its state as the server's protocol counts it (refused replies undone; a new
    context takes it up from disk). No store: the server sent no run key (nothing is kept on disk)."""
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
    round, refused = int(cast(int, header["round"])), int(cast(int, header.get("refused-round", -1)))
    store = client_store(node_config, header.get("state-key"), client)
    if store is not None and refused >= 0:
        store.drop([refused])
    _restore_if_refused(context, refused)
    if store is not None:
        # train r: the state from before round r; evaluate r: the state after round r's fit
        _take_up(context, store, str(header["state-key"]), round if training else round + 1)
    return node, round, store


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
            config = config_from_text(str(header["config"]), _node_overrides(node_config))
            _check_dataset(node_config, config.run.dataset)
            info = scan_client(node_folder(node_config), config.data)
            if node_config.get("name"):
                info = dataclasses.replace(info, name=str(node_config["name"]))
            answer = {"info": json.dumps(dataclasses.asdict(info))}
            # data.standardize=federated only, and never under SecAgg+ (its sums are then added up securely)
            sums = site_feature_sums(node_folder(node_config), config.data) \
                if header.get("feature-sums") is True else None
            if sums is not None:
                answer.update(sums_entries(sums))
        elif str(header["query"]) == "forget":  # the run is over: its state on this node is of no more use
            shutil.rmtree(run_folder(node_config, str(header["state-key"])), ignore_errors=True)
            answer = {"forgotten": True}
        else:
            partition, count = check_partition(node_config)
            answer = {"partition-id": partition, "num-partitions": count}
    except Exception as error:  # noqa: BLE001 - every failure becomes an error reply
        return _failure(msg, error)
    return Message(RecordDict({NODE_RECORD: ConfigRecord(answer)}), reply_to=msg)


@app.train(mods=[secagg.node_mod])
def train(msg: Message, context: Context) -> Message:
    """One round of the method's local training on this node's data. In a SecAgg+ round (the header holds
    its scale; :mod:`fedhpro.flower.secagg`) the reply is the vector SecAgg+ masks and sums, not the payload:
    ``secagg.node_mod`` (Flower's ``secaggplus_mod``) calls this handler in its collect stage."""
    try:
        if secagg.STATISTICS in msg.content.config_records[HEADER]:  # SecAgg+ adds up the sites' feature sums
            return Message(_statistics_content(msg, context), reply_to=msg)
        node, round, store = _setup(msg, context, training=True)
        payload = records.decode_payload(msg.content, node.device)
        state = _load_state(context, node)
        model = _model(node, context)
        # fit mutates ``state``, a copy decoded from Context.state: a failing fit leaves the stored state as it was
        header = msg.content.config_records[HEADER]
        # privacy=client: the reply leaves privatized, as the simulator's client sends it
        privacy = _privacy_settings(header) if PRIVACY in header else None
        reply, metrics = client_step(node.server, node.method_client, model, payload, node.data, state, node.seed,
                                     round, node.client, privacy)
        if secagg.SCALE in header:
            content = _secure_content(node, header, payload, reply, metrics, round)
        else:
            content = RecordDict({**records.encode_payload(reply), records.METRICS: records.encode_metrics(metrics)})
    except Exception as error:  # noqa: BLE001 - a crashing client is a dropped client
        return _failure(msg, error)
    _keep_backup(context, round)
    _save_state(context, state)
    if node.models.personal:  # the personal model persists to the client's next round
        for name, record in records.encode_payload({MODEL: model.state_dict()}, prefix=MODEL_PREFIX).items():
            context.state[name] = record
    if store is not None and (state or node.models.personal or store.rounds()):
        store.save(round, _snapshot(context))
        header = msg.content.config_records[HEADER]
        store.prune(int(cast(int, header.get("keep-from", round))))
    return Message(content, reply_to=msg)


def _statistics_content(msg: Message, context: Context) -> RecordDict:
    """The reply of a SecAgg+ round of feature statistics (``data.standardize=federated`` under SecAgg+): this
    site's sums of its training features clipped to their public ranges, weighed as the server counts the
    site and packed into ``[0, clip]`` (:func:`~fedhpro.data.feature_statistics.packed_sums`), in the form
    ``secaggplus_mod`` masks. Its stochastic rounding is seeded from (seed, client), so runs repeat."""
    node_config = dict(context.node_config)
    header = msg.content.config_records[HEADER]
    config = config_from_text(str(header["config"]), _node_overrides(node_config))
    _check_dataset(node_config, config.run.dataset)
    x = site_training_features(node_folder(node_config), config.data)
    if x is None:
        raise DataError("the server asked for feature sums but this site holds no float N x F features")
    ranges = feature_ranges(config.data.feature_low, config.data.feature_high, int(x.shape[1]))
    assert ranges is not None, "the server sends the ranges with a statistics round"
    try:
        vector = packed_sums(range_sums(x, *ranges), float(cast(float, header[secagg.WEIGHT])),
                             float(cast(float, header[secagg.STATISTICS])), float(cast(float, header[secagg.CLIP])))
    except ValueError as error:
        raise UpdateError(str(error)) from None
    # its own stream: no training round's (seed, QUANTIZATION, round, client) draws the same rounding
    client = int(cast(int, header["client"]))
    np.random.seed(derive_seed(config.run.seed, secagg.QUANTIZATION, STATISTICS_STREAM, client) % 2 ** 32)
    return secagg.client_content(vector.numpy(), [])


def _privacy_settings(header: ConfigRecord) -> ClientPrivacy:
    """``privacy=client``: the settings the server's round protocol uses (its header: sigma may be calibrated
    there), for :func:`~fedhpro.engines.protocol.client_step` to clip (and under ``privacy.noise=local`` noise)
    the reply with. One-line UpdateError for a header that is not such settings."""
    try:
        values = load_json(str(header[PRIVACY]), "the privacy header", max_chars=4096, max_depth=2, allow_nan=False)
        return ClientPrivacy(**values)
    except (LimitError, ValueError, TypeError) as error:
        raise UpdateError(f"the server's privacy header is not ClientPrivacy's settings: {error}") from None


def _secure_content(node: NodeSide, header: ConfigRecord, payload: dict[str, Any], reply: dict[str, Any],
                    metrics: dict[str, float], round: int) -> RecordDict:
    """A SecAgg+ round's reply: the client's reply checked and packed as one vector (the layout every node
    and the server build from the method), in the form ``secaggplus_mod`` masks. Its stochastic rounding
    draws from numpy's global generator: seeded here from (seed, round, client), so runs repeat."""
    method = config_from_text(str(header["config"])).run.method
    layout = secagg.SecureLayout(node.server, method)
    vector = secagg.client_vector(layout, node.server, reply, payload.get("weights") or {}, metrics, len(node.data),
                                  float(cast(float, header[secagg.SCALE])), float(cast(float, header[secagg.CLIP])))
    np.random.seed(derive_seed(node.seed, secagg.QUANTIZATION, round, node.client) % 2 ** 32)
    return secagg.client_content(vector, list(metrics))


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Correct and total counts on this client's own test data: the global model, or its personal model
    with the global shared part, through the server's inference rule (as the simulator tests client k)."""
    try:
        node, round, _ = _setup(msg, context, training=False)
        shared = records.decode_payload(msg.content, node.device)["weights"]
        # the server's inference rule (nearest prototype) needs the server's state: load it into the node's copy
        node.server.load_state_dict(records.decode_payload(msg.content, node.device, prefix=SERVER_STATE))
        model = _model(node, context) if node.models.personal else node.models.eval_model
        count = test_client(node.server, model, node.test_name, node.test, shared, personal=node.models.personal,
                            amp=node.method_client.train.amp)
        if node.models.personal:
            _write_personal_model(msg, context, node, model, round)
    except Exception as error:  # noqa: BLE001
        return _failure(msg, error)
    return Message(RecordDict({EVAL_RECORD: ConfigRecord({"test-set": count.name, "correct": count.correct,
                                                          "total": count.total})}), reply_to=msg)


def personal_model_folder(node_config: dict[str, Any], state_key: str, client: int) -> Path:
    """Where a node writes client ``client``'s final personal model of run ``state_key``:
    ``models/<state key>/client-<k>`` under :func:`state_root` (beside the clients' state, outside what
    ``forget`` deletes; one folder per client, as nodes may share a disk)."""
    if not _RUN_KEY.match(state_key):
        raise ValueError(f"not a run key: {state_key!r}")
    return state_root(node_config) / "models" / state_key / f"client-{int(client)}"


def _write_personal_model(msg: Message, context: Context, node: NodeSide, model: Any, round: int) -> None:
    """After the last round's evaluation, the client's personal model (with the global shared part just
    loaded) on this node's own disk, loadable with ``fedhpro.load_model(folder, client=k)``; its path logged."""
    header = msg.content.config_records[HEADER]
    node_config = dict(context.node_config)
    config = config_from_text(str(header["config"]), _node_overrides(node_config))
    key = header.get("state-key")
    if round != config.run.rounds - 1 or not isinstance(key, str) or not _RUN_KEY.match(key):
        return
    written = write_node_model(personal_model_folder(node_config, key, int(node.client)), config, node, model)
    logger.info("fedhpro: client %d's personal model written to %s", int(node.client), written)


def _load_state(context: Context, node: NodeSide) -> dict[str, Any]:
    if STATE_PREFIX + records.LAYOUT not in context.state.config_records:
        return {}
    return records.decode_payload(context.state, node.device, prefix=STATE_PREFIX)


def _save_state(context: Context, state: dict[str, Any]) -> None:
    for name, record in records.encode_payload(state, prefix=STATE_PREFIX).items():
        context.state[name] = record


# ---------------------------------------------------------------------------- the client's state on disk

#: a run key as the server makes it (:func:`fedhpro.flower.server.run_key`); it names a folder, so nothing else
_RUN_KEY = re.compile(r"^[0-9a-f]{16}$")


def state_root(node_config: dict[str, Any]) -> Path:
    """Where this node keeps its clients' state: ``state-dir`` of its node_config, else ``node-state`` under
    ``$FEDHPRO_DATA_DIR``, else ``~/.cache/fedhpro/node-state``."""
    folder = node_config.get(STATE_DIR)
    if folder:
        return Path(str(folder)).expanduser()
    return default_data_dir() / "node-state"


def run_folder(node_config: dict[str, Any], key: str) -> Path:
    """The folder of one run's state on this node; ConfigError for a key the server cannot have sent."""
    if not _RUN_KEY.match(key):
        raise ConfigError(f"state-key {key!r} is not a fedhpro run key (16 hex digits); the ServerApp and this "
                          "SuperNode must run the same fedhpro version")
    return state_root(node_config) / key


def client_store(node_config: dict[str, Any], key: Any, client: int) -> StateStore | None:
    """Client ``client``'s store of the run ``key`` on this node, or None when the server sent no key."""
    if key in (None, ""):
        return None
    return StateStore(run_folder(node_config, str(key)) / f"client-{client}")


class StateStore:
    """One client's state on its node's disk, one file per round it trained.

    ``<state root>/<run key>/client-<k>/round-NNNNNN.pt`` holds the client's
    ``state/...`` and ``personal/...`` records of ``Context.state`` after that
    round's fit (tensors bit for bit, written atomically). A new context
    doing round ``r`` (a restarted SuperNode, or a resumed run: a new Flower
    run) takes up the newest file of a round before ``r``; files of round
    ``r`` and later belong to rounds the server abandoned (it resumed from an
    earlier checkpoint) and are dropped first, as is the file of a round
    whose reply the server refused. Every message names the oldest round the
    server could go back to (``keep-from``: its oldest kept checkpoint, else
    the current round); the store keeps the newest file before it and all
    files after it, and deletes the rest.
    """

    def __init__(self, folder: Path):
        self.folder = folder

    def rounds(self) -> list[int]:
        """The rounds whose state is on disk, oldest first."""
        return checkpoint.rounds_in(self.folder)

    def path(self, round: int) -> Path:
        return self.folder / checkpoint.round_file(round)

    def newest(self, before: int) -> int | None:
        """The newest round on disk before ``before``, or None."""
        return max((r for r in self.rounds() if r < before), default=None)

    def load(self, round: int) -> dict[str, Any]:
        """The snapshot of ``round`` (:func:`_snapshot`); DataError naming the file if it cannot be read."""
        try:
            return load_torch(self.path(round), Bound.state())  # its declared sizes checked first
        except ArrayFileError as error:
            raise DataError(f"{error}; or delete it to go on from the round before") from None
        except Exception as error:  # noqa: BLE001 - a truncated or foreign file
            raise DataError(f"the client state {self.path(round)} cannot be read ({type(error).__name__}); "
                            "delete it to go on from the round before") from None

    def save(self, round: int, snapshot: dict[str, Any]) -> None:
        write_atomic_with(self.path(round), lambda handle: torch.save(snapshot, handle))

    def drop(self, rounds: list[int]) -> None:
        for round in rounds:
            self.path(round).unlink(missing_ok=True)

    def prune(self, keep_from: int) -> None:
        """Keep the newest round before ``keep_from`` and every round from ``keep_from`` on."""
        older = [r for r in self.rounds() if r < keep_from]
        self.drop(older[:-1])


def _take_up(context: Context, store: StateStore, key: str, bound: int) -> None:
    """A context that does not hold run ``key`` yet (a restarted node, a resumed run) takes up the newest
    state on disk of a round before ``bound``, after dropping the files of ``bound`` and later (rounds the
    server abandoned); none on disk: the client starts without state, as in round 0."""
    loaded = context.state.config_records.get(LOADED)
    if loaded is not None and loaded["key"] == key:
        return
    store.drop([r for r in store.rounds() if r >= bound])
    newest = store.newest(before=bound)
    _install(context, store.load(newest) if newest is not None else {})
    context.state[LOADED] = ConfigRecord({"key": key})


def _snapshot(context: Context) -> dict[str, Any]:
    """The client's ``state/...`` and ``personal/...`` records as tensors and plain values
    (``torch.load(weights_only=True)`` reads them back; arrays keep dtype, shape and every bit)."""
    snapshot: dict[str, Any] = {}
    for name in _held(context, STATE_PREFIX, MODEL_PREFIX):
        record = context.state[name]
        if isinstance(record, ArrayRecord):
            snapshot[name] = {"arrays": {key: torch.from_numpy(array.numpy().copy()) for key, array in record.items()}}
        else:
            snapshot[name] = {"config": dict(record)}
    return snapshot


def _install(context: Context, snapshot: dict[str, Any]) -> None:
    """Replace the client's records in ``Context.state`` (state, personal model, backup) by ``snapshot``."""
    for name in _held(context, STATE_PREFIX, MODEL_PREFIX, BACKUP_PREFIX, BACKUP_ROUND):
        del context.state[name]
    for name, record in snapshot.items():
        context.state[name] = (ArrayRecord({key: records.to_array(v) for key, v in record["arrays"].items()})
                               if "arrays" in record else ConfigRecord(record["config"]))
