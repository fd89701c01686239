"""The fedhpro ServerApp: any registered method's server part driving Flower SuperNodes.

One run, as the in-process simulator does it (see :mod:`fedhpro.flower.engine`):

1. resolve the config (defaults, the app's ``base`` settings, then Flower's ``run_config``);
2. wait for the nodes and ask each what it holds (a ``query`` message):
   * partition mode (a named data set): its ``partition-id``; partition ``k`` is
     the simulator's client ``k``, ``clients`` defaults to the nodes' ``num-partitions``;
   * own-data mode (``dataset=clients``): a description of its own folder (name,
     domain, classes, input shape, sizes; no data); nodes are ordered by name, as
     the simulator orders client folders, the class list is resolved over all of
     them (one line naming the nodes when they disagree), and the server builds
     the method's server part from that alone: it holds no data;
3. each round, :class:`MethodStrategy` runs the shared round protocol
   (:class:`~fedhpro.engines.protocol.RoundProtocol`: sampling, fault draws,
   validation, drops, skipped rounds) and only moves its messages: one per
   participant, holding the method's broadcast payload; the replies go back to
   the protocol in client order;
4. evaluation: with one global model in partition mode, on the server's test
   sets; otherwise federated: every node tests (the global model, or its
   personal model) on its own test data and the server pools the counts per
   test set (:func:`~fedhpro.engines.protocol.pool_accuracy`);
5. if ``out`` is set, write ``metrics.jsonl`` (same rows as ``fedhpro run``),
   ``summary.json``, ``config.yaml``, ``partition.json`` and ``server_state.pt``,
   and after every round its rows and, when one is due, a checkpoint
   (``checkpoints/round-NNNNNN.pt``, as ``fedhpro run`` writes them):
   ``resume=<out>`` continues a run whose ServerApp (or SuperLink) was killed.
   The nodes keep each client's state on their own disk (see
   :mod:`fedhpro.flower.client`) under a key of the run that the checkpoints
   keep too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import secrets
import sys
import time
from collections.abc import Callable, Container, Iterable, Mapping
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from fedhpro.bounded import LimitError, load_json
from fedhpro.config import PRESENTATION_KEYS, Config, load_config
from fedhpro.data.federation import few_batches_note
from fedhpro.engines import checkpoint, driver
from fedhpro.engines.driver import RunRows, check_new_run_folder, round_extra
from fedhpro.engines.protocol import OpenRound, Reception, TestCount, pool_accuracy, weighted_mean
from fedhpro.errors import ConfigError, DataError, FedHProError, UpdateError
from fedhpro.files import claim_run_folder, remove_partial_writes
from fedhpro.flower import records, secagg
from fedhpro.flower.engine import ServerSide, build_server_side, config_text, own_data
from fedhpro.flower.roster import load_roster
from fedhpro.flower.settings import (
    FlowerSettings,
    SecureSettings,
    config_from_run_config,
    experiment_keys,
    split_run_config,
)
from fedhpro.privacy import privacy_warnings
from fedhpro.privacy.client import privatized_layout
from fedhpro.resume import resumed_config

#: the ConfigRecord every fedhpro message carries: the resolved config (JSON), the round and the client
HEADER = "fedhpro.header"
#: record-name prefix of the server state sent with client-side evaluation (inference may need it)
SERVER_STATE = "server-state/"
#: what a node answers to a query: its partition (partition mode) or its folder's description (own data)
NODE_RECORD = "fedhpro.node"
#: what a node answers to an evaluation: test-set name, correct and total counts
EVAL_RECORD = "fedhpro.eval"
#: why a client is dropped when its node is gone: the SuperLink no longer lists it, or it stopped sending
#: heartbeats while a message waited for it
NODE_OFFLINE = "node offline"
#: header entry under ``privacy=client``: the round protocol's ClientPrivacy (JSON), which the node privatizes with
PRIVACY = "privacy"
#: seconds a round waits for newly connected SuperNodes to say which client they hold (a restarted node)
REJOIN_WAIT = 120.0


#: bounds on what a node may say about itself (a node's answer is refused beyond them: see :func:`client_info`)
MAX_NAME = 128  # characters of a client's name or domain
MAX_CLASS_NAME = 256  # characters of one class name
MAX_INPUT_DIMS = 4  # dimensions of one input (images: 3 x S x S)
MAX_INPUT_VALUES = 2 ** 28  # values in one input
MAX_SAMPLES = 10 ** 9  # training or test samples of one client
MAX_CLIENTS = 100_000  # num-partitions a node may name
MAX_INFO_CHARS = 16 * 2 ** 20  # characters of a node's JSON description (read before it is parsed)
#: what a node holding its own data may be: image folders or tensor files (fedhpro.data.clients)
CLIENT_KINDS = ("images", "tensors")


class NodeMap(dict[int, int]):
    """``{client index: Flower node id}``, and in own-data mode each client's ClientInfo (``infos``, in
    client order): what recognises a restarted node, which connects with a new node id, as its client.
    ``client_keys``: each client's node's public key as the SuperLink listed it at discovery (empty: none)."""

    def __init__(self, nodes: Mapping[int, int], infos: list[Any] | None = None,
                 keys: Mapping[int, bytes] | None = None):
        super().__init__(nodes)
        self.infos = infos
        self.client_keys = dict(keys or {})


def _integer(value: Any, what: str, least: int, most: int) -> int:
    """``value`` as an int in ``[least, most]`` (a whole-number float passes, a bool does not); UpdateError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UpdateError(f"{what} is a {type(value).__name__}, not a whole number")
    if isinstance(value, float) and (not math.isfinite(value) or value != math.floor(value)):
        raise UpdateError(f"{what}={value!r} is not a whole number")
    if not least <= value <= most:
        raise UpdateError(f"{what}={int(value)} is not in [{least}, {most}]")
    return int(value)


def _text(value: Any, what: str, most: int) -> str:
    """``value`` as a short printable string without path separators; UpdateError otherwise."""
    if not isinstance(value, str):
        raise UpdateError(f"{what} is a {type(value).__name__}, not a string")
    if not 1 <= len(value) <= most:
        raise UpdateError(f"{what} has {len(value)} characters, not 1 to {most}")
    if not value.isprintable() or "/" in value or "\\" in value or value in (".", ".."):
        raise UpdateError(f"{what} {value[:40]!r} holds a character that is not printable or a path separator")
    return value


def _names(value: Any, what: str, most: int) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise UpdateError(f"{what} is a {type(value).__name__}, not a list of class names")
    if len(value) > most:
        raise UpdateError(f"{what} names {len(value)} classes, more than data.max_classes={most}")
    return [_text(name, f"a class name in {what}", MAX_CLASS_NAME) for name in value]


