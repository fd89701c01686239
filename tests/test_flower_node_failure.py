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

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")

from flwr.app import Context, Error, Message, MessageType, RecordDict  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402
from test_flower import REPO, read_rows, tiny_config  # noqa: E402
from test_flower_deployment import ENVIRONMENT, Processes, descendants, flower_tool, free_port, wait_healthy  # noqa: E402

from fedhpro.config import load_config  # noqa: E402
from fedhpro.flower import client as client_app  # noqa: E402
from fedhpro.flower.engine import build_server_side  # noqa: E402
from fedhpro.flower.server import EVAL_RECORD, MethodStrategy  # noqa: E402

RUN_TIMEOUT = 900  # seconds for the whole loopback run (3 tiny rounds, one of them waiting for a dead node)
ROUND_TIMEOUT = 60  # flower.round-timeout: a round with a dead node closes after this at the latest


def tail(path: Path, characters: int = 3000) -> str:
    return path.read_text(errors="replace")[-characters:] if path.exists() else f"({path.name}: no log)"


def wait_for(condition, seconds: float, what: str, logs: Path) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            texts = "\n".join(f"--- {p.name}\n{tail(p)}" for p in sorted(logs.glob("*.log")))
            raise AssertionError(f"{what}: not after {seconds:.0f} s\n{texts}")
        time.sleep(0.5)


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a SuperNode's process group and every process below it (its flwr-clientapp children)."""
    below = descendants(process.pid)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=30)


def test_a_killed_supernode_is_dropped_and_a_restarted_one_rejoins(digits_data_dir, tmp_path):
    home, logs, out = tmp_path / "flwr-home", tmp_path / "logs", tmp_path / "out"
    home.mkdir()
    logs.mkdir()
    link_port = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\naddress = "127.0.0.1:{link_port}"\n'
        "insecure = true\n")
    env = {**ENVIRONMENT, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("FEDHPRO_DATA_DIR", None)
    processes = Processes(env, logs)

    def supernode(name: str, k: int) -> subprocess.Popen:
        return processes.start(name, [
            flower_tool("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link_port}",
            "--host", "127.0.0.1", "--port", str(free_port()), "--node-config", f"partition-id={k} num-partitions=3"])

    def received(name: str) -> int:  # messages a SuperNode has received (the query, then one per round)
        return tail(logs / f"{name}.log", 10**7).count("Received successfully")

    run_log = logs / "flwr-run.log"
    settings = {**tiny_config(digits_data_dir, rounds=3), "out": str(out), "flower.round-timeout": ROUND_TIMEOUT}
    try:
        link = processes.start("superlink", [flower_tool("flower-superlink"), "--insecure", "--host", "127.0.0.1",
                                             "--port", str(link_port), "--disable-runtime-dependency-installation"])
        wait_healthy(link_port, link)
        nodes = [supernode(f"supernode-{k}", k) for k in range(3)]
        text = " ".join(f"{key}={json.dumps(value)}" for key, value in settings.items())
        with open(run_log, "wb") as log:
            run = subprocess.Popen([flower_tool("flwr"), "run", str(REPO / "examples" / "flower"), "loopback",
                                    "--run-config", text, "--stream"], env=env, stdout=log, stderr=subprocess.STDOUT)
        processes.started.append(run)
        # the query, then round 0's training message: kill the node while it trains
        wait_for(lambda: received("supernode-2") >= 2, RUN_TIMEOUT, "SuperNode 2 received round 0's message", logs)
        processes.remember_children()
        killed = time.monotonic()
        kill_tree(nodes[2])
        # once round 1 has begun, start it again: it comes back with a new node id
        wait_for(lambda: "[ROUND 2/3]" in tail(run_log, 10**7), RUN_TIMEOUT, "round 1 began", logs)
        round_0_seconds = time.monotonic() - killed
        supernode("supernode-2-restarted", 2)
        wait_for(lambda: run.poll() is not None, RUN_TIMEOUT, "flwr run finished", logs)
        processes.remember_children()
        listing = subprocess.run([flower_tool("flwr"), "ls", "loopback", "--format", "json"], env=env,
                                 capture_output=True, text=True, timeout=120)
        runs = json.loads(listing.stdout)["runs"]
        assert len(runs) == 1 and runs[0]["status"] == "finished:completed", (runs, tail(run_log))
    finally:
        left = processes.stop()
    assert left == [], f"processes left running: {left}"

    rows = read_rows(out / "metrics.jsonl")
    assert [row["round"] for row in rows] == [0, 1, 2] and all(row["participants"] == [0, 1, 2] for row in rows)
    # round 0: two replies counted, client 2 dropped (no reply in time, or the SuperLink's "node unavailable")
    assert [item["client"] for item in rows[0]["dropped"]] == [2], rows[0]
    assert "skipped" not in rows[0] and rows[0]["bytes_up"] > 0
    assert round_0_seconds < ROUND_TIMEOUT + 60, round_0_seconds  # the round did not wait for the dead node forever
    # the restarted node took client 2 back: it trained in the last round
    assert "dropped" not in rows[2], rows[2]
    assert "client 2 is now on node" in tail(run_log, 10**7)
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
    assert row["dropped"] == [{"client": 2, "reason": "node unavailable"}] and "skipped" not in row

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
    assert row["not_evaluated"] == [2] and len(row["client_accuracy"]) == 2
    for name, (correct, total) in expected.items():
        assert row["accuracy"][name] == pytest.approx(100.0 * correct / total, abs=1e-12)
    assert set(row["accuracy"]) == set(expected) | {"AVG"}

    grid.offline = set()
    strategy.aggregate_train(2, grid.send_and_receive(list(strategy.configure_train(2, None, None, grid))))
    grid.offline = {10, 11, 12}  # all gone after training: nobody evaluates, the round has no accuracy
    assert list(strategy.configure_evaluate(2, None, None, grid)) == []
    strategy.aggregate_evaluate(2, [])
    assert "accuracy" not in strategy.rows[-1] and strategy.rows[-1]["not_evaluated"] == [0, 1, 2]
