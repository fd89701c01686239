"""Resume on Flower: a killed ServerApp continues from its checkpoint, a restarted node from its disk.

Reference: the in-process simulator's uninterrupted run of the same config
(``fedhpro.run``), whose rows and server state must come out equal to the last
bit, as in test_flower.py (same code, same seeds, one thread per process,
exact array transport). Timing fields are not in ``metrics.jsonl``.

* units: a client's state on disk (:class:`~fedhpro.flower.client.StateStore`):
  which round a new context takes up, what is pruned, what a refused reply undoes;
* in process: the ServerApp (``run_server``) driving the ClientApp's handlers
  through a grid that calls them directly: a run killed after round 2's
  checkpoint and resumed with new node contexts (a new Flower run), and a node
  restarted mid-run (empty ``Context.state``);
* on loopback: a SuperLink killed and restarted, ``flwr run ... resume=out``;
  a SuperNode killed and restarted.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict  # noqa: E402
from test_flower import assert_same_state, core, read_rows, reference, tiny_config  # noqa: E402
from test_flower_deployment import Loopback  # noqa: E402

from fedhpro.cli import main as cli_main  # noqa: E402
from fedhpro.config import load_config  # noqa: E402
from fedhpro.engines import checkpoint  # noqa: E402
from fedhpro.errors import ConfigError  # noqa: E402
from fedhpro.flower import client as client_app  # noqa: E402
from fedhpro.flower import records  # noqa: E402
from fedhpro.flower.engine import build_engine, config_text  # noqa: E402
from fedhpro.flower.server import HEADER, run_server  # noqa: E402

KEY = "0123456789abcdef"
#: stateful runs: MOON (its previous model in the client state) and FedProto proto-only (personal models,
#: evaluated on the nodes)
STATEFUL = {"moon": {"method": "moon"}, "proto-only": {"method": "fedproto", "fedproto.protocol": "proto-only"}}


@pytest.fixture
def inside_a_run(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # outside a run, flwr refuses to address a Message
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


# ---------------------------------------------------------------------------- units: the client's state on disk


def test_the_store_keeps_the_newest_round_before_keep_from_and_every_later_one(tmp_path):
    store = client_app.StateStore(tmp_path / "client-0")
    assert store.rounds() == [] and store.newest(before=5) is None
    for round in (0, 1, 2, 4):
        store.save(round, {"state/x": {"config": {"round": round}}})
    assert store.rounds() == [0, 1, 2, 4] and store.newest(before=4) == 2 and store.newest(before=5) == 4
    store.prune(keep_from=3)  # a resume at 3 needs 2 (newest before 3); one at 4 or 5 needs 4
    assert store.rounds() == [2, 4]
    store.prune(keep_from=5)
    assert store.rounds() == [4]
    assert store.load(4) == {"state/x": {"config": {"round": 4}}}
    store.path(4).write_bytes(b"not a checkpoint")
    with pytest.raises(Exception, match="cannot be read.*delete it to go on from the round before"):
        store.load(4)


def test_a_run_key_that_is_not_one_is_refused_before_it_names_a_folder(tmp_path):
    with pytest.raises(ConfigError, match="not a fedhpro run key"):
        client_app.run_folder({"state-dir": str(tmp_path)}, "../../etc")
    assert client_app.run_folder({"state-dir": str(tmp_path)}, KEY) == tmp_path / KEY
    assert client_app.client_store({}, "", 0) is None  # no key: nothing on disk


class Node:
    """One node's ClientApp handlers on client 0 of a MOON run, fed the payloads of the simulator's server
    (the reference's broadcasts), with its state under ``state_dir``."""

    def __init__(self, config, state_dir: Path):
        self.config, self.state_dir = config, state_dir
        self.text = config_text(config)
        engine = build_engine(config)
        self.payloads = [records.encode_payload(engine.server.broadcast(r)) for r in range(config.run.rounds)]
        self.context = self.fresh()

    def fresh(self) -> Context:
        """A new context: a restarted SuperNode, or a new Flower run (a resumed one)."""
        return Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 3,
                                                         "state-dir": str(self.state_dir)},
                       state=RecordDict(), run_config={})

    def train(self, round: int, refused: int = -1, keep_from: int | None = None, key: str = KEY) -> RecordDict:
        header = ConfigRecord({"config": self.text, "round": round, "client": 0, "num-clients": 3,
                               "refused-round": refused, "state-key": key,
                               "keep-from": round if keep_from is None else keep_from})
        reply = client_app.train(Message(RecordDict({**self.payloads[round], HEADER: header}), 7, MessageType.TRAIN),
                                 self.context)
        assert not reply.has_error(), reply.error.reason
        return reply.content

    def moon_state(self) -> dict[str, torch.Tensor]:
        return records.decode_payload(self.context.state, "cpu", prefix=client_app.STATE_PREFIX)["previous_weights"]


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[key], b[key]) for key in a)


