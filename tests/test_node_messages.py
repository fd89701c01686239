"""Every message a node sends is validated before the server uses it (one test per reproduction).

A. node-query answers: malformed answers at discovery (partition and own-data mode) and at rejoin are
   warned about once and ignored; a node claiming a client whose node is still online does not take it
   over (it waits until that node is gone); with ``flower.node-auth`` a returning node must show the key
   its client's node had at discovery; ``max_label=10**11`` is refused before any class list is built.
B. evaluation replies: counts a client cannot have (more correct than total, negative, another size,
   another client's or an unknown test set, not a number) are not pooled: the client is listed under
   ``not_evaluated`` with its reason, and the accuracy is that of the honest answers, pooled by hand.
C. ``class_counts`` (both engines, in the shared round protocol): counts that do not sum to
   ``num_examples`` are refused like an invalid update; the server's state is the one of the round
   without that reply (FedGMKD, FedHPro ``prototypes=global``).

The grids are mocks (the SuperLink's answers made by hand); the evaluation and rejoin tests need no data.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict  # noqa: E402
from flwr.proto.node_pb2 import NodeInfo  # noqa: E402
from test_flower_limits import NODES, simulator, strategy_for  # noqa: E402

from fedhpro.config import load_config  # noqa: E402
from fedhpro.data.clients import ClientInfo  # noqa: E402
from fedhpro.errors import ConfigError, UpdateError  # noqa: E402
from fedhpro.flower import nodes as server_module  # noqa: E402  (discovery and rejoin log there)
from fedhpro.flower import records  # noqa: E402
from fedhpro.flower.answers import client_info  # noqa: E402
from fedhpro.flower.engine import build_server_side  # noqa: E402
from fedhpro.flower.nodes import Nodes as NodeMap  # noqa: E402
from fedhpro.flower.nodes import discover_nodes, discover_own_data  # noqa: E402
from fedhpro.flower.records import EVAL_RECORD, NODE_RECORD  # noqa: E402
from fedhpro.flower.settings import FlowerSettings  # noqa: E402
from fedhpro.flower.strategy import MethodStrategy  # noqa: E402


@pytest.fixture(autouse=True)
def _inside_a_run(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # outside a run, flwr refuses to address a Message
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


@pytest.fixture()
def logged(monkeypatch) -> list[str]:
    """Every line the ServerApp logs (flwr's ``log``), as it would appear."""
    lines: list[str] = []
    monkeypatch.setattr(server_module, "log", lambda level, message, *args: lines.append(message % args))
    return lines


class AnswerGrid:
    """Flower's Grid as far as node queries go: node id -> the RecordDict its query reply holds (made by
    hand), its public key (``get_nodes``, as flwr 1.42's NodeInfo), and the queries each node got."""

    def __init__(self, answers: dict[int, RecordDict], keys: dict[int, bytes] | None = None):
        self.answers, self.keys = answers, dict(keys or {})
        self.offline: set[int] = set()
        self.asked: list[int] = []
        self.arriving: dict[int, RecordDict] = {}  # nodes that connect at the second look

    def get_node_ids(self):
        nodes = [node for node in self.answers if node not in self.offline]
        self.answers.update(self.arriving)
        self.arriving = {}
        return nodes

    def get_nodes(self):
        return [NodeInfo(node_id=node, public_key=self.keys.get(node, b"")) for node in self.get_node_ids()]

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            self.asked.append(node)
            replies.append(Message(self.answers[node], reply_to=message))
        return replies


def partition(k: int, count: int) -> RecordDict:
    return RecordDict({NODE_RECORD: ConfigRecord({"partition-id": k, "num-partitions": count})})


def described(info: ClientInfo | dict[str, Any] | str) -> RecordDict:
    text = info if isinstance(info, str) else json.dumps(
        dataclasses.asdict(info) if isinstance(info, ClientInfo) else info)
    return RecordDict({NODE_RECORD: ConfigRecord({"info": text})})


def site(name: str, classes: list[str], domain: str | None = None, **extra: Any) -> ClientInfo:
    values = {"name": name, "domain": domain, "kind": "images", "class_names": classes, "declared_classes": None,
              "max_label": None, "input_shape": [3, 16, 16], "train_size": 10, "test_size": 4, **extra}
    return ClientInfo(**values)


def own_settings(**extra: Any) -> dict[str, Any]:
    return {"dataset": "clients", "rounds": 1, "clients": 3, "feature_dim": 16, "local_epochs": 1,
            "data.image_size": 16, "device": "cpu", "progress": False, "seed": 3, **extra}


# ----------------------------------------------------------------------------- A. node-query answers

MALFORMED_PARTITIONS = {
    "wrong-type": RecordDict({NODE_RECORD: ConfigRecord({"partition-id": "zero", "num-partitions": 2})}),
    "list": RecordDict({NODE_RECORD: ConfigRecord({"partition-id": [0, 1], "num-partitions": 2})}),
    "missing-key": RecordDict({NODE_RECORD: ConfigRecord({"partition-id": 0})}),
    "no-record": RecordDict({}),
    "negative": partition(-1, 2),
    "bool": RecordDict({NODE_RECORD: ConfigRecord({"partition-id": True, "num-partitions": 2})}),
}


@pytest.mark.parametrize("answer", list(MALFORMED_PARTITIONS.values()), ids=list(MALFORMED_PARTITIONS))
def test_a_malformed_partition_answer_at_discovery_is_warned_about_once_and_ignored(answer, logged):
    grid = AnswerGrid({10: partition(0, 2), 12: answer})
    grid.arriving = {11: partition(1, 2)}  # discovery looks twice: the bad node is asked only once
    nodes, clients = discover_nodes(grid, None, FlowerSettings(node_wait=5))
    assert (nodes, clients) == ({0: 10, 1: 11}, 2)
    assert grid.asked.count(12) == 1
    warnings = [line for line in logged if "node 12" in line]
    assert len(warnings) == 1 and "malformed" in warnings[0] and "\n" not in warnings[0], logged


GOOD = site("site-a", ["ant", "dog"])
MALFORMED_INFOS = {
    "bad-json": "{'name': 'site-x'",
    "json-list": "[1, 2, 3]",
    "missing-keys": {"name": "site-x"},
    "extra-key": {**dataclasses.asdict(site("site-x", ["dog"])), "shell": "rm -rf /"},
    "name-type": {**dataclasses.asdict(site("site-x", ["dog"])), "name": 5},
    "path-name": {**dataclasses.asdict(site("site-x", ["dog"])), "name": "../site-a"},
    "kind": {**dataclasses.asdict(site("site-x", ["dog"])), "kind": "pickle"},
    "classes-type": {**dataclasses.asdict(site("site-x", ["dog"])), "class_names": "dog"},
    "class-name-type": {**dataclasses.asdict(site("site-x", ["dog"])), "class_names": [1, 2]},
    "shape": {**dataclasses.asdict(site("site-x", ["dog"])), "input_shape": [3, -16, 16]},
    "size": {**dataclasses.asdict(site("site-x", ["dog"])), "train_size": -1},
    "huge-number": '{"name": "x", "train_size": ' + "9" * 5000 + "}",
    "deep": "[" * 100_000 + "]" * 100_000,
}


@pytest.mark.parametrize("answer", list(MALFORMED_INFOS.values()), ids=list(MALFORMED_INFOS))
def test_a_malformed_description_at_discovery_is_warned_about_once_and_ignored(answer, logged):
    grid = AnswerGrid({9: described(GOOD), 7: described(site("site-b", ["dog"])), 5: described(answer)})
    grid.arriving = {3: described(site("site-c", ["cat"]))}
    nodes, infos, classes = discover_own_data(grid, load_config(own_settings()), FlowerSettings(node_wait=5))
    assert dict(nodes) == {0: 9, 1: 7, 2: 3} and classes == ["ant", "cat", "dog"]
    assert grid.asked.count(5) == 1
    warnings = [line for line in logged if "node 5" in line]
    assert len(warnings) == 1 and "malformed" in warnings[0] and "\n" not in warnings[0], logged


def test_max_label_beyond_max_classes_is_refused_before_any_class_list_is_built(logged):
    tensors = dict(kind="tensors", class_names=None, input_shape=[8])
    huge = site("site-x", [], **{**tensors, "max_label": 10 ** 11})
    with pytest.raises(UpdateError, match="max_label=100000000000 is not in"):
        client_info(described(huge)[NODE_RECORD], 100_000)
    # discovery: the node is ignored (clients=2 of the 3 that answered), the others resolve their 10 classes
    grid = AnswerGrid({1: described(site("site-a", [], **tensors, max_label=9)), 2: described(huge),
                       3: described(site("site-b", [], **tensors, max_label=4))})
    nodes, _, classes = discover_own_data(grid, load_config(own_settings(clients=2)), FlowerSettings(node_wait=5))
    assert dict(nodes) == {0: 1, 1: 3} and len(classes) == 10
    assert any("node 2" in line and "max_label" in line for line in logged)
    # data.max_classes is the bound
    grid = AnswerGrid({1: described(site("site-a", [], **tensors, max_label=9))})
    with pytest.raises(ConfigError, match="only 0 of 1 data-holding SuperNodes answered .*max_label"):
        discover_own_data(grid, load_config(own_settings(clients=1, **{"data.max_classes": 5})),
                          FlowerSettings(node_wait=0.5))


def own_strategy(grid: AnswerGrid, *, node_auth: bool = False) -> MethodStrategy:
    """A strategy of an own-data run on the nodes of ``grid`` (discovered as the ServerApp does), no data."""
    config = load_config(own_settings())
    nodes, infos, classes = discover_own_data(grid, config, FlowerSettings(node_wait=5))
    config = load_config(config.to_dict(), {"data.classes": classes})
    side = build_server_side(config, num_classes=len(classes), input_shape=tuple(infos[0].input_shape),
                             num_samples=[i.train_size for i in infos])
    keys = server_module._client_keys(grid, nodes, FlowerSettings(node_auth=node_auth))
    return MethodStrategy(side, config, NodeMap(nodes, infos, keys), node_auth=node_auth)


SITES = {9: site("site-a", ["ant", "dog"], "clinic"), 7: site("site-b", ["dog"], "clinic"),
         3: site("site-c", ["cat"], "lab")}


@pytest.mark.parametrize("answer", [MALFORMED_INFOS[key] for key in ("bad-json", "name-type", "deep")]
                         + [{"partition-id": 0}], ids=["bad-json", "name-type", "deep", "other-record"])
def test_a_malformed_answer_at_rejoin_is_warned_about_once_and_ignored(answer, logged):
    grid = AnswerGrid({node: described(info) for node, info in SITES.items()})
    strategy = own_strategy(grid)
    grid.offline = {9}
    grid.answers[20] = (RecordDict({NODE_RECORD: ConfigRecord(answer)}) if "partition-id" in answer
                        else described(answer))
    assert strategy._rejoin(grid) == {7, 3, 20}
    assert strategy.nodes == {0: 9, 1: 7, 2: 3} and 20 in strategy.strangers
    grid.asked.clear()
    strategy._rejoin(grid)  # not asked again
    assert grid.asked == []
    warnings = [line for line in logged if "node 20" in line]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings


def test_a_node_cannot_take_over_a_client_whose_node_is_online(logged):
    # partition mode: claiming partition-id=1 is all a node can say; node 11 still holds client 1
    config = load_config({"rounds": 2, "clients": 3})
    strategy = MethodStrategy(None, config, {0: 10, 1: 11, 2: 12})  # _rejoin needs no server part
    grid = AnswerGrid({10: partition(0, 3), 11: partition(1, 3), 12: partition(2, 3), 66: partition(1, 3)})
    assert strategy._rejoin(grid) == {10, 11, 12, 66}
    assert strategy.nodes == {0: 10, 1: 11, 2: 12} and strategy.waiting == {66: 1}
    grid.asked.clear()
    strategy._rejoin(grid)  # still online: still waiting, not asked again, no second warning
    assert strategy.nodes[1] == 11 and grid.asked == []
    assert len([line for line in logged if "node 66" in line]) == 1
    grid.offline = {11}  # client 1's node is gone: the waiting node takes it over
    strategy._rejoin(grid)
    assert strategy.nodes == {0: 10, 1: 66, 2: 12} and 11 in strategy.strangers and strategy.waiting == {}
    # own-data mode: the same rule (another node describing site-b's folder exactly)
    grid = AnswerGrid({node: described(info) for node, info in SITES.items()})
    strategy = own_strategy(grid)
    grid.answers[21] = described(SITES[7])
    strategy._rejoin(grid)
    assert strategy.nodes == {0: 9, 1: 7, 2: 3} and strategy.waiting == {21: 1}


def test_with_node_auth_a_returning_node_needs_its_clients_key(logged):
    grid = AnswerGrid({node: described(info) for node, info in SITES.items()},
                      keys={9: b"key-a", 7: b"key-b", 3: b"key-c"})
    strategy = own_strategy(grid, node_auth=True)
    assert strategy.keys == {0: b"key-a", 1: b"key-b", 2: b"key-c"}
    assert any("node keys recorded" in line for line in logged)
    grid.offline = {9}  # site-a's node is gone; node 20 describes its folder exactly, with another key
    grid.answers[20], grid.keys[20] = described(SITES[9]), b"key-mallory"
    strategy._rejoin(grid)
    assert strategy.nodes[0] == 9 and 20 in strategy.strangers
    assert any("node 20" in line and "public key" in line for line in logged)
    grid.answers[21], grid.keys[21] = described(SITES[9]), b"key-a"  # re-registered with its key: takes it back
    strategy._rejoin(grid)
    assert strategy.nodes[0] == 21
    # without node-auth the keys are not checked, and the ServerApp says so once at the start
    logged.clear()
    assert own_strategy(AnswerGrid({node: described(info) for node, info in SITES.items()})).node_auth is False
    assert len([line for line in logged if "node keys are not checked" in line]) == 1
    # node-auth asked for but the SuperLink lists no key: one line, before any round
    with pytest.raises(ConfigError, match="flower.node-auth=true but the SuperLink lists no public key"):
        own_strategy(AnswerGrid({node: described(info) for node, info in SITES.items()}), node_auth=True)


# ----------------------------------------------------------------------------- B. evaluation replies

#: the honest answers: (test set, correct, total) of site-a, site-b, site-c (clients 0, 1, 2)
HONEST = {0: ("clinic", 3, 4), 1: ("clinic", 2, 4), 2: ("lab", 1, 4)}
TAMPERED = {
    "more-correct-than-total": {"test-set": "clinic", "correct": 1_000_000, "total": 10},
    "negative": {"test-set": "clinic", "correct": -50, "total": 4},
    "another-clients-test-set": {"test-set": "lab", "correct": 0, "total": 1_000_000},
    "unknown-test-set": {"test-set": "fake-domain", "correct": 4, "total": 4},
    "not-a-number": {"test-set": "clinic", "correct": "lots", "total": 4},
}


@pytest.mark.parametrize("answer", list(TAMPERED.values()), ids=list(TAMPERED))
def test_evaluation_counts_a_client_cannot_have_are_not_pooled(answer, logged):
    grid = AnswerGrid({node: described(info) for node, info in SITES.items()})
    strategy = own_strategy(grid)
    # round 0 trained (its row is made by aggregate_evaluate): only the evaluation is under test here
    strategy._round = strategy.side.protocol.open(0)
    strategy._times, strategy._server_metrics = {"clients": 0.0, "server": 0.0}, {}
    messages = list(strategy.configure_evaluate(1, ArrayRecord(), ConfigRecord(), grid))
    replies = []
    for message in messages:
        k = strategy.partition_of[message.metadata.dst_node_id]
        name, correct, total = HONEST[k]
        counts = answer if k == 1 else {"test-set": name, "correct": correct, "total": total}
        replies.append(Message(RecordDict({EVAL_RECORD: ConfigRecord(counts)}), reply_to=message))
    strategy.aggregate_evaluate(1, replies)
    row = strategy.rows[-1]
    assert [item["client"] for item in row["not_evaluated"]] == [1]
    reason = row["not_evaluated"][0]["reason"]
    assert reason.startswith("invalid evaluation: ") and "\n" not in reason
    # by hand: site-a 3/4 on clinic, site-c 1/4 on lab
    assert row["accuracy"] == {"clinic": 75.0, "lab": 25.0, "AVG": 50.0}
    assert row["client_accuracy"] == [75.0, 25.0]


# ----------------------------------------------------------------------------- C. class_counts


def counted_round(name: str, options: dict[str, Any], tamper, monkeypatch) -> tuple[dict[str, Any], Any]:
    """Round 0 of ``name`` (with ``options``) through MethodStrategy, client 1's reply tampered with as a
    node would send it: ``(the round's row, the server's state after it)``."""
    from test_flower_limits import Grid

    sim = simulator(name, **options)
    strategy = strategy_for(sim, name)
    grid = Grid(NODES.values())
    replies = []
    for message in strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid):
        k = strategy.partition_of[message.metadata.dst_node_id]
        reply, metrics = sim.client.fit(sim.models.model_for(k), records.decode_payload(message.content),
                                        sim.federation.clients[k], {}, torch.Generator().manual_seed(k))
        if k == 1:
            reply = dict(reply)
            tamper(reply)
        content = RecordDict({**records.encode_payload(reply), records.METRICS: records.encode_metrics(metrics)})
        replies.append(Message(content, reply_to=message))
    strategy.aggregate_train(1, replies)
    return strategy.rows[-1] if strategy.rows else {"dropped": strategy._round.dropped}, sim.server.state_dict()


