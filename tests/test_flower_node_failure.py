"""A SuperNode that dies mid-run does not stop the run; a restarted one takes its client back.

* loopback (a real deployment): a SuperLink and 3 SuperNodes run 3 tiny rounds;
  SuperNode 2 is killed (SIGKILL to its process group and everything below it,
  its flwr-clientapp included) once it has received round 0's training message.
  Round 0 closes with the two other replies and lists client 2 under
  ``dropped``; the node is started again (a new Flower node id), is asked which
  partition it holds and trains again in the last round; the run finishes as
  ``finished:completed``.
* mocked grid (the SuperLink's answers made by hand, the nodes' real
  ClientApp handlers called in-process): a node the SuperLink no longer lists
  gets no message and is dropped at once (``node offline``); the SuperLink's own
  error reply for an offline node (which comes from the SuperLink, node id 0)
  is matched to its client; a new node is mapped back to its client by
  partition-id; federated evaluation pools the counts of the nodes that
  answered (reference: ``100 * sum correct / sum total`` over those replies)
  and names the others under ``not_evaluated``.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")

from flwr.app import Context, Error, Message, MessageType, RecordDict  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402
from test_flower import read_rows, tiny_config  # noqa: E402
from test_flower_deployment import Loopback  # noqa: E402

from fedhpro.config import load_config  # noqa: E402
from fedhpro.flower import client as client_app  # noqa: E402
from fedhpro.flower.engine import build_server_side  # noqa: E402
from fedhpro.flower.records import EVAL_RECORD  # noqa: E402
from fedhpro.flower.strategy import MethodStrategy  # noqa: E402

RUN_TIMEOUT = 900  # seconds for the whole loopback run (3 tiny rounds, one of them waiting for a dead node)
#: flower.round-timeout: a round with a dead node closes after this at the latest, or earlier when the
#: SuperLink, missing 2 heartbeats (60 s), answers for the node (healthy rounds here: 25-40 s on 2 busy cores)
ROUND_TIMEOUT = 90
#: what a SuperNode logs for every message it receives (flwr 1.42): the query, then one per round here
RECEIVED = "Received successfully"


def wait_received(net: Loopback, name: str, count: int) -> None:
    """Until SuperNode ``name`` (its latest start) has received ``count`` messages."""
    deadline = time.monotonic() + RUN_TIMEOUT
    while net.processes.latest_log(name).count(RECEIVED) < count:
        if time.monotonic() > deadline:
            net.fail(f"{name} did not receive {count} messages within {RUN_TIMEOUT} s")
        time.sleep(0.5)


@pytest.mark.deploy
def test_a_killed_supernode_is_dropped_and_a_restarted_one_rejoins(digits_data_dir, tmp_path):
    out = tmp_path / "out"
    partition = "partition-id={} num-partitions=3".format
    with Loopback(tmp_path) as net:
        net.start_superlink()
        for k in range(3):
            net.start_supernode(f"supernode-{k}", partition(k), wait=False)
        net.wait_connected(*(f"supernode-{k}" for k in range(3)))
        first_id = net.node_id("supernode-2")
        run_id = net.flwr_run({**tiny_config(digits_data_dir, rounds=3), "out": str(out),
                               "flower.round-timeout": ROUND_TIMEOUT}, wait=False)
        wait_received(net, "supernode-2", 2)  # the query, then round 0's training message: kill it while it trains
        net.kill("supernode-2", signal.SIGKILL)  # its process group and everything below (flwr-clientapp)
        killed = time.monotonic()
        wait_received(net, "supernode-0", 3)  # round 1's message: round 0 closed without client 2
        round_0_seconds = time.monotonic() - killed
        net.start_supernode("supernode-2", partition(2))  # a new process: a new Flower node id
        second_id = net.node_id("supernode-2")
        assert second_id != first_id
        net.wait_run(run_id, RUN_TIMEOUT)
        net.assert_completed(run_id)
        server_log = (net.logs / f"run-{run_id}.log").read_text()

    rows = read_rows(out / "metrics.jsonl")
    assert [row["round"] for row in rows] == [0, 1, 2] and all(row["participants"] == [0, 1, 2] for row in rows)
    # round 0: the two other replies counted, client 2 dropped (no reply in time, or the SuperLink's
    # "node unavailable" once it missed 2 heartbeats)
    assert [item["client"] for item in rows[0]["dropped"]] == [2], rows[0]
    assert "skipped" not in rows[0] and rows[0]["bytes_up"] > 0
    assert round_0_seconds < ROUND_TIMEOUT + 30, round_0_seconds  # it waited for the dead node no longer than that
    # the restarted node took client 2 back: it trained in the last round
    assert "dropped" not in rows[2], rows[2]
    assert f"client 2 is now on node {second_id}" in server_log
    assert all("accuracy" in row for row in rows)
    timing = read_rows(out / "timing.jsonl")
    print(f"round 0 closed {round_0_seconds:.0f} s after the kill, its clients' step took {timing[0]['clients']:.0f} s "
          f"(dropped: {rows[0]['dropped']}); round 1: {timing[1]['clients']:.0f} s, dropped {rows[1].get('dropped')}; "
          f"round 2: {timing[2]['clients']:.0f} s")


# --------------------------------------------------------------------------- a mocked grid, real node handlers


@pytest.fixture()
def _inside_a_run(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # outside a run, flwr refuses to address a Message
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


class FailingGrid:
    """Flower's Grid as the SuperLink answers it, with nodes that run the real ClientApp handlers in-process.

    ``partitions``: node id -> the partition it holds; ``offline``: nodes the SuperLink no longer lists;
    ``silent``: listed nodes that never answer (killed, not yet noticed); ``unavailable``: nodes for which
    the SuperLink writes its own error reply (it noticed the node died while the message waited).
    """

    def __init__(self, partitions: dict[int, int], num_partitions: int):
        self.partitions, self.num_partitions = partitions, num_partitions
        self.contexts = {node: Context(run_id=1, node_id=node, node_config={"partition-id": k,
                                                                              "num-partitions": num_partitions},
                                       state=RecordDict(), run_config={}) for node, k in partitions.items()}
        self.offline: set[int] = set()
        self.silent: set[int] = set()
        self.unavailable: set[int] = set()
        self.sent: list[tuple[int, str]] = []  # (node, message type) of every message pushed

    def get_node_ids(self):
        return [node for node in self.partitions if node not in self.offline]

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for number, message in enumerate(messages):
            message.metadata.__dict__["_message_id"] = f"m{len(self.sent)}-{number}"  # as the grid sets it
            node = message.metadata.dst_node_id
            self.sent.append((node, message.metadata.message_type))
            assert node not in self.offline, "a message went to a node the SuperLink does not list"
            if node in self.silent:
                continue
            if node in self.unavailable:
                reply = Message(Error(ErrorCode.NODE_UNAVAILABLE, "node unavailable"), reply_to=message)
                reply.metadata.__dict__["_src_node_id"] = 0  # the SuperLink's error reply comes from the SuperLink
                replies.append(reply)
                continue
            handler = {MessageType.TRAIN: client_app.train, MessageType.EVALUATE: client_app.evaluate,
                       MessageType.QUERY: client_app.query}[message.metadata.message_type]
            replies.append(handler(message, self.contexts[node]))
        return replies


def strategy_for(settings: dict[str, Any], nodes: dict[int, int]) -> MethodStrategy:
    config = load_config(settings)
    return MethodStrategy(build_server_side(config), config, dict(nodes))


def one_round(strategy: MethodStrategy, grid: FailingGrid, server_round: int) -> dict[str, Any]:
    replies = grid.send_and_receive(list(strategy.configure_train(server_round, None, None, grid)))
    strategy.aggregate_train(server_round, replies)
    replies = grid.send_and_receive(list(strategy.configure_evaluate(server_round, None, None, grid)))
    strategy.aggregate_evaluate(server_round, replies)
    return strategy.rows[-1]


def test_offline_and_unavailable_nodes_are_dropped_and_a_new_node_takes_its_client_back(
        digits_data_dir, _inside_a_run):
    grid = FailingGrid({10: 0, 11: 1, 12: 2}, 3)
    strategy = strategy_for(tiny_config(digits_data_dir, rounds=4), {0: 10, 1: 11, 2: 12})

    grid.unavailable = {12}  # the SuperLink noticed while the message waited: its error reply comes from node 0
    row = one_round(strategy, grid, 1)
    assert row["dropped"] == [{"client": 2, "reason": "node offline (no heartbeat for 2 intervals)"}]
    assert "skipped" not in row

    grid.unavailable, grid.offline = set(), {12}  # no longer listed: no message, dropped at once
    grid.sent.clear()
    row = one_round(strategy, grid, 2)
    assert row["dropped"] == [{"client": 2, "reason": "node offline"}]
    assert [node for node, _ in grid.sent] == [10, 11]

    grid.silent = {11}  # listed but dead: no reply before the round-timeout
    row = one_round(strategy, grid, 3)
    assert row["dropped"] == [{"client": 1, "reason": "no reply before flower.round-timeout"},
                              {"client": 2, "reason": "node offline"}]

    # node 12 restarted: it connects as node 20, says it holds partition 2 and trains client 2 again
    grid.silent = set()
    grid.partitions[20] = 2
    grid.contexts[20] = Context(run_id=1, node_id=20, node_config={"partition-id": 2, "num-partitions": 3},
                                state=RecordDict(), run_config={})
    grid.sent.clear()
    row = one_round(strategy, grid, 4)
    assert "dropped" not in row and strategy.nodes == {0: 10, 1: 11, 2: 20}
    assert grid.sent == [(20, MessageType.QUERY), (10, MessageType.TRAIN), (11, MessageType.TRAIN),
                         (20, MessageType.TRAIN)]
    # a node holding a partition of another federation is asked once and then left alone
    grid.partitions[30] = 7
    grid.contexts[30] = Context(run_id=1, node_id=30, node_config={"partition-id": 7, "num-partitions": 8},
                                state=RecordDict(), run_config={})
    assert strategy._rejoin(grid) == {10, 11, 20, 30} and 30 in strategy.strangers
    grid.sent.clear()
    strategy._rejoin(grid)
    assert grid.sent == []


def test_federated_evaluation_pools_the_answers_it_has(digits_data_dir, _inside_a_run):
    grid = FailingGrid({10: 0, 11: 1, 12: 2}, 3)
    # personal models (a prototype-only federation): every node evaluates its own model
    settings = tiny_config(digits_data_dir, rounds=2, method="fedproto", **{"fedproto.protocol": "proto-only"})
    strategy = strategy_for(settings, {0: 10, 1: 11, 2: 12})
    assert strategy.side.federated_evaluation
    strategy.aggregate_train(1, grid.send_and_receive(list(strategy.configure_train(1, None, None, grid))))
    grid.offline = {12}
    replies = grid.send_and_receive(list(strategy.configure_evaluate(1, None, None, grid)))
    counts = [reply.content.config_records[EVAL_RECORD] for reply in replies]
    strategy.aggregate_evaluate(1, replies)
    row = strategy.rows[-1]
    # reference: the two answers' counts pooled by hand (digits: every client tests on its own domain)
    expected: dict[str, list[int]] = {}
    for count in counts:
        pooled = expected.setdefault(str(count["test-set"]), [0, 0])
        pooled[0] += int(count["correct"])
        pooled[1] += int(count["total"])
    assert row["not_evaluated"] == [{"client": 2, "reason": "node offline"}] and len(row["client_accuracy"]) == 2
    for name, (correct, total) in expected.items():
        assert row["accuracy"][name] == pytest.approx(100.0 * correct / total, abs=1e-12)
    assert set(row["accuracy"]) == set(expected) | {"AVG"}

    grid.offline = set()
    strategy.aggregate_train(2, grid.send_and_receive(list(strategy.configure_train(2, None, None, grid))))
    grid.offline = {10, 11, 12}  # all gone after training: nobody evaluates, the round has no accuracy
    assert list(strategy.configure_evaluate(2, None, None, grid)) == []
    strategy.aggregate_evaluate(2, [])
    assert "accuracy" not in strategy.rows[-1]
    assert strategy.rows[-1]["not_evaluated"] == [{"client": k, "reason": "node offline"} for k in range(3)]


def test_own_data_a_restarted_node_is_recognised_by_its_name_and_folder(_inside_a_run):
    from test_flower_own_data import DataGrid, info, settings

    from fedhpro.flower.nodes import discover_own_data
    from fedhpro.flower.settings import FlowerSettings

    grid = DataGrid({7: info("site-b", ["dog"]), 3: info("site-c", ["cat"]), 9: info("site-a", ["ant", "dog"])})
    config = load_config(settings())
    nodes, infos, classes = discover_own_data(grid, config, FlowerSettings(node_wait=1))
    config = load_config(config.to_dict(), {"data.classes": classes})
    side = build_server_side(config, num_classes=len(classes), input_shape=tuple(infos[0].input_shape),
                             num_samples=[i.train_size for i in infos])
    strategy = MethodStrategy(side, config, nodes)
    # site-a (client 0, node 9) restarts as node 20; node 21 claims site-a with another folder; node 22 is
    # a site this run never had
    del grid.infos[9]
    grid.infos.update({20: info("site-a", ["ant", "dog"]), 21: info("site-a", ["ant"]), 22: info("site-d", ["dog"])})
    assert strategy._rejoin(grid) == {3, 7, 20, 21, 22}
    assert strategy.nodes == {0: 20, 1: 7, 2: 3} and strategy.partition_of == {20: 0, 7: 1, 3: 2}
    assert strategy.strangers == {9, 21, 22}