def weights_of(content: RecordDict) -> dict[str, torch.Tensor]:
    return records.decode_payload(content, "cpu")["weights"]


def test_a_new_context_takes_up_the_state_from_before_its_round(digits_data_dir, tmp_path, inside_a_run):
    config = load_config(tiny_config(digits_data_dir, method="moon", rounds=4))
    node, ref = Node(config, tmp_path / "node"), Node(config, tmp_path / "reference")
    replies = [ref.train(r) for r in range(4)]
    states = []
    for r in range(3):
        node.train(r, keep_from=0)  # keep every round (a checkpoint at 0 could be resumed)
        states.append(node.moon_state())
    store = client_app.client_store(node.context.node_config, KEY, 0)
    assert store is not None and store.rounds() == [0, 1, 2]

    node.context = node.fresh()  # a restarted node, asked for round 3: the state after round 2
    assert same_weights(weights_of(node.train(3, keep_from=0)), weights_of(replies[3]))
    assert same_weights(node.moon_state(), ref.moon_state())

    node.context = node.fresh()  # a resumed server redoing round 1: the state after round 0, not after 3
    assert same_weights(weights_of(node.train(1, keep_from=1)), weights_of(replies[1]))
    assert same_weights(node.moon_state(), states[1])
    assert store.rounds() == [0, 1]  # 2 and 3 were rounds the server abandoned; 0 is newest before keep-from


def test_a_refused_reply_is_undone_on_disk_too(digits_data_dir, tmp_path, inside_a_run):
    config = load_config(tiny_config(digits_data_dir, method="moon", rounds=3))
    node, ref = Node(config, tmp_path / "node"), Node(config, tmp_path / "reference")
    node.train(0)
    ref.train(0)
    node.train(1)  # the server refuses this reply; the node is restarted before it hears of it
    node.context = node.fresh()
    node.train(2, refused=1)
    ref.train(2)  # never ran round 1
    assert same_weights(node.moon_state(), ref.moon_state())


def test_forget_deletes_the_runs_state_on_the_node(tmp_path, inside_a_run):
    folder = tmp_path / KEY / "client-0"
    client_app.StateStore(folder).save(0, {})
    context = Context(run_id=1, node_id=7, node_config={"state-dir": str(tmp_path)}, state=RecordDict(),
                      run_config={})
    query = ConfigRecord({"query": "forget", "state-key": KEY})
    reply = client_app.query(Message(RecordDict({HEADER: query}), 7, MessageType.QUERY), context)
    assert not reply.has_error() and not (tmp_path / KEY).exists()


# ---------------------------------------------------------------------------- in process: ServerApp + ClientApp


class Killed(Exception):
    """The ServerApp's process died (raised by the grid)."""