def _inflated_counts(reply):
    reply["class_counts"] = torch.full_like(reply["class_counts"], 10 ** 15)  # int64, as the layout declares


def _too_many_examples(reply):
    reply["num_examples"] = 10 ** 12  # refused by the num_examples bound: the reference of a dropped reply


@pytest.mark.parametrize("name, options", [("fedgmkd", {}), ("fedhpro", {"prototypes": "global"})],
                         ids=["fedgmkd", "fedhpro-global"])
def test_class_counts_that_do_not_sum_to_num_examples_are_refused(name, options, monkeypatch):
    row, state = counted_round(name, options, _inflated_counts, monkeypatch)
    dropped = row["dropped"]
    assert [item["client"] for item in dropped] == [1]
    assert "class_counts" in dropped[0]["reason"] and dropped[0]["reason"].startswith("invalid update: ")
    # the server's state is that of the round without client 1's reply
    _, reference = counted_round(name, options, _too_many_examples, monkeypatch)
    assert state.keys() == reference.keys()
    for key, value in reference.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(state[key], value), key
        elif isinstance(value, dict):
            for inner, tensor in value.items():
                assert torch.equal(state[key][inner], tensor), (key, inner)


def test_the_simulator_refuses_inflated_class_counts_too():
    sim = simulator("fedgmkd")
    fit = sim.client.fit

    def inflating(model, payload, data, state, generator):
        reply, metrics = fit(model, payload, data, state, generator)
        if len(data) == len(sim.federation.clients[1]):
            reply = {**reply, "class_counts": reply["class_counts"] * 1000}
        return reply, metrics

    sim.client.fit = inflating
    record = sim.run_round(0)
    assert [item["client"] for item in record.dropped] == [1]
    assert "class_counts holds a count of 3000 but num_examples=10" in record.dropped[0]["reason"]