def _answer(record: ConfigRecord | None, keys: tuple[str, ...]) -> ConfigRecord:
    """The node's answer record holding exactly ``keys``; UpdateError naming what is wrong."""
    if record is None:
        raise UpdateError(f"its reply holds no ConfigRecord '{NODE_RECORD}'")
    if set(record) != set(keys):
        extra = sorted(set(record) - set(keys))
        missing = sorted(set(keys) - set(record))
        raise UpdateError(f"its answer holds {sorted(record)[:8]}, not {list(keys)}"
                          f"{f' (unknown: {extra[:4]})' if extra else ''}{f' (missing: {missing})' if missing else ''}")
    return record


def partition_answer(record: ConfigRecord | None) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` from a node's answer to the partition query; UpdateError (one
    line) unless it holds exactly those two whole numbers with ``0 <= partition-id < num-partitions``."""
    answer = _answer(record, ("partition-id", "num-partitions"))
    count = _integer(answer["num-partitions"], "num-partitions", 1, MAX_CLIENTS)
    return _integer(answer["partition-id"], "partition-id", 0, count - 1), count


def client_info(record: ConfigRecord | None, max_classes: int) -> Any:
    """The :class:`~fedhpro.data.clients.ClientInfo` a node's answer to the data query describes; UpdateError
    (one line) unless it is a JSON object of at most :data:`MAX_INFO_CHARS` characters holding exactly the
    ClientInfo fields, each of its type and within its bounds: a short printable name and domain, a known
    kind, at most ``max_classes`` class names (each at most :data:`MAX_CLASS_NAME` characters), ``max_label``
    below ``max_classes``, an input shape of 1 to :data:`MAX_INPUT_DIMS` positive sizes and sizes up to
    :data:`MAX_SAMPLES`. Nothing of it is used before it passed."""
    from fedhpro.data.clients import ClientInfo

    text = _answer(record, ("info",))["info"]
    if not isinstance(text, str):
        raise UpdateError(f"its description is a {type(text).__name__}, not JSON text")
    if len(text) > MAX_INFO_CHARS:
        raise UpdateError(f"its description has {len(text)} characters, more than {MAX_INFO_CHARS}")
    try:
        values = load_json(text, "its description", max_chars=MAX_INFO_CHARS, max_depth=8, allow_nan=False)
    except LimitError as error:
        raise UpdateError(str(error)) from None
    except (ValueError, RecursionError) as error:  # JSONDecodeError, a number too long to convert, NaN
        raise UpdateError(f"its description is not valid JSON ({type(error).__name__})") from None
    fields = [field.name for field in dataclasses.fields(ClientInfo)]
    if not isinstance(values, dict) or set(values) != set(fields):
        held = sorted(map(str, values))[:8] if isinstance(values, dict) else type(values).__name__
        raise UpdateError(f"its description holds {held}, not the fields {fields}")
    if values["kind"] not in CLIENT_KINDS:
        raise UpdateError(f"its kind {str(values['kind'])[:40]!r} is not one of {list(CLIENT_KINDS)}")
    shape = values["input_shape"]
    if not isinstance(shape, list) or not 1 <= len(shape) <= MAX_INPUT_DIMS:
        raise UpdateError(f"its input_shape is not a list of 1 to {MAX_INPUT_DIMS} sizes")
    shape = [_integer(side, "an input_shape size", 1, MAX_INPUT_VALUES) for side in shape]
    if math.prod(shape) > MAX_INPUT_VALUES:
        raise UpdateError(f"its input_shape {shape} holds more than {MAX_INPUT_VALUES} values")
    return ClientInfo(
        name=_text(values["name"], "its name", MAX_NAME),
        domain=None if values["domain"] is None else _text(values["domain"], "its domain", MAX_NAME),
        kind=values["kind"],
        class_names=_names(values["class_names"], "class_names", max_classes),
        declared_classes=_names(values["declared_classes"], "declared_classes", max_classes),
        max_label=None if values["max_label"] is None else _integer(values["max_label"], "max_label", 0,
                                                                    max_classes - 1),
        input_shape=shape,
        train_size=_integer(values["train_size"], "train_size", 0, MAX_SAMPLES),
        test_size=_integer(values["test_size"], "test_size", 0, MAX_SAMPLES))


def max_classes(config: Config) -> int:
    """``data.max_classes`` of the run (the most classes a federation may have)."""
    return int(getattr(config.data, "max_classes", 100_000))


def eval_count(record: ConfigRecord | None, expected: tuple[str, int]) -> TestCount:
    """A node's evaluation answer as a :class:`TestCount`; UpdateError (one line) unless it holds exactly
    ``test-set``, ``correct`` and ``total`` with the test set and size ``expected`` for its client (what it
    declared at discovery, or the server's own copy in partition mode) and ``0 <= correct <= total``."""
    if record is None:
        raise UpdateError(f"its reply holds no ConfigRecord '{EVAL_RECORD}'")
    keys = ("test-set", "correct", "total")
    if set(record) != set(keys):
        raise UpdateError(f"its answer holds {sorted(record)[:8]}, not {list(keys)}")
    name, size = expected
    if record["test-set"] != name:
        raise UpdateError(f"it names the test set {str(record['test-set'])[:40]!r}, not its own {name!r}")
    total = _integer(record["total"], "total", size, size)
    return TestCount(name, _integer(record["correct"], "correct", 0, total), total)


def node_keys(grid: Grid) -> dict[int, bytes]:
    """``{node id: public key}`` of the nodes the SuperLink lists (``Grid.get_nodes()``: flwr 1.42's
    ``NodeInfo.public_key``); empty where the grid gives none."""
    get_nodes = getattr(grid, "get_nodes", None)
    if get_nodes is None:
        return {}
    return {int(info.node_id): bytes(info.public_key) for info in get_nodes() if info.public_key}


def discover_nodes(grid: Grid, clients: int | None, settings: FlowerSettings) -> tuple[dict[int, int], int]:
    """``({partition-id: node id}, number of clients)``: ask every node which partition it holds.

    Waits up to ``settings.node_wait`` seconds for all partitions to connect.
    Raises ConfigError (one line) when the nodes do not cover exactly the
    partitions ``0..K-1`` of a ``K``-client federation.
    """
    deadline = time.monotonic() + settings.node_wait
    known: dict[int, tuple[int, int]] = {}  # node id -> (partition-id, num-partitions)
    ignored: set[int] = set()  # nodes whose answer was malformed: warned about once, not asked again
    while True:
        for node, answer in _ask_new_nodes(grid, set(known) | ignored, {"query": "partition"}, deadline).items():
            try:
                known[node] = partition_answer(answer)
            except UpdateError as error:
                _ignore(node, error, ignored)
        counts = {count for _, count in known.values()}
        if len(counts) > 1:
            raise ConfigError(f"the nodes disagree on num-partitions ({sorted(counts)}); give every SuperNode "
                              "the same num-partitions")
        expected = clients if clients is not None else (counts.pop() if counts else None)
        if expected is not None:
            by_partition: dict[int, int] = {}
            for node, (partition, count) in sorted(known.items()):
                if count != expected or partition >= expected:
                    raise ConfigError(f"node {node} holds partition {partition} of {count}, but the federation has "
                                      f"clients={expected}; set clients={count} or run {expected} SuperNodes "
                                      f"with num-partitions={expected}")
                if partition in by_partition:
                    raise ConfigError(f"nodes {by_partition[partition]} and {node} both hold partition-id={partition}")
                by_partition[partition] = node
            if len(by_partition) == expected:
                return by_partition, expected
        if time.monotonic() > deadline:
            have = sorted(partition for partition, _ in known.values())
            raise ConfigError(f"after {settings.node_wait:.0f} s only partitions {have} of "
                              f"{expected if expected is not None else '?'} have a node; start the missing "
                              "SuperNodes or raise flower.node-wait")
        time.sleep(0.2)


def discover_own_data(grid: Grid, config: Config,
                      settings: FlowerSettings) -> tuple[NodeMap, list[Any], list[str]]:
    """Own-data mode: ``({client index: node id}, the nodes' ClientInfo in client order, class names)``.

    Asks every node to describe its own folder (nothing but counts, names and
    shapes leaves it), waits until ``clients`` nodes have answered (with a
    roster, ``flower.roster``: until every site of the roster has), orders them
    by name (the simulator's order of client folders) and resolves the class
    list over all of them.

    One participant cannot deny the run: a node that answers with an error or a
    malformed description, that the roster does not know (another name, sizes
    beyond its tolerance, another key than the one it pins), that answers with
    a name another node already holds (an impostor: the first to answer keeps
    the name; a roster that pins keys decides instead), or that answers once the
    run has its ``clients`` nodes (a surplus node) is refused with a warning and
    never asked again; the others go on. One-line errors name the nodes that do
    not fit together (classes, input shape).
    """
    from fedhpro.data.clients import ClientInfo, resolve_classes

    roster = load_roster(settings.roster) if settings.roster else None
    expected = config.run.clients
    if roster is not None:
        if expected is not None and expected != len(roster.sites):
            raise ConfigError(f"clients={expected} but flower.roster names {len(roster.sites)} sites; set "
                              f"clients={len(roster.sites)} or leave clients unset")
        expected = len(roster.sites)
    if expected is None:
        raise ConfigError("dataset=clients on Flower needs clients=K, the number of SuperNodes that hold data "
                          "(the server waits for that many), or flower.roster=<file> naming the sites")
    deadline = time.monotonic() + settings.node_wait
    known: dict[int, ClientInfo] = {}  # node id -> what it holds (admitted)
    by_name: dict[str, int] = {}
    ignored: dict[int, str] = {}  # node id -> why it takes no part: warned about once, not asked again
    query = {"query": "data", "config": config_text(config)}
    keys = node_keys(grid) if roster is not None and any(site.key for site in roster.sites.values()) else {}
    while len(known) < expected:
        errors: dict[int, str] = {}
        answers = _ask_new_nodes(grid, set(known) | set(ignored), query, deadline, errors)
        for node, reason in sorted(errors.items()):
            _refuse(node, f"it answered with an error: {reason}", ignored)
        if roster is not None and any(site.key for site in roster.sites.values()) and set(answers) - set(keys):
            keys = node_keys(grid)  # nodes that connected since
        for node, answer in sorted(answers.items()):
            try:
                info = client_info(answer, max_classes(config))
            except UpdateError as error:
                _refuse(node, f"its answer to the query is malformed: {error}", ignored)
                continue
            problem = roster.problem(info.name, info.train_size, info.test_size, keys.get(node)) \
                if roster is not None else None
            if problem is None and info.name in by_name:
                problem = f"node {by_name[info.name]} already holds the client named {info.name!r} (an impostor?)"
            if problem is None and len(known) >= expected:
                problem = f"the run already has its {expected} data-holding SuperNodes (a surplus node)"
            if problem is not None:
                _refuse(node, problem, ignored)
                continue
            known[node], by_name[info.name] = info, node
        if len(known) < expected and time.monotonic() > deadline:
            refused = "; ".join(f"node {node}: {why}" for node, why in sorted(ignored.items())[:5])
            raise ConfigError(f"after {settings.node_wait:.0f} s only {len(known)} of {expected} data-holding "
                              f"SuperNodes answered ({', '.join(sorted(by_name)) or 'none'})"
                              f"{f'; refused: {refused}' if refused else ''}; start the missing SuperNodes, set "
                              "clients= to the number running, or raise flower.node-wait")
        if len(known) < expected:
            time.sleep(0.2)
    names = sorted(by_name)
    infos = [known[by_name[name]] for name in names]
    try:
        classes = resolve_classes(infos, config.data)
    except DataError as error:
        raise ConfigError(f"the nodes' data do not fit together: {error}") from None
    if len(classes) > max_classes(config):
        raise ConfigError(f"the nodes hold {len(classes)} classes together, more than data.max_classes="
                          f"{max_classes(config)}; raise data.max_classes if that many is right")
    return NodeMap({k: by_name[name] for k, name in enumerate(names)}, infos), infos, classes


def _refuse(node: int, why: str, ignored: dict[int, str]) -> None:
    """A node that takes no part in the run: one warning naming it and why; it is not asked again."""
    log(WARNING, "fedhpro: node %d is refused: %s", node, why)
    ignored[node] = why


def _ignore(node: int, error: Exception, ignored: set[int]) -> None:
    """A node whose answer to the query is malformed takes no part: one warning, and it is not asked again."""
    log(WARNING, "fedhpro: node %d is ignored: its answer to the query is malformed: %s", node, error)
    ignored.add(node)


def _ask_new_nodes(grid: Grid, known: Container[int], query: dict[str, Any], deadline: float,
                   errors: dict[int, str] | None = None) -> dict[int, ConfigRecord | None]:
    """Send ``query`` to every connected node not in ``known``; ``{node id: its answer}`` (its
    ``fedhpro.node`` ConfigRecord, None if its reply holds none: the caller validates the answer).

    An error reply is a one-line ConfigError naming the node, or, when ``errors`` is given (a node
    rejoining a run that goes on), its reason is put there. Replies are matched to the nodes asked by
    the message they answer: an error the SuperLink writes for an offline node comes from the SuperLink.
    """
    new = [node for node in grid.get_node_ids() if node not in known]
    if not new:
        return {}
    messages = [Message(RecordDict({HEADER: ConfigRecord(query)}), node, MessageType.QUERY) for node in new]
    replies = list(grid.send_and_receive(messages, timeout=max(1.0, deadline - time.monotonic())))
    answers = {}
    for node, reply in _match_replies(list(zip(new, messages, strict=True)), replies).items():
        if not reply.has_error():
            answers[node] = reply.content.config_records.get(NODE_RECORD)
        elif errors is None:
            raise ConfigError(f"node {node} cannot take part: {_first_line(reply.error.reason)}")
        else:
            errors[node] = _first_line(reply.error.reason) or f"error code {reply.error.code}"
    return answers


def _first_line(text: Any, most: int = 500) -> str:
    """The first line of a node's text (an error reason), at most ``most`` characters: it goes into a log."""
    line = (str(text or "").strip().splitlines() or [""])[0]
    return line if len(line) <= most else line[:most] + "..."


def _error_reason(error: Error) -> str:
    """One line for an error reply: the SuperLink's own for a node that stopped sending heartbeats while
    the message waited, else the node's reason (``raised <Error>: <message>``)."""
    if error.code == ErrorCode.NODE_UNAVAILABLE:
        return f"{NODE_OFFLINE} (no heartbeat for 2 intervals)"
    return _first_line(error.reason) or f"error code {error.code}"


def _match_replies(sent: list[tuple[int, Message]], replies: list[Message]) -> dict[int, Message]:
    """``{key: reply}`` for ``sent``, a list of ``(key, message)`` with unique keys (node ids, clients).

    A reply belongs to the message it answers (its message id, set when the grid pushed it), else to the
    one sent to the node it came from (replies made without a grid, as in tests). Stray replies (a
    message of an earlier round answered late) are left out."""
    by_id = {message.metadata.message_id: key for key, message in sent if message.metadata.message_id}
    by_node = {message.metadata.dst_node_id: key for key, message in sent}
    matched = {}
    for reply in replies:
        target = by_id.get(reply.metadata.reply_to_message_id, by_node.get(reply.metadata.src_node_id))
        if target is not None:
            matched[target] = reply
    return matched


@dataclasses.dataclass(frozen=True)
class Secure:
    """A run under ``flower.secure-aggregation=secagg+``: the vector layout, SecAgg+'s settings, the scale of
    the summed values (the largest training-set size) and each SecAgg+ stage's timeout."""

    layout: secagg.SecureLayout
    settings: SecureSettings
    scale: float
    timeout: float


def secure_for(config: Config, side: ServerSide, settings: FlowerSettings) -> Secure | None:
    """The run's :class:`Secure`, None without secure aggregation; ConfigError (one line) for what SecAgg+
    cannot do (:func:`fedhpro.flower.secagg.check_secure_run`)."""
    if settings.secure_aggregation != "secagg+":
        return None
    participants = len(side.protocol.sample_clients(0))
    layout = secagg.check_secure_run(config, side.server, participants, settings.secagg)
    # the scale (the largest weight a client may pack) is the capped size: a client's share stays <= 1
    return Secure(layout, settings.secagg, float(max(side.protocol.capped_sizes(side.num_samples))),
                  settings.round_timeout)


class MethodStrategy(Strategy):
    """A Flower Strategy running one fedhpro method through the shared round protocol.

    It subclasses ``Strategy`` rather than ``FedAvg``: a fedhpro reply carries
    several ArrayRecords (weights, prototypes, class gradients), which FedAvg's
    reply validation rejects and its aggregation would average. Every reply is
    decoded back to the method's payload and handed to the protocol, which
    validates it and gives it to the method's own server part, so any method
    runs unchanged.
    """

    def __init__(self, side: ServerSide, config: Config, nodes: dict[int, int], run_key: str | None = None,
                 node_auth: bool = False, secure: Secure | None = None):
        """``run_key``: the key under which the nodes keep the clients' state on disk (:func:`run_key`;
        None: they keep none). A resumed run takes its key, rows and round offset from its checkpoint
        (:meth:`load_state_dict`). ``node_auth`` (``flower.node-auth``): the SuperLink authenticates its
        SuperNodes, so a node that comes back with a new node id must show the key its client's node had
        at discovery (``nodes.client_keys``). ``secure`` (``flower.secure-aggregation=secagg+``): the uploads
        are summed by Flower's SecAgg+ and the protocol gets replies rebuilt from the sum
        (:mod:`fedhpro.flower.secagg`)."""
        self.side = side
        self.secure = secure
        self._outcome: secagg.SecureOutcome | None = None
        self._asked: dict[int, int] = {}  # node id -> client, of the current SecAgg+ round
        self.config = config
        self.nodes = nodes  # client index -> Flower node id
        self.partition_of = {node: k for k, node in nodes.items()}
        self.text = config_text(config)
        self.run = RunRows()  # metrics.jsonl's and timing.jsonl's rows, the first round of this start
        self.started = time.perf_counter()
        self._round: OpenRound | None = None
        self._times: dict[str, float] = {}
        self._server_metrics: dict[str, float] = {}
        self.refused: dict[int, int] = {}  # client -> the round of its latest reply refused as invalid
        self.run_key = run_key
        self.keep_from: int | None = None  # the oldest round the run can go back to (its oldest checkpoint)
        self.after_round: Callable[[MethodStrategy], None] | None = None  # called once each round's row is in
        self.strangers: set[int] = set()  # node ids asked once that hold no client of this run (not asked again)
        self.node_auth = node_auth
        #: client -> its node's public key at discovery
        self.keys: dict[int, bytes] = dict(getattr(nodes, "client_keys", {}))
        #: new node id -> the client it claims, whose node was still online: it takes over once that node is gone
        self.waiting: dict[int, int] = {}
        self._tests: dict[int, tuple[str, int]] | None = None  # client -> (its test set, its size)
        self._sent: list[tuple[int, Message]] = []  # (client, message) of the current train or evaluate step

    @property
    def server(self) -> Any:
        return self.side.server

    # ------------------------------------------------------------------ helpers

    def _header(self, round: int, client: int) -> ConfigRecord:
        # refused-round: the round whose reply from this client the server refused as invalid, so that the
        # node restores its state from before that fit (the simulator's rule); -1: none
        # state-key, keep-from: where the node keeps the client's state on disk, and the oldest round the
        # run can go back to (the node keeps the state from before it; fedhpro.flower.client.StateStore)
        header = ConfigRecord({"config": self.text, "round": round, "client": client,
                               "num-clients": len(self.nodes), "refused-round": self.refused.get(client, -1),
                               "state-key": self.run_key or "",
                               "keep-from": round if self.keep_from is None else self.keep_from})
        if self.side.protocol.client_privacy is not None:  # privacy=client: the node privatizes its reply
            header[PRIVACY] = json.dumps(dataclasses.asdict(self.side.protocol.client_privacy))
        if self.secure is not None:  # the node packs its reply for SecAgg+ (fedhpro.flower.secagg.client_vector)
            header[secagg.SCALE] = self.secure.scale
            header[secagg.CLIP] = self.secure.settings.clipping_range
        return header

    # the rows so far; first_round: rounds done before this start (a resumed run): Flower's round 1 is this round
    rows = property(lambda self: self.run.metrics)
    timings = property(lambda self: self.run.timings)
    first_round = property(lambda self: self.run.first_round)

    def round_index(self, server_round: int) -> int:
        """fedhpro's round (from 0) of Flower's ``server_round`` (from 1 at every start; a resumed run
        starts after its checkpoint's rounds)."""
        return self.first_round + server_round - 1

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs besides the rows: the method's server state, the refused replies (their
        nodes may not have heard yet) and the key of the clients' state on the nodes."""
        return {"engine": "flower", "server": self.server.state_dict(), "refused": dict(self.refused),
                "run_key": self.run_key or ""}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's state (its rows and round: :meth:`driver.RunFolder.resume`)."""
        self.server.load_state_dict(state["server"])
        self.refused = {int(k): int(r) for k, r in state["refused"].items()}
        self.run_key = state["run_key"] or None

    def _rejoin(self, grid: Grid) -> set[int]:
        """The node ids the SuperLink lists as online, after mapping any new node back to its client.

        A restarted SuperNode connects with a new node id. Before a round's messages go out, every
        node not seen before is asked what it holds, as at the start (partition mode: its partition-id;
        own-data mode: its folder's description, recognised by name and folder), and its answer is
        validated as at discovery. It takes over that client from the old node id only once the old node
        is no longer listed online (until then it waits; one warning), and, with ``flower.node-auth``,
        only with the public key the client's node had at discovery. A node that holds no client of this
        run, or answers malformed, or shows another key, is warned about once and not asked again; one that
        does not answer within :data:`REJOIN_WAIT` is asked again before the next step.
        """
        online = set(grid.get_node_ids())
        for node, claimed in sorted(self.waiting.items()):  # claims that waited for their client's node to leave
            if node not in online:
                del self.waiting[node]
            elif self.nodes[claimed] not in online:
                del self.waiting[node]
                self._hand_over(claimed, node)
        seen = set(self.partition_of) | self.strangers | set(self.waiting)
        if online <= seen:
            return online
        infos = getattr(self.nodes, "infos", None)
        query = {"query": "data", "config": self.text} if infos is not None else {"query": "partition"}
        errors: dict[int, str] = {}
        answers = _ask_new_nodes(grid, seen, query, time.monotonic() + REJOIN_WAIT, errors)
        for node, reason in sorted(errors.items()):
            self._estrange(node, f"it cannot take part: {reason}")
        for node in sorted(online - seen - set(answers) - set(errors)):  # asked again before the next step
            log(WARNING, "fedhpro: node %d did not say what it holds within %.0f s", node, REJOIN_WAIT)
        keys = node_keys(grid) if answers and self.node_auth else {}
        for node, answer in sorted(answers.items()):
            k, problem = self._client_held(answer, infos)
            if k is None:
                self._estrange(node, problem)
            elif self.node_auth and (not keys.get(node) or keys.get(node) != self.keys.get(k)):
                self._estrange(node, f"it claims client {k} but its public key is not the one client {k}'s node "
                                     "had at the start of the run (flower.node-auth)")
            elif any(claimed == k for claimed in self.waiting.values()) or self.nodes[k] in online:
                holder = self.nodes[k]
                log(WARNING, "fedhpro: node %d claims client %d, whose node %d is still online (or claimed first): "
                    "it takes the client over only once that node is gone", node, k, holder)
                self.waiting[node] = k
            else:
                self._hand_over(k, node)
        return online

    def _hand_over(self, k: int, node: int) -> None:
        old = self.nodes[k]
        log(WARNING, "fedhpro: client %d is now on node %d (node %d left; a restarted SuperNode)", k, node, old)
        self.strangers.add(old)
        del self.partition_of[old]
        self.nodes[k], self.partition_of[node] = node, k

    def _client_held(self, answer: ConfigRecord | None, infos: list[Any] | None) -> tuple[int | None, str]:
        """``(client index, "")`` for a new node's answer to the rejoin query, or ``(None, why not)``."""
        if infos is None:
            try:
                partition, count = partition_answer(answer)
            except UpdateError as error:
                return None, f"its answer to the query is malformed: {error}"
            if count != len(self.nodes):
                return None, f"it holds partition {partition} of {count}, but this run has {len(self.nodes)} clients"
            return partition, ""
        try:
            info = client_info(answer, max_classes(self.config))
        except UpdateError as error:
            return None, f"its answer to the query is malformed: {error}"
        names = [known.name for known in infos]
        if info.name not in names:
            shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
            return None, f"it holds a client named {info.name!r}, not one of this run's ({shown})"
        k = names.index(info.name)
        if info != infos[k]:
            return None, f"its folder {info.name!r} is not the one client {k} had at the start of the run"
        return k, ""

    def _estrange(self, node: int, why: str) -> None:
        log(WARNING, "fedhpro: node %d takes no part in this run: %s", node, why)
        self.strangers.add(node)

    def summary(self) -> None:
        log(INFO, "\t├── fedhpro method: %s on %s, %d clients (one per SuperNode)",
            self.config.run.method, self.config.run.dataset, len(self.nodes))

    # ------------------------------------------------------------------ training

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One message per client the protocol asks, each with its own RecordDict (the payload is per round,
        the header per client); a client the fault model drops gets none, as in the simulator, and a client
        whose node the SuperLink no longer lists is dropped at once (no round-timeout to wait for it)."""
        current = self._round = self.side.protocol.open(self.round_index(server_round))
        online = self._rejoin(grid)
        encoded = records.encode_payload(current.payload)
        self._sent = []
        if self.secure is not None:
            self._secure_round(grid, current, encoded, online)
            return []  # the SecAgg+ stages have run: nothing more to send this step
        for k in current.to_ask:
            if self.nodes[k] in online:
                self._sent.append((k, Message(RecordDict({**encoded, HEADER: self._header(current.round, k)}),
                                              self.nodes[k], MessageType.TRAIN)))
            else:
                current.fail(k, NODE_OFFLINE)
        return [message for _, message in self._sent]

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Hand every reply to the protocol in client order (the simulator's order), then close the round."""
        current = self._round
        assert current is not None
        if self.secure is not None:
            self._receive_secure(current)
        answers = _match_replies(self._sent, list(replies))  # read once
        for k, _ in self._sent:
            reply = answers.get(k)
            if reply is None:
                current.fail(k, "no reply before flower.round-timeout")
            elif reply.has_error():
                current.fail(k, _error_reason(reply.error))
            else:
                try:
                    payload = records.decode_payload(reply.content, self.side.device, expected=self._reply_layout())
                    metrics = records.decode_metrics(reply.content)
                except FedHProError as error:  # a malformed reply: refused like an invalid update
                    current.fail(k, f"invalid update: {error}")
                    self.refused[k] = current.round
                    continue
                reception = current.receive(k, payload, metrics, self.side.num_samples[k])
                if reception is Reception.INVALID:
                    self.refused[k] = current.round
        client_seconds = time.perf_counter() - current.started
        timer = time.perf_counter()
        self._server_metrics = current.close()
        self._times = {"clients": client_seconds, "server": time.perf_counter() - timer}
        arrays = ArrayRecord({key: records.to_array(v) for key, v in self.server.global_weights().items()})
        return arrays, records.encode_metrics(weighted_mean(current.train_metrics))

    def _reply_layout(self) -> dict[str, Any]:
        """What a client's reply must hold: the method's layout, under ``privacy=client`` with the privacy's
        holder vector (:func:`fedhpro.privacy.client.privatized_layout`)."""
        layout = self.server.reply_layout()
        if self.side.protocol.client_privacy is not None:
            return privatized_layout(layout, int(self.server.num_classes))
        return layout

    # ------------------------------------------------------------------ secure aggregation

    def _secure_round(self, grid: Grid, current: OpenRound, encoded: Mapping[str, Any], online: set[int]) -> None:
        """Run the round's SecAgg+ stages (Flower's workflow) over the participants whose node is online:
        each gets the round's payload and its header in the stage where it trains."""
        assert self.secure is not None
        contents: dict[int, RecordDict] = {}
        self._asked = {}
        for k in current.to_ask:
            if self.nodes[k] in online:
                contents[self.nodes[k]] = RecordDict({**encoded, HEADER: self._header(current.round, k)})
                self._asked[self.nodes[k]] = k
            else:
                current.fail(k, NODE_OFFLINE)
        self._outcome = None
        if len(contents) < 2:
            for k in self._asked.values():
                current.fail(k, "not asked: secure aggregation needs at least 2 answering participants")
            self._asked = {}
            return
        self._outcome = secagg.run_round(grid, current.round, contents, self.secure.settings, self.secure.layout.size,
                                         self.secure.timeout, _error_reason)

    def _receive_secure(self, current: OpenRound) -> None:
        """Hand the protocol one reply per summed client, rebuilt from the secure sum (all carrying the
        aggregate); the clients SecAgg+ dropped fail with its reason. A dropped client whose node trained
        goes back to its state from before the round (marked refused: its update was not used)."""
        assert self.secure is not None
        outcome, asked = self._outcome, self._asked
        summed = [] if outcome is None else outcome.summed
        for node, k in sorted(asked.items(), key=lambda item: item[1]):
            if node in summed:
                continue
            assert outcome is not None
            reason = outcome.failures.get(node) or (
                f"SecAgg+ stopped in stage {outcome.halted}: fewer nodes left than its threshold"
                if outcome.halted else "dropped in SecAgg+")
            current.fail(k, reason)
            self.refused[k] = current.round
        if outcome is None or not summed or outcome.total is None:
            return
        clients = sorted(asked[node] for node in summed)
        names = sorted({name for node in summed for name in outcome.metric_names.get(node, [])})
        # what the sum may hold: each client's weight at most the cap (aggregation.max_share)
        num_samples = self.side.protocol.capped_sizes([self.side.num_samples[k] for k in clients])
        try:
            replies, metrics = secagg.rebuild_replies(self.secure.layout, outcome.total,
                                                      current.payload.get("weights") or {}, num_samples,
                                                      self.secure.scale, self.secure.settings.step, names)
        except UpdateError as error:  # the sum cannot come from these clients: none of it is used
            for k in clients:
                current.fail(k, f"invalid secure sum: {error}")
                self.refused[k] = current.round
            return
        for k, reply in zip(clients, replies, strict=True):
            if current.receive(k, reply, dict(metrics), self.side.num_samples[k]) is Reception.INVALID:
                self.refused[k] = current.round

    # ------------------------------------------------------------------ evaluation

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Federated evaluation: every node tests on its own data (the global model, or its personal model
        with the global shared part, through the server's inference rule, whose state travels along). A
        global model in partition mode is tested on the server: no messages. A node the SuperLink no longer
        lists gets none (its client is not evaluated this round)."""
        round = self.round_index(server_round)
        self._times["eval_started"] = time.perf_counter()
        self._sent = []
        if not self.side.protocol.evaluates(round) or not self.side.federated_evaluation:
            return []
        online = self._rejoin(grid)
        encoded = records.encode_payload({"weights": self.server.global_weights()})
        encoded.update(records.encode_payload(self.server.state_dict(), prefix=SERVER_STATE))
        self._sent = [(k, Message(RecordDict({**encoded, HEADER: self._header(round, k)}), node, MessageType.EVALUATE))
                      for k, node in sorted(self.nodes.items()) if node in online]
        return [message for _, message in self._sent]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The round's accuracy as the simulator computes it; then the round's row is complete."""
        current = self._round
        assert current is not None
        accuracy, extra = None, {}
        if self.side.protocol.evaluates(current.round):
            missing: list[dict[str, Any]] = []
            if self.side.federated_evaluation:
                accuracy, per_client, missing = self._pooled_accuracy(current.round, list(replies))
            else:
                engine = self.side.engine
                assert engine is not None, "only partition mode (which has the engine) evaluates on the server"
                accuracy, per_client = engine.evaluate_clients()
            extra = round_extra(None, per_client, None, missing)
        seconds = {"clients": self._times["clients"], "server": self._times["server"],
                   "eval": time.perf_counter() - self._times["eval_started"]}
        record = current.record(self._server_metrics, accuracy, seconds, extra)
        if self.side.engine is not None:
            self.side.engine.history.append(record)
        self.run.add(record, time.perf_counter() - self.started)
        if self.after_round is not None:
            self.after_round(self)
        if accuracy is None:
            return None
        log(INFO, "fedhpro: round %d: test accuracy AVG %.2f%%", current.round, accuracy["AVG"])
        return MetricRecord({f"accuracy.{name}": value for name, value in accuracy.items()})

    def client_test(self, k: int) -> tuple[str, int]:
        """``(test-set name, size)`` client ``k`` is tested on: in partition mode the server's copy of it
        (the simulator's :meth:`~fedhpro.engines.simulator.Simulator.client_test`), with its own data what
        its node declared at discovery (its domain, else ``all``, as the node's federation names it)."""
        if self._tests is None:
            engine, infos = self.side.engine, getattr(self.nodes, "infos", None)
            if engine is not None:
                tests = {k: engine.client_test(k) for k in self.nodes}
                self._tests = {k: (name, int(y.shape[0])) for k, (name, (_, y)) in tests.items()}
            else:
                assert infos is not None, "own-data mode: the nodes described their data at discovery"
                self._tests = {k: (info.domain or "all", int(info.test_size)) for k, info in enumerate(infos)}
        return self._tests[k]

    def _pooled_accuracy(self, round: int, replies: list[Message]
                         ) -> tuple[dict[str, float] | None, list[float | None], list[dict[str, Any]]]:
        """``(accuracy, per-client accuracies, clients not evaluated with the reason)``: the test counts of
        the clients that answered, pooled per test set (the simulator's :func:`pool_accuracy`); per-client
        accuracies in client order, of those clients only. A client whose node is offline, sent no answer
        before flower.round-timeout, answered with an error or with counts it cannot have (:func:`eval_count`:
        another test set, another size, ``correct`` outside ``[0, total]``) is not evaluated; with none
        evaluated the round has no accuracy. Every node answering with an error of its own (not the
        SuperLink's "node offline") is a bug or a setting, not a fault: that raises, as a round where every
        client failed does."""
        counts: dict[int, TestCount] = {}
        reasons: dict[int, str] = {}
        own_errors = []  # clients whose node raised (not the SuperLink's "node offline")
        for k, reply in _match_replies(self._sent, replies).items():
            if reply.has_error():
                reasons[k] = _error_reason(reply.error)
                if reply.error.code != ErrorCode.NODE_UNAVAILABLE:
                    own_errors.append(k)
                continue
            try:
                counts[k] = eval_count(reply.content.config_records.get(EVAL_RECORD), self.client_test(k))
            except UpdateError as error:  # counts it cannot have: not pooled
                reasons[k] = f"invalid evaluation: {error}"
        if self._sent and len(own_errors) == len(self._sent):
            first = min(own_errors)
            raise FedHProError(f"round {round}: every client failed to evaluate; client {first}: {reasons[first]}")
        asked = dict(self._sent)
        missing = []
        for k in sorted(set(self.nodes) - set(counts)):
            reason = reasons.get(k, "no answer before flower.round-timeout" if k in asked else NODE_OFFLINE)
            log(WARNING, "fedhpro: round %d: client %d not evaluated: %s", round, k, reason)
            missing.append({"client": k, "reason": reason})
        if not counts:
            return None, [], missing
        ordered = [counts[k] for k in sorted(counts)]
        order = list(self.side.engine.federation.test_sets) if self.side.engine is not None else None
        accuracy = pool_accuracy(ordered, order, self.side.protocol.aggregation.max_share)
        # a client without test data of its own is not tested (None: no accuracy, out of the fairness statistics)
        return accuracy, [c.accuracy if c.total else None for c in ordered], missing


def run_server(grid: Grid, run_config: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> MethodStrategy:
    """Run the experiment that ``base`` + ``run_config`` describe on the nodes of ``grid``; return the strategy.

    With ``resume=<folder>`` it continues the run in that folder from its newest checkpoint instead, with
    that run's config (``fedhpro run``'s rule: keys that would change what it computes are refused).
    """
    config, settings = config_from_run_config(run_config, base)
    base = experiment_keys(base)  # its flower.* settings are in `settings`
    folder = config.run.resume or config.run.out
    # the out folder is this ServerApp's until it ends (fedhpro run's rule): a second run on it is refused in
    # one line; claimed before the folder is read, so a resume reads no files a live run is writing
    with claim_run_folder(Path(folder), setting="resume" if config.run.resume else "out") if folder \
            else contextlib.nullcontext():
        return _run_server(grid, run_config, base, config, settings)


def _run_server(grid: Grid, run_config: Mapping[str, Any], base: Mapping[str, Any] | None, config: Config,
                settings: FlowerSettings) -> MethodStrategy:
    """:func:`run_server` once its out folder (if any) is claimed."""
    resume_from = None
    if config.run.resume:
        config, resume_from = resumed_config(config, base, split_run_config(run_config)[0])
    config = load_config(config.to_dict(), {"progress": False})  # no progress bars in a server log
    if config.privacy.mode != "none" and config.privacy.secure_noise is None:
        # a deployment's noise must not be redrawable from the config: the OS's randomness unless the run
        # asks for seeded noise (privacy.secure_noise=false, e.g. to compare with the simulator)
        config = load_config(config.to_dict(), {"privacy.secure_noise": True})
    if settings.secure_aggregation == "secagg+":
        secagg.check_secure_config(config)  # before any node is asked
    out = Path(config.run.resume) if config.run.resume else Path(config.run.out) if config.run.out else None
    if out is not None:
        for where in (out, checkpoint.checkpoint_dir(out)):  # what a killed ServerApp left half-written
            remove_partial_writes(where)
    if out is not None and resume_from is None:
        check_new_run_folder(out)  # before any node is asked: another run's results must not be overwritten
    started = time.perf_counter()

    def warn(message: str) -> None:
        log(WARNING, "fedhpro: %s", message)

    nodes: dict[int, int]  # client index -> node id (own data: a NodeMap, which also knows the clients' names)
    if own_data(config):
        if config.run.data_dir:
            raise ConfigError("dataset=clients on Flower: the server holds no data, so data_dir must not be set in "
                              "the run config; give each SuperNode its own with --node-config \"data-dir=...\"")
        nodes, infos, classes = discover_own_data(grid, config, settings)
        config = load_config(config.to_dict(), {"data.classes": classes})
        side = build_server_side(config, num_classes=len(classes), input_shape=tuple(infos[0].input_shape),
                                 num_samples=[info.train_size for info in infos], on_drop=warn)
        partition = {"dataset": "clients", "scheme": "given", "engine": "flower", "num_classes": len(classes),
                     "classes": classes,
                     "clients": [{"client": k, "node": nodes[k], **dataclasses.asdict(info)}
                                 for k, info in enumerate(infos)]}
        notes = [f"clients: {len(infos)} SuperNodes holding their own data ({infos[0].kind}), {len(classes)} classes"]
        from fedhpro.data.clients import client_notes

        notes += client_notes(infos)  # clients without a test split, domains nobody tests
    else:
        nodes, clients = discover_nodes(grid, config.run.clients, settings)
        if config.run.clients is None:
            config = load_config(config.to_dict(), {"clients": clients})
        side = build_server_side(config, on_drop=warn)
        assert side.engine is not None, "partition mode builds the whole engine"
        federation = side.engine.federation
        if federation.num_clients != clients:
            raise ConfigError(f"the federation has {federation.num_clients} clients but {clients} SuperNodes "
                              f"hold partitions; set clients={federation.num_clients} or run that many SuperNodes")
        partition, notes = federation.partition, federation.notes
    # sizes are claims (own data: what each node declared): a round's weights are capped by them
    side.protocol.client_sizes = list(side.num_samples)
    pooled = ([(info.domain or "all", int(info.test_size)) for info in infos] if own_data(config)
              else getattr(side.engine, "pooled_test_sizes", list)())
    few = few_batches_note(side.num_samples, config.run.batch_size,
                           [info.name for info in infos] if own_data(config) else None)
    if few is not None:  # as fedhpro run says it: a note of the run's (after the data's), kept in summary.json
        log(INFO, "fedhpro: note: %s", few)
        notes.append(few)
    for line in (driver.pooled_share_warnings(pooled, config.aggregation.max_share)
                 + privacy_warnings(config.privacy, len(side.num_samples), side.num_samples)):
        warn(line)
        notes.append(line)
    nodes = NodeMap(nodes, getattr(nodes, "infos", None), _client_keys(grid, nodes, settings))
    strategy = MethodStrategy(side, config, nodes, run_key(config, secrets.token_hex(8)), settings.node_auth,
                              secure_for(config, side, settings))
    folder = driver.RunFolder(out, config.run, strategy.run, started) if out is not None else None
    if folder is not None and resume_from is not None:
        resume_strategy(strategy, folder, resume_from)
    elif folder is not None:
        folder.start(config.to_dict(), partition)
    if folder is not None:
        strategy.after_round = after_round(folder)
        folder.privacy = side.protocol.privacy_summary()  # summary.json's privacy block, as fedhpro run's
    last, stop = budgeted_rounds(side.protocol, strategy.first_round, config.run.rounds)
    initial = ArrayRecord({key: records.to_array(v) for key, v in side.server.global_weights().items()})
    if last > strategy.first_round:
        strategy.start(grid, initial, num_rounds=last - strategy.first_round, timeout=settings.round_timeout)
    if stop is not None:  # privacy.max_epsilon: a normal end, its rows and summary kept
        log(WARNING, "fedhpro: %s", stop)
        if folder is not None:
            folder.privacy = folder.privacy or {}
            folder.privacy["stopped"] = stop
    if folder is not None:
        from fedhpro.trained import MODEL_FILE, write_server_model

        with driver.stop_on_write_error(folder.out, folder.out / MODEL_FILE):  # before summary.json
            write_server_model(folder.out, side, partition)
        write_results(folder, strategy, time.perf_counter() - started, notes)
    forget_client_state(grid, strategy, settings)
    return strategy


def budgeted_rounds(protocol: Any, first: int, rounds: int) -> tuple[int, str | None]:
    """``(the round the run ends before, the privacy.max_epsilon line that ends it early or None)``: the
    round protocol's budget stop (:meth:`~fedhpro.engines.protocol.RoundProtocol.budget_stop`, the seeded
    participations make it known before the rounds run), so a Flower run stops where ``fedhpro run`` does."""
    for round in range(first, rounds):
        stop = protocol.budget_stop(round)
        if stop is not None:
            return round, stop
    return rounds, None


def _client_keys(grid: Grid, nodes: Mapping[int, int], settings: FlowerSettings) -> dict[int, bytes]:
    """Each client's node's public key as the SuperLink lists it now, and one line saying what a client's
    identity rests on. ``flower.node-auth=true`` (the SuperLink runs with ``--enable-supernode-auth``):
    on those keys, so every node must have one. Otherwise on its partition-id, or its name and folder:
    without authentication a SuperNode draws a new key pair at every start (flwr 1.42 registers it with
    that key), so a key says nothing about who restarted."""
    keys = node_keys(grid)
    by_client = {k: keys[node] for k, node in nodes.items() if node in keys}
    if settings.node_auth:
        keyless = sorted(node for node in nodes.values() if node not in keys)
        if keyless:
            raise ConfigError(f"flower.node-auth=true but the SuperLink lists no public key for node(s) "
                              f"{', '.join(map(str, keyless[:10]))}; start the SuperLink with "
                              "--enable-supernode-auth, or set flower.node-auth=false")
        log(INFO, "fedhpro: node keys recorded (flower.node-auth): a SuperNode that comes back with a new node "
            "id takes its client back only with the same key, once the client's node is offline")
    else:
        log(WARNING, "fedhpro: node keys are not checked (flower.node-auth=false): a client's identity rests on "
            "the partition-id (own data: the name and folder description) its node reports; a node reporting "
            "those of a client whose node is offline takes that client over. With --enable-supernode-auth on "
            "the SuperLink, set flower.node-auth=true")
    return by_client


def run_key(config: Config, token: str) -> str:
    """The key under which the nodes keep a run's client state: 16 hex digits hashing what the run computes
    (its config without the presentation keys) and ``token``, drawn when the run starts and kept in its
    checkpoints, so that a resumed run finds its state and a new run of the same config starts clean."""
    values = {key: value for key, value in config.to_dict().items() if key not in PRESENTATION_KEYS}
    text = json.dumps(values, sort_keys=True, default=str) + token
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def after_round(folder: driver.RunFolder) -> Callable[[MethodStrategy], None]:
    """What a run writes into its folder after every round, as ``fedhpro run`` does
    (:meth:`driver.RunFolder.after_round`): its rows and, when one is due, a checkpoint of
    :meth:`MethodStrategy.state_dict`; the nodes may then forget what is older than the oldest kept."""

    def written(strategy: MethodStrategy) -> None:
        if folder.after_round(strategy.state_dict):
            strategy.keep_from = min(checkpoint.saved_rounds(folder.out))

    return written


def resume_strategy(strategy: MethodStrategy, folder: driver.RunFolder, newest: Path) -> None:
    """Load the checkpoint ``newest`` of the run in ``folder`` into ``strategy``: it goes on after its rounds,
    with its rows (``timing.jsonl``'s of those rounds too) and the nodes' state key."""
    folder.resume(newest, strategy.load_state_dict, engine="flower", where=f"resume={strategy.config.run.resume}")
    strategy.keep_from = min(checkpoint.saved_rounds(folder.out))
    log(INFO, "fedhpro: resuming %s after round %d of %d", folder.out, strategy.first_round,
        strategy.config.run.rounds)


def forget_client_state(grid: Grid, strategy: MethodStrategy, settings: FlowerSettings) -> None:
    """The run is over: every node deletes the clients' state it kept for it (best effort: a node that does
    not answer keeps it, in ``<state-dir>/<run key>``, until deleted by hand)."""
    if not strategy.run_key:
        return
    query = ConfigRecord({"query": "forget", "state-key": strategy.run_key})
    messages = [Message(RecordDict({HEADER: query}), node, MessageType.QUERY) for node in strategy.nodes.values()]
    for reply in grid.send_and_receive(messages, timeout=min(60.0, settings.round_timeout)):
        if reply.has_error():
            log(WARNING, "fedhpro: node %d kept this run's client state: %s", reply.metadata.src_node_id,
                reply.error.reason)


def write_results(folder: driver.RunFolder, strategy: MethodStrategy, seconds: float, notes: list[str]) -> None:
    """``summary.json`` (:func:`driver.run_summary`, as ``fedhpro run`` writes it, with ``engine: flower``),
    the method's server state (``server_state.pt``) and ``accuracy.png``; the rows are written after every
    round. A run where no round had an accuracy (every evaluation lost to node failures) still gets its
    summary (NaN accuracy) but no plot."""
    config, side = strategy.config, strategy.side
    options = config.run
    summary = driver.run_summary(options, options.dataset, len(strategy.nodes), side.device, strategy.rows, seconds,
                                 notes, from_python=config.federation is not None, engine="flower")
    folder.finish(summary, side.server.state_dict())
    if any("accuracy" in row for row in strategy.rows):
        folder.plot(f"{options.method} on {options.dataset} (seed {options.seed})")


def make_server_app(base: Mapping[str, Any] | None = None) -> ServerApp:
    """A ServerApp running fedhpro with ``base`` config settings (then the run's ``run_config`` on top).

    ``flwr run`` uses :data:`app` (no base settings: the run config says everything);
    ``flwr.simulation.run_simulation`` passes an empty run config, so give the
    experiment here, e.g. ``make_server_app({"method": "moon", "rounds": 5})``.
    """
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            run_server(grid, context.run_config, base)
        except FedHProError as error:  # one line in the log, as the CLI prints it
            log(ERROR, "fedhpro: error: %s", error)
            print(f"fedhpro: error: {error}", file=sys.stderr)
            # raised again from here, without the frames below (Flower logs the exception it gets with its
            # traceback, and marks the run finished:failed with "ServerApp failed with exception: <line>")
            raise error.with_traceback(None) from None

    return server_app


#: the ServerApp of ``examples/flower`` (``serverapp = "fedhpro.flower.server:app"``)
app = make_server_app()