class InProcessGrid:
    """Just enough of flwr's Grid to run the ServerApp against the ClientApp's handlers in this process.

    ``contexts``: node id -> that node's Context. ``kill_at``: the grid delivers that round's train
    messages (the nodes fit and keep their state) and then dies before any reply reaches the server.
    ``restart``: ``{round: node id}``: that node gets a new, empty Context before the round's train
    messages (a restarted SuperNode)."""

    HANDLERS = {MessageType.TRAIN: client_app.train, MessageType.EVALUATE: client_app.evaluate,
                MessageType.QUERY: client_app.query}

    def __init__(self, contexts: dict[int, Context], kill_at: int | None = None,
                 restart: dict[int, int] | None = None):
        self.contexts, self.kill_at, self.restart = contexts, kill_at, dict(restart or {})

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(self, messages, timeout=None) -> list[Message]:
        messages = list(messages)
        rounds = {int(m.content.config_records[HEADER]["round"]) for m in messages
                  if m.metadata.message_type == MessageType.TRAIN}
        for round in rounds & set(self.restart):
            node = self.restart.pop(round)
            self.contexts[node] = node_context(self.contexts[node].node_config)
        replies = [self.HANDLERS[m.metadata.message_type](m, self.contexts[m.metadata.dst_node_id]) for m in messages]
        if self.kill_at is not None and self.kill_at in rounds:
            raise Killed(f"killed in round {self.kill_at}")
        return replies


def node_context(node_config: dict[str, Any]) -> Context:
    return Context(run_id=1, node_id=0, node_config=node_config, state=RecordDict(), run_config={})


def node_contexts(state_dir: Path) -> dict[int, Context]:
    return {100 + k: node_context({"partition-id": k, "num-partitions": 3, "state-dir": str(state_dir)})
            for k in range(3)}


def assert_like_the_simulator(out: Path, settings: dict[str, Any], reference_dir: Path) -> None:
    rows = read_rows(out / "metrics.jsonl")
    expected_rows, expected_state = reference(settings, reference_dir)
    assert core(rows) == core(expected_rows)
    # every field: metrics.jsonl holds no timing (timing.jsonl does), so the files are equal byte for byte
    assert (out / "metrics.jsonl").read_bytes() == (reference_dir / "metrics.jsonl").read_bytes()
    assert_same_state(torch.load(out / "server_state.pt", weights_only=True)["server"], expected_state)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STATEFUL))
def test_a_killed_server_resumes_from_its_checkpoint_like_an_uninterrupted_run(name, digits_data_dir, tmp_path,
                                                                               inside_a_run, capsys):
    out, state_dir = tmp_path / "out", tmp_path / "node-state"
    settings = tiny_config(digits_data_dir, rounds=5, checkpoint_every=1, **STATEFUL[name])
    with pytest.raises(Killed):
        run_server(InProcessGrid(node_contexts(state_dir), kill_at=2), {}, {**settings, "out": str(out)})
    assert checkpoint.saved_rounds(out) == [1, 2] and not (out / "summary.json").exists()
    # the in-process engine cannot continue a Flower checkpoint: one line saying where to resume it
    capsys.readouterr()
    assert cli_main(["run", f"resume={out}", "progress=false"]) == 2
    error = capsys.readouterr().err.strip()
    assert "written by the Flower ServerApp" in error and len(error.splitlines()) == 1, error
    assert len(read_rows(out / "metrics.jsonl")) == 2  # the rows are written after every round
    # a new Flower run: new contexts on the same nodes (their disks), only resume= in the run config
    strategy = run_server(InProcessGrid(node_contexts(state_dir)), {"resume": str(out)})
    assert strategy.first_round == 2 and len(strategy.rows) == 5
    assert_like_the_simulator(out, settings, tmp_path / "reference")
    # the finished run's state was forgotten on every node; what stays is the personal models each node wrote
    # on its own disk (proto-only: no global model), each as the simulator's client model of the same run
    assert [path.name for path in state_dir.iterdir()] == (["models"] if name == "proto-only" else [])
    if name == "proto-only":
        import fedhpro

        (run_models,) = list((state_dir / "models").iterdir())  # one run key
        reference = tmp_path / "reference"
        x = torch.zeros(2, *json.loads((reference / "model.json").read_text())["input_shape"])
        for k in range(settings["clients"]):
            assert torch.equal(fedhpro.load_model(run_models / f"client-{k}", client=k)(x),
                               fedhpro.load_model(reference, client=k)(x))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STATEFUL))
def test_a_restarted_node_continues_from_its_disk(name, digits_data_dir, tmp_path, inside_a_run):
    out, state_dir = tmp_path / "out", tmp_path / "node-state"
    settings = tiny_config(digits_data_dir, rounds=4, **STATEFUL[name])
    grid = InProcessGrid(node_contexts(state_dir), restart={2: 101})
    run_server(grid, {}, {**settings, "out": str(out)})
    assert grid.restart == {}  # client 1's node was restarted before round 2
    assert_like_the_simulator(out, settings, tmp_path / "reference")