class ErrorGrid(AnswerGrid):
    """An :class:`AnswerGrid` whose nodes in ``failing`` answer with an error (a ClientApp that raised)."""

    failing: set[int] = set()

    def send_and_receive(self, messages, timeout=None):
        from flwr.app import Error

        replies = super().send_and_receive(messages, timeout)
        return [Message(Error(code=2, reason="RuntimeError: no"), reply_to=message)
                if message.metadata.dst_node_id in self.failing else reply
                for message, reply in zip(messages, replies, strict=True)]


@pytest.mark.parametrize(("hostile", "clients", "words"), [
    ("error", None, "it answered with an error: RuntimeError: no"),
    ("twin", None, "nodes 10 and 12 both hold partition-id=0 (the first to answer keeps it)"),
    ("other-count", 2, "it holds partition 0 of 5, but the federation has clients=2"),
])
def test_one_node_cannot_deny_partition_discovery(hostile, clients, words, logged):
    """Partition mode: a node answering with an error, claiming a partition another node answered for first,
    or a partition of another federation, is refused with one warning; the honest nodes' run goes on."""
    answers = {"error": partition(1, 2), "twin": partition(0, 2), "other-count": partition(0, 5)}
    grid = ErrorGrid({10: partition(0, 2), 11: partition(1, 2), 12: answers[hostile]})
    grid.failing = {12} if hostile == "error" else set()
    nodes, count = discover_nodes(grid, clients, FlowerSettings(node_wait=5))
    assert (nodes, count) == ({0: 10, 1: 11}, 2)
    warnings = [line for line in logged if "node 12" in line or "nodes 10 and 12" in line]
    assert len(warnings) == 1 and words in warnings[0] and "\n" not in warnings[0], logged
    # alone, the refused node leaves its partition without a holder: one line naming it once the wait is over
    grid = ErrorGrid({10: partition(0, 2), 12: answers[hostile]})
    grid.failing = {12} if hostile == "error" else set()
    with pytest.raises(ConfigError, match=r"only partitions \[0\] of 2 have a node; refused: node 12: ") as caught:
        discover_nodes(grid, clients, FlowerSettings(node_wait=0.5))
    assert "\n" not in str(caught.value)
