"""The fedhpro ServerApp: any registered method's server part driving Flower SuperNodes.

One run, as the in-process simulator does it (see :mod:`fedhpro.flower.engine`):

1. resolve the config (defaults, the app's ``base`` settings, then Flower's ``run_config``);
2. wait for the nodes and ask each for its ``partition-id`` (a ``query`` message):
   partition ``k`` is the simulator's client ``k``; ``clients`` defaults to the
   nodes' ``num-partitions``;
3. each round, :class:`MethodStrategy` samples the participants with the
   simulator's seeded draw, sends each its own message holding the method's
   broadcast payload, validates and aggregates the replies with the method's
   server part (in client order), and evaluates like the simulator (the global
   model on the server, or, with personal models, each client's model on its node);
4. if ``out`` is set, write ``metrics.jsonl`` (same rows as ``fedhpro run``),
   ``summary.json``, ``config.yaml``, ``partition.json`` and ``server_state.pt``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from fedhpro import reports
from fedhpro.api import check_new_run_folder
from fedhpro.config import Config, load_config
from fedhpro.engines.simulator import _FAULT, RoundRecord, Simulator, _corrupted, _weighted_mean, derive_seed
from fedhpro.errors import ConfigError, FedHProError, UpdateError
from fedhpro.flower import records
from fedhpro.flower.engine import build_engine, config_text
from fedhpro.flower.settings import FlowerSettings, config_from_run_config
from fedhpro.metrics import payload_bytes

#: the ConfigRecord every fedhpro message carries: the resolved config (JSON), the round and the client
HEADER = "fedhpro.header"
#: record-name prefix of the server state sent with client-side evaluation (inference may need it)
SERVER_STATE = "server-state/"


def discover_nodes(grid: Grid, clients: int | None, settings: FlowerSettings) -> tuple[dict[int, int], int]:
    """``({partition-id: node id}, number of clients)``: ask every node which partition it holds.

    Waits up to ``settings.node_wait`` seconds for all partitions to connect.
    Raises ConfigError (one line) when the nodes do not cover exactly the
    partitions ``0..K-1`` of a ``K``-client federation.
    """
    deadline = time.monotonic() + settings.node_wait
    known: dict[int, tuple[int, int]] = {}  # node id -> (partition-id, num-partitions)
    while True:
        new = [node for node in grid.get_node_ids() if node not in known]
        if new:
            queries = [Message(RecordDict({HEADER: ConfigRecord({"query": "partition"})}), node, MessageType.QUERY)
                       for node in new]
            for reply in grid.send_and_receive(queries, timeout=max(1.0, deadline - time.monotonic())):
                node = reply.metadata.src_node_id
                if reply.has_error():
                    raise ConfigError(f"node {node} cannot take part: {reply.error.reason}")
                info = reply.content.config_records["fedhpro.node"]
                known[node] = (int(info["partition-id"]), int(info["num-partitions"]))
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


class MethodStrategy(Strategy):
    """A Flower Strategy running one fedhpro method, with the simulator's sampling, validation and evaluation.

    It subclasses ``Strategy`` rather than ``FedAvg``: a fedhpro reply carries
    several ArrayRecords (weights, prototypes, class gradients), which FedAvg's
    reply validation rejects and its aggregation would average. Every reply is
    decoded back to the method's payload and handed to the method's own server
    part, so any method runs unchanged.
    """

    def __init__(self, engine: Simulator, config: Config, nodes: dict[int, int]):
        self.engine = engine
        self.config = config
        self.nodes = nodes  # partition-id (= client index) -> Flower node id
        self.partition_of = {node: k for k, node in nodes.items()}
        self.text = config_text(config)
        self.rows: list[dict[str, Any]] = []
        self.timings: list[dict[str, Any]] = []
        self._round: dict[str, Any] = {}

    # ------------------------------------------------------------------ helpers

    def _header(self, round: int, client: int) -> ConfigRecord:
        return ConfigRecord({"config": self.text, "round": round, "client": client})

    def _evaluates(self, round: int) -> bool:
        return (round + 1) % self.engine.eval_every == 0 or round + 1 == self.engine.rounds

    def summary(self) -> None:
        log(INFO, "\t├── fedhpro method: %s on %s, %d clients (one per SuperNode)",
            self.config.run.method, self.config.run.dataset, len(self.nodes))

    # ------------------------------------------------------------------ training

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One message per sampled client, each with its own RecordDict (the payload is per round, the header
        per client); a client the fault model drops gets none, as in the simulator."""
        round = server_round - 1
        started = time.perf_counter()
        participants = self.engine.sample_clients(round)
        payload = self.engine.server.broadcast(round)
        encoded = records.encode_payload(payload)
        dropped, sent = [], []
        for k in participants:
            draw_dropout, draw_corrupt = np.random.default_rng(derive_seed(self.engine.seed, _FAULT, round, k)).random(2)
            if draw_dropout < self.engine.faults.dropout:
                dropped.append({"client": k, "reason": "did not answer (faults.dropout)"})
                continue
            sent.append((k, draw_corrupt))
        self._round = {"round": round, "participants": participants, "dropped": dropped, "sent": dict(sent),
                       "bytes_down": payload_bytes(payload) * len(participants), "started": started}
        return [Message(RecordDict({**encoded, HEADER: self._header(round, k)}), self.nodes[k], MessageType.TRAIN)
                for k, _ in sent]

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate every reply with the method's server part, aggregate the valid ones in client order."""
        state = self._round
        round = state["round"]
        answers: dict[int, Message] = {}
        for reply in list(replies):  # an iterable that can be read once
            answers[self.partition_of[reply.metadata.src_node_id]] = reply
        # the method's container, filled reply by reply as the simulator fills it: the same arithmetic (each
        # reply's weights folded into the running sum on arrival), so both engines give the same bits
        valid = self.engine.server.new_replies()
        train_metrics, errors = [], []
        bytes_up = 0
        dropped = state["dropped"]
        for k in sorted(state["sent"]):  # the simulator's order: sorted participants
            reply = answers.get(k)
            if reply is None:
                dropped.append({"client": k, "reason": "no reply before flower.round-timeout"})
                errors.append(f"client {k}: no reply")
                continue
            if reply.has_error():
                dropped.append({"client": k, "reason": reply.error.reason})
                errors.append(f"client {k}: {reply.error.reason}")
                continue
            try:
                payload = records.decode_payload(reply.content, self.engine.device)
                if state["sent"][k] < self.engine.faults.corrupt:
                    payload = _corrupted(payload)
                self.engine.server.validate_reply(payload)
            except UpdateError as error:
                dropped.append({"client": k, "reason": f"invalid update: {error}"})
                continue
            bytes_up += payload_bytes(payload)
            valid.append(payload)
            train_metrics.append((len(self.engine.federation.clients[k]), records.decode_metrics(reply.content)))
        dropped.sort(key=lambda item: state["participants"].index(item["client"]))
        if errors and len(errors) == len(state["participants"]):
            raise FedHProError(f"round {round}: every client failed; {errors[0]}")
        for item in dropped:
            log(WARNING, "fedhpro: round %d: client %d dropped: %s", round, item["client"], item["reason"])
        client_seconds = time.perf_counter() - state["started"]
        timer = time.perf_counter()
        skipped = len(valid) < self.engine.min_clients
        if skipped:
            log(WARNING, "fedhpro: round %d: only %d valid updates (min_clients=%d); the round is skipped",
                round, len(valid), self.engine.min_clients)
            server_metrics: dict[str, float] = {}
        else:
            server_metrics = self.engine.server.aggregate(round, valid)
        state.update(train=_weighted_mean(train_metrics), server=server_metrics, skipped=skipped,
                     bytes_up=bytes_up,
                     seconds={"clients": client_seconds, "server": time.perf_counter() - timer})
        arrays = ArrayRecord({key: records.to_array(v) for key, v in self.engine.server.global_weights().items()})
        return arrays, records.encode_metrics(state["train"])

    # ------------------------------------------------------------------ evaluation

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Personal models live on the nodes: every client evaluates its own (with the global shared part and
        the server's inference rule). A global model is evaluated on the server: no messages."""
        round = server_round - 1
        self._round["eval_started"] = time.perf_counter()
        if not self._evaluates(round) or not self.engine.heterogeneous:
            return []
        encoded = records.encode_payload({"weights": self.engine.server.global_weights()})
        encoded.update(records.encode_payload(self.engine.server.state_dict(), prefix=SERVER_STATE))
        return [Message(RecordDict({**encoded, HEADER: self._header(round, k)}), node, MessageType.EVALUATE)
                for k, node in sorted(self.nodes.items())]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The round's accuracy as the simulator computes it; then the round's row is complete."""
        state = self._round
        round = state["round"]
        accuracy = None
        if self._evaluates(round):
            if not self.engine.heterogeneous:
                accuracy = self.engine.evaluate_global()
            else:
                accuracy = self._client_side_accuracy(list(replies))
        record = RoundRecord(round=round, participants=state["participants"], train=state["train"],
                             server=state["server"], accuracy=accuracy, bytes_up=state["bytes_up"],
                             bytes_down=state["bytes_down"],
                             seconds={**state["seconds"], "eval": time.perf_counter() - state["eval_started"]},
                             dropped=state["dropped"], skipped=state["skipped"])
        self.engine.history.append(record)
        self.rows.append(record.to_json())
        self.timings.append({"round": round, **record.seconds})
        if accuracy is None:
            return None
        log(INFO, "fedhpro: round %d: test accuracy AVG %.2f%%", round, accuracy["AVG"])
        return MetricRecord({f"accuracy.{name}": value for name, value in accuracy.items()})

    def _client_side_accuracy(self, replies: list[Message]) -> dict[str, float]:
        """Per client accuracy -> per test set mean -> mean over test sets: Simulator.evaluate_global's rule."""
        per_client: dict[int, tuple[str, float]] = {}
        for reply in replies:
            k = self.partition_of[reply.metadata.src_node_id]
            if reply.has_error():
                raise FedHProError(f"client {k} could not evaluate: {reply.error.reason}")
            info = reply.content.config_records["fedhpro.eval"]
            per_client[k] = (str(info["test-set"]), float(reply.content.metric_records["fedhpro.eval-metrics"]["accuracy"]))
        missing = sorted(set(self.nodes) - set(per_client))
        if missing:
            raise FedHProError(f"clients {missing} sent no evaluation before flower.round-timeout")
        ordered = [per_client[k] for k in sorted(per_client)]
        test_sets = self.engine.federation.test_sets
        names = [name for name in test_sets if any(n == name for n, _ in ordered)]
        accuracy = {name: float(np.mean([a for n, a in ordered if n == name])) for name in names}
        accuracy["AVG"] = float(np.mean([accuracy[name] for name in names]))
        return accuracy


def run_server(grid: Grid, run_config: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> MethodStrategy:
    """Run the experiment that ``base`` + ``run_config`` describe on the nodes of ``grid``; return the strategy."""
    config, settings = config_from_run_config(run_config, base)
    config = load_config(config.to_dict(), {"progress": False})  # no progress bars in a server log
    out = Path(config.run.out) if config.run.out else None
    if out is not None:
        check_new_run_folder(out)  # before any node is asked: another run's results must not be overwritten
    started = time.perf_counter()

    def warn(message: str) -> None:
        log(WARNING, "fedhpro: %s", message)

    nodes, clients = discover_nodes(grid, config.run.clients, settings)
    if config.run.clients is None:
        config = load_config(config.to_dict(), {"clients": clients})
    engine = build_engine(config, on_drop=warn)
    if engine.federation.num_clients != clients:
        raise ConfigError(f"the federation has {engine.federation.num_clients} clients but {clients} SuperNodes "
                          f"hold partitions; set clients={engine.federation.num_clients} or run that many SuperNodes")
    strategy = MethodStrategy(engine, config, nodes)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        reports.write_yaml(out / "config.yaml", config.to_dict())
        reports.write_json(out / "partition.json", engine.federation.partition)
    initial = ArrayRecord({key: records.to_array(v) for key, v in engine.server.global_weights().items()})
    strategy.start(grid, initial, num_rounds=config.run.rounds, timeout=settings.round_timeout)
    if out is not None:
        write_results(out, strategy, time.perf_counter() - started)
    return strategy


def write_results(out: Path, strategy: MethodStrategy, seconds: float) -> None:
    """``metrics.jsonl``, ``timing.jsonl``, ``summary.json`` (as ``fedhpro run`` writes them) and the server state."""
    engine, options = strategy.engine, strategy.config.run
    rows = strategy.rows
    last = next(row["accuracy"] for row in reversed(rows) if "accuracy" in row)
    reports.write_jsonl(out / "metrics.jsonl", rows)
    reports.write_jsonl(out / "timing.jsonl", strategy.timings)
    reports.write_json(out / "summary.json", {
        "method": options.method, "dataset": options.dataset, "seed": options.seed, "rounds": options.rounds,
        "clients": engine.federation.num_clients, "accuracy": last["AVG"],
        "per_domain": {name: value for name, value in last.items() if name != "AVG"},
        "best_accuracy": max(row["accuracy"]["AVG"] for row in rows if "accuracy" in row),
        "seconds": seconds, "device": str(engine.device), "engine": "flower",
        "bytes_up": sum(row["bytes_up"] for row in rows), "bytes_down": sum(row["bytes_down"] for row in rows),
        "notes": engine.federation.notes})
    # the method's server state (weights, hyper-prototypes, ...), loadable with torch.load(weights_only=True)
    reports.write_atomic_with(out / "server_state.pt",
                              lambda handle: torch.save({"completed_rounds": len(rows),
                                                         "server": engine.server.state_dict()}, handle))


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
            log(WARNING, "fedhpro: error: %s", error)
            print(f"fedhpro: error: {error}", file=sys.stderr)
            raise

    return server_app


#: the ServerApp of ``examples/flower`` (``serverapp = "fedhpro.flower.server:app"``)
app = make_server_app()