def test_resume_refuses_a_changed_experiment_and_a_folder_without_checkpoint(tmp_path):
    class UntouchableGrid:
        def __getattr__(self, name):
            raise AssertionError(f"the grid was used ({name}) before the resume was checked")

    with pytest.raises(ConfigError, match="no config.yaml there"):
        run_server(UntouchableGrid(), {"resume": str(tmp_path)})
    (tmp_path / "config.yaml").write_text("method: moon\nrounds: 3\n")
    with pytest.raises(ConfigError, match="no checkpoint yet"):
        run_server(UntouchableGrid(), {"resume": str(tmp_path)})
    with pytest.raises(ConfigError, match="resume takes its settings from .*remove rounds"):
        run_server(UntouchableGrid(), {"resume": str(tmp_path), "rounds": 4})


@pytest.mark.slow
def test_a_run_killed_with_the_default_checkpoints_resumes(digits_data_dir, tmp_path, inside_a_run):
    """No checkpoint_every in the run config (the README's flags): on Flower a checkpoint follows every round,
    so a ServerApp killed in round 2 resumes after round 1 (fedhpro run's default, 5, left nothing)."""
    out, state_dir = tmp_path / "out", tmp_path / "node-state"
    settings = tiny_config(digits_data_dir, rounds=3, method="moon")
    with pytest.raises(Killed):
        run_server(InProcessGrid(node_contexts(state_dir), kill_at=1), {}, {**settings, "out": str(out)})
    assert checkpoint.saved_rounds(out) == [1]
    assert load_config(out / "config.yaml").run.checkpoint_every == 1  # the value used is on record
    strategy = run_server(InProcessGrid(node_contexts(state_dir)), {"resume": str(out)})
    assert strategy.first_round == 1 and len(strategy.rows) == 3
    assert_like_the_simulator(out, settings, tmp_path / "reference")


def nothing_to_resume(folder: Path) -> Path:
    """A run folder with its config.yaml and no checkpoint (a run killed before its first one)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text("method: moon\nrounds: 3\n")
    return folder


def test_resume_with_nothing_to_resume_ends_the_serverapp_with_one_line(tmp_path, inside_a_run, monkeypatch, capsys):
    from fedhpro.flower import server as server_module
    from fedhpro.flower.server import make_server_app

    logged: list[tuple[int, str]] = []
    monkeypatch.setattr(server_module, "log", lambda level, message, *args: logged.append((level, message % args)))
    folder = nothing_to_resume(tmp_path / "out")
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={"resume": str(folder)})

    class UntouchableGrid:
        def __getattr__(self, name):
            raise AssertionError(f"the grid was used ({name}) before the resume was checked")

    with pytest.raises(ConfigError) as caught:
        make_server_app()(UntouchableGrid(), context)
    message = str(caught.value)
    assert "no checkpoint yet" in message and "\n" not in message
    import logging
    import traceback

    assert logged == [(logging.ERROR, f"fedhpro: error: {message}")]
    assert capsys.readouterr().err.strip() == f"fedhpro: error: {message}"
    # raised from the ServerApp's main (what Flower logs and puts in the run's details), not from deep inside
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert not any(frame.filename.endswith(("api.py", "settings.py")) for frame in frames), frames
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


# ---------------------------------------------------------------------------- on loopback: real processes


@pytest.mark.deploy
def test_resume_with_nothing_to_resume_is_finished_failed_in_flwr_ls(tmp_path):
    folder = nothing_to_resume(tmp_path / "out")
    with Loopback(tmp_path) as net:
        net.start_superlink()
        run_id = net.flwr_run({"resume": str(folder)})  # no SuperNode needed: it fails before asking any
        record = net.run_record(run_id)
        server_log = (net.logs / f"run-{run_id}.log").read_text()
    assert record["status"] == "finished:failed", record
    lines = [line for line in server_log.splitlines() if "fedhpro: error:" in line]
    assert lines and all("no checkpoint yet" in line for line in lines), server_log

#: seconds to wait for a checkpoint or a row of a run on the busy 2-core test machine (a tiny round: ~20 s)
ROUND_WAIT = 300


def wait_until(net, what: str, done, seconds: float = ROUND_WAIT) -> None:
    """Until ``done()`` holds; fails with every log's tail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not done():
        net.processes.remember_children()
        if time.monotonic() > deadline:
            net.fail(f"no {what} after {seconds:.0f} s")
        time.sleep(0.5)


def rows_written(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(read_rows(path)) if path.is_file() else 0


def node_config(k: int, state_dir: Path) -> str:
    return f'partition-id={k} num-partitions=2 state-dir="{state_dir}"'


@pytest.mark.deploy
def test_a_killed_superlink_is_restarted_and_resume_finishes_the_run_like_the_simulator(digits_data_dir, tmp_path):
    out, state_dir = tmp_path / "out", tmp_path / "node-state"
    # 3 rounds: killed once 1 has completed, the resumed run does the other 2 (its state across a round too)
    settings = tiny_config(digits_data_dir, method="fedsa", rounds=3, checkpoint_every=1)
    settings.pop("clients")  # 2 SuperNodes
    # the SuperLink keeps its state in a file: restarted without one it forgets the nodes, whose next call
    # is then refused as unauthenticated, and they stop (flwr 1.42) instead of reconnecting
    database = ["--database", str(tmp_path / "superlink.db")]
    with Loopback(tmp_path) as net:
        net.start_superlink(database)
        for k in range(2):
            net.start_supernode(f"node-{k}", node_config(k, state_dir), wait=False)
        net.wait_connected("node-0", "node-1")
        net.flwr_run({**settings, "out": str(out)}, wait=False)
        wait_until(net, "checkpoint of round 1", lambda: 1 in checkpoint.saved_rounds(out))
        net.kill("superlink", signal.SIGKILL)  # the SuperLink and the ServerApp it runs: a crashed machine
        assert not (out / "summary.json").exists()
        # the same port and database; the SuperNodes reconnect by themselves (flower-supernode retries
        # without limit unless given --max-retries / --max-wait-time)
        net.start_superlink(database)
        resumed = net.flwr_run({"resume": str(out)})
        net.assert_completed(resumed)
    assert_like_the_simulator(out, {**settings, "clients": 2}, tmp_path / "reference")
    assert not any(state_dir.iterdir())  # the finished run's client state was forgotten


@pytest.mark.deploy
def test_a_killed_supernode_is_restarted_and_its_client_goes_on_like_the_simulator(digits_data_dir, tmp_path):
    out, state_dir = tmp_path / "out", tmp_path / "node-state"
    # one client per round, seed 12: client 1 trains in rounds 0 and 1, sits out 2 and 3, trains in round 4
    # with MOON's previous model from round 1, which its restarted node must take up from its disk
    settings = tiny_config(digits_data_dir, method="moon", rounds=5, participation=0.5, seed=12)
    settings.pop("clients")
    plan = [[1], [1], [0], [0], [1]]
    with Loopback(tmp_path) as net:
        net.start_superlink()
        for k in range(2):
            net.start_supernode(f"node-{k}", node_config(k, state_dir), wait=False)
        net.wait_connected("node-0", "node-1")
        run_id = net.flwr_run({**settings, "out": str(out)}, wait=False)
        wait_until(net, "row of round 1", lambda: rows_written(out) >= 2)
        # the SuperNode and its flwr-clientapp processes; SIGTERM: it says goodbye, so the SuperLink lists it
        # offline at once and its restarted self may take client 1 back (a node claiming a client whose node
        # is still listed online waits: after a SIGKILL that is ~60 s, see test_flower_node_failure.py)
        net.kill("node-1", signal.SIGTERM)
        net.start_supernode("node-1", node_config(1, state_dir))  # a new process, a new Flower node id
        net.wait_run(run_id)
        net.assert_completed(run_id)
    rows = read_rows(out / "metrics.jsonl")
    assert [row["participants"] for row in rows] == plan and not any(row.get("dropped") for row in rows)
    assert_like_the_simulator(out, {**settings, "clients": 2}, tmp_path / "reference")
