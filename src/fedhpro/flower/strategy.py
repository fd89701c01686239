"""The Flower Strategy of a fedhpro run: any method's server part through the shared round protocol.

:class:`MethodStrategy` moves the round protocol's messages (:class:`~fedhpro.engines.protocol.RoundProtocol`:
sampling, fault draws, validation, drops, skipped rounds): one message per participant, holding the method's
broadcast payload, the replies handed back to the protocol in client order; under
``flower.secure-aggregation=secagg+`` the uploads are summed by Flower's SecAgg+ (:class:`Secure`,
:mod:`fedhpro.flower.secagg`). Evaluation pools the nodes' test counts per test set, or tests one global
model on the server's test sets in partition mode.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any, ClassVar

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from fedhpro.config import Config
from fedhpro.engines import checkpoint
from fedhpro.engines.chain import Reception
from fedhpro.engines.evaluation import TestCount, weighted_mean
from fedhpro.engines.interface import FLOWER, EngineKind
from fedhpro.engines.lifecycle import Run
from fedhpro.engines.one_round import RoundClock, round_extra
from fedhpro.engines.protocol import OpenRound, RoundRecord
from fedhpro.errors import FedHProError, UpdateError
from fedhpro.flower import records, secagg
from fedhpro.flower.answers import eval_count, max_classes
from fedhpro.flower.engine import ServerSide, config_text
from fedhpro.flower.nodes import NODE_OFFLINE, Nodes, error_reason, match_replies
from fedhpro.flower.records import EVAL_RECORD, HEADER, PRIVACY, SERVER_STATE
from fedhpro.flower.settings import FlowerSettings, SecureSettings, auto_round_timeout
from fedhpro.privacy.client import privatized_layout

#: rounds in a row with an invalid secure sum (each skipped) after which a SecAgg+ run stops
MAX_FAILED_SUMS = 3


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
                  round_timeout(settings.round_timeout, config, side))


def round_timeout(timeout: float | None, config: Config, side: ServerSide) -> float:
    """The seconds a round waits for its replies: ``timeout`` (``flower.round-timeout``) as given, or, left
    unset (None), sized from the run: its local epochs, batch size, the largest client's capped training-set
    size and the clients asked in a round (:func:`~fedhpro.flower.settings.auto_round_timeout`)."""
    if timeout is not None:
        return float(timeout)
    sizes = side.protocol.capped_sizes(side.num_samples) if side.num_samples else [0]
    clients = len(side.num_samples)
    participants = max(1, min(clients, math.ceil(side.protocol.participation * clients)))
    return auto_round_timeout(config.run.local_epochs, config.run.batch_size, max(sizes), participants)


class MethodStrategy(Strategy):
    """A Flower Strategy running one fedhpro method through the shared round protocol.

    It subclasses ``Strategy`` rather than ``FedAvg``: a fedhpro reply carries
    several ArrayRecords (weights, prototypes, class gradients), which FedAvg's
    reply validation rejects and its aggregation would average. Every reply is
    decoded back to the method's payload and handed to the protocol, which
    validates it and gives it to the method's own server part, so any method
    runs unchanged.
    """

    def __init__(self, side: ServerSide, config: Config, nodes: Mapping[int, int], run_key: str | None = None,
                 node_auth: bool = False, secure: Secure | None = None, run: Run | None = None):
        """``nodes``: ``{client index: node id}`` (a :class:`~fedhpro.flower.nodes.Nodes`, or a plain dict in
        partition mode). ``run_key``: the key under which the nodes keep the clients' state on disk
        (:func:`~fedhpro.flower.server.run_key`; None: they keep none). A resumed run takes its key, rows and
        round offset from its checkpoint (:meth:`load_state_dict`). ``node_auth`` (``flower.node-auth``): the
        SuperLink authenticates its SuperNodes, so a node that comes back with a new node id must show the key
        its client's node had at discovery (``nodes.client_keys``). ``secure``
        (``flower.secure-aggregation=secagg+``): the uploads are summed by Flower's SecAgg+ and the protocol
        gets replies rebuilt from the sum (:mod:`fedhpro.flower.secagg`). ``run``: the run around the rounds
        (:class:`~fedhpro.engines.lifecycle.Run`: its rows, checkpoints and folder), given by the run setup, whose
        loop (:func:`~fedhpro.engines.lifecycle.train` through :class:`FlowerEngine`) keeps each round's rows;
        default: one that writes no folder, whose rows this strategy keeps itself, as it must when Flower's own
        ``Strategy.start`` drives it."""
        self.side = side
        self.secure = secure
        self._outcome: secagg.SecureOutcome | None = None
        self._asked: dict[int, int] = {}  # node id -> client, of the current SecAgg+ round
        self.config = config
        #: client index -> Flower node id, and what recognises a client's node when it comes back
        self.nodes = nodes if isinstance(nodes, Nodes) else Nodes(nodes)
        self.text = config_text(config)
        self._run = run
        self._round: OpenRound | None = None
        self._clock = RoundClock(time.perf_counter())
        #: the latest round's record (its row)
        self.last_record: RoundRecord | None = None
        #: whether the strategy keeps each round's rows and checkpoints itself (:meth:`Run.round_done`): only
        #: without a given run (Flower's own ``Strategy.start`` drives it); a given run's loop keeps them
        self.keeps_rows = run is None
        self._server_metrics: dict[str, float] = {}
        self.refused: dict[int, int] = {}  # client -> the round of its latest reply refused as invalid
        self.run_key = run_key
        self.keep_from: int | None = None  # the oldest round the run can go back to (its oldest checkpoint)
        self.node_auth = node_auth
        self._tests: dict[int, tuple[str, int]] | None = None  # client -> (its test set, its size)
        self._sent: list[tuple[int, Message]] = []  # (client, message) of the current train or evaluate step
        #: rounds in a row whose secure sum was invalid (flower.secure-aggregation=secagg+)
        self.failed_sums = 0

    @property
    def run(self) -> Run:
        """The run around the rounds: each round's rows, and its checkpoints when it has a folder (made on
        first use when none was given: a run that writes no folder)."""
        if self._run is None:
            self._run = Run(None, self.config.run, self.side.protocol, engine=FLOWER)
        return self._run

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
    rows = property(lambda self: self.run.rows.metrics)
    timings = property(lambda self: self.run.rows.timings)
    first_round = property(lambda self: self.run.first_round)

    def round_index(self, server_round: int) -> int:
        """fedhpro's round (from 0) of Flower's ``server_round`` (from 1 at every start; a resumed run
        starts after its checkpoint's rounds)."""
        return self.first_round + server_round - 1

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs besides the rows: the method's server state, the refused replies (their
        nodes may not have heard yet) and the key of the clients' state on the nodes."""
        state = {"server": self.server.state_dict(), "refused": dict(self.refused), "run_key": self.run_key or ""}
        protocol = self.side.protocol.state_dict()
        if protocol:  # adaptive clipping's clip; absent otherwise (those checkpoints keep their bytes)
            state["protocol"] = protocol
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's state (its rows and round: :meth:`~fedhpro.engines.lifecycle.Run.open`)."""
        self.side.protocol.load_state_dict(state.get("protocol") or {})
        self.server.load_state_dict(state["server"])
        self.refused = {int(k): int(r) for k, r in state["refused"].items()}
        self.run_key = state["run_key"] or None

    # the nodes' state (fedhpro.flower.nodes.Nodes): node id -> client, node ids not asked again, new node ids
    # waiting for their client's node to leave, client -> its node's public key at discovery
    partition_of = property(lambda self: self.nodes.client_of)
    strangers = property(lambda self: self.nodes.strangers)
    waiting = property(lambda self: self.nodes.waiting)
    keys = property(lambda self: self.nodes.client_keys)

    def _rejoin(self, grid: Grid) -> set[int]:
        """The node ids the SuperLink lists as online, after mapping any new node back to its client
        (:meth:`~fedhpro.flower.nodes.Nodes.rejoin`, with this run's config and ``flower.node-auth``)."""
        return self.nodes.rejoin(grid, self.text, max_classes(self.config), self.node_auth)

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
        unbound: dict[int, str] = {}  # replies from another node than asked, or a copy of another's
        answers = match_replies(self._sent, list(replies), unbound, distinct=True)  # read once
        for k, _ in self._sent:
            reply = answers.get(k)
            if k in unbound:
                current.fail(k, f"refused reply: {unbound[k]}")
                self.refused[k] = current.round
            elif reply is None:
                current.fail(k, "no reply before flower.round-timeout")
            elif reply.has_error():
                current.fail(k, error_reason(reply.error))
            else:
                try:
                    metrics = records.decode_metrics(reply.content)  # bounded: checked before the payload
                    payload = records.decode_payload(reply.content, self.side.device, expected=self._reply_layout())
                except FedHProError as error:  # a malformed reply: refused like an invalid update
                    current.fail(k, f"invalid update: {error}")
                    self.refused[k] = current.round
                    continue
                reception = current.receive(k, payload, metrics, self.side.num_samples[k])
                if reception is Reception.INVALID:
                    self.refused[k] = current.round
        self._clock = RoundClock(current.started)
        self._clock.lap("clients")
        self._server_metrics = current.close()
        self._clock.lap("server")
        arrays = ArrayRecord({key: records.to_array(v) for key, v in self.server.global_weights().items()})
        return arrays, records.encode_metrics(weighted_mean(current.train_metrics))

    def _reply_layout(self) -> dict[str, Any]:
        """What a client's reply must hold: the method's layout, under ``privacy=client`` with the privacy's
        holder vector (:func:`fedhpro.privacy.client.privatized_layout`)."""
        layout = self.server.reply_layout()
        if self.side.protocol.client_privacy is not None:
            return privatized_layout(layout, int(self.server.num_classes), self.side.protocol.client_privacy.adaptive)
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
                                         self.secure.timeout, error_reason)

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
            self._skip_invalid_sum(current, clients, error)
            return
        self.failed_sums = 0
        for k, reply in zip(clients, replies, strict=True):
            if current.receive(k, reply, dict(metrics), self.side.num_samples[k]) is Reception.INVALID:
                self.refused[k] = current.round

    def _skip_invalid_sum(self, current: OpenRound, clients: list[int], error: UpdateError) -> None:
        """A secure sum no honest set of these clients can give (one of them packed what it cannot hold): the
        round is skipped and the global model kept, with a warning. SecAgg+ hides who sent what, so the
        warning can name only the summed clients, one or more of whom lied; each goes back to its state from
        before the round. :data:`MAX_FAILED_SUMS` such rounds in a row stop the run in one line (a node that
        spoils every sum would otherwise stall it silently)."""
        self.failed_sums += 1
        who = ", ".join(str(k) for k in clients)
        reason = f"invalid secure sum (one or more of clients {who} sent it; SecAgg+ hides which): {error}"
        for k in clients:
            # dropped without a failure: the round is skipped for too few valid updates, not ended as a bug
            current.dropped.append({"client": k, "reason": reason})
            self.refused[k] = current.round
        log(WARNING, "fedhpro: round %d: %s; the round is skipped and the global model kept (%d of %d in a row)",
            current.round + 1, reason, self.failed_sums, MAX_FAILED_SUMS)
        if self.failed_sums >= MAX_FAILED_SUMS:
            raise FedHProError(f"round {current.round + 1}: the secure sum was invalid in {MAX_FAILED_SUMS} rounds "
                               f"in a row, the last of clients {who} ({error}); stopped with the model of the last "
                               "valid round. Find the node packing what it cannot hold (run a round without "
                               "flower.secure-aggregation, or with a roster of trusted nodes) and restart")

    # ------------------------------------------------------------------ evaluation

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Federated evaluation: every node tests on its own data (the global model, or its personal model
        with the global shared part, through the server's inference rule, whose state travels along). A
        global model in partition mode is tested on the server: no messages. A node the SuperLink no longer
        lists gets none (its client is not evaluated this round)."""
        round = self.round_index(server_round)
        self._clock.start()
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
            validation = None
            if self.side.federated_evaluation:
                accuracy, per_client, missing = self._pooled_accuracy(current.round, list(replies))
            else:
                tests = self.side.tests
                assert tests is not None, "only partition mode (which holds the data) evaluates on the server"
                accuracy, per_client = tests.evaluate_clients()
                validation = tests.evaluate_validation() if tests.validates else None
            extra = round_extra(None, per_client, None, missing, validation=validation)
        self._clock.lap("eval")
        record = self.last_record = current.record(self._server_metrics, accuracy, self._clock.seconds, extra)
        if self.keeps_rows and self.run.round_done(record, self.state_dict) and self.run.out is not None:
            self.keep_from = min(checkpoint.saved_rounds(self.run.out))  # the nodes may forget what is older
        if accuracy is None:
            return None
        log(INFO, "fedhpro: round %d: test accuracy AVG %.2f%%", current.round, accuracy["AVG"])
        return MetricRecord({f"accuracy.{name}": value for name, value in accuracy.items()})

    def client_test(self, k: int) -> tuple[str, int]:
        """``(test-set name, size)`` client ``k`` is tested on: in partition mode the server's copy of it
        (the simulator's :meth:`~fedhpro.engines.simulator.Simulator.client_test`), with its own data what
        its node declared at discovery (its domain, else ``all``, as the node's federation names it)."""
        if self._tests is None:
            held, infos = self.side.tests, self.nodes.infos
            if held is not None:
                tests = {k: held.client_test(k) for k in self.nodes}
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
        unbound: dict[int, str] = {}
        for k, reply in match_replies(self._sent, replies, unbound).items():
            if reply.has_error():
                reasons[k] = error_reason(reply.error)
                if reply.error.code != ErrorCode.NODE_UNAVAILABLE:
                    own_errors.append(k)
                continue
            try:
                counts[k] = eval_count(reply.content.config_records.get(EVAL_RECORD), self.client_test(k))
            except UpdateError as error:  # counts it cannot have: not pooled
                reasons[k] = f"invalid evaluation: {error}"
        reasons.update({k: f"refused reply: {why}" for k, why in unbound.items()})
        if self._sent and len(own_errors) == len(self._sent):
            first = min(own_errors)
            raise FedHProError(f"round {round + 1}: every client failed to evaluate; client {first}: {reasons[first]}")
        asked = dict(self._sent)
        missing = []
        for k in sorted(set(self.nodes) - set(counts)):
            reason = reasons.get(k, "no answer before flower.round-timeout" if k in asked else NODE_OFFLINE)
            log(WARNING, "fedhpro: round %d: client %d not evaluated: %s", round, k, reason)
            missing.append({"client": k, "reason": reason})
        if not counts:
            return None, [], missing
        ordered = [counts[k] for k in sorted(counts)]
        order = list(self.side.federation.test_sets) if self.side.federation is not None else None
        accuracy = self.side.protocol.pooled_accuracy(ordered, order)
        # a client without test data of its own is not tested (None: no accuracy, out of the fairness statistics)
        return accuracy, [c.accuracy if c.total else None for c in ordered], missing



class FlowerEngine:
    """The Flower ServerApp as an :class:`~fedhpro.engines.interface.Engine`, so that
    :func:`~fedhpro.engines.lifecycle.execute` runs it as it runs the in-process simulator: a round is the
    strategy's training messages sent to the nodes through ``grid`` and their replies handed back, then its
    evaluation messages likewise (the calls Flower's ``Strategy.start`` makes, each waiting at most
    ``timeout`` seconds). ``partition``: partition.json's record of the nodes (own data: what each declared)."""

    kind: ClassVar[EngineKind] = FLOWER

    def __init__(self, strategy: MethodStrategy, grid: Grid, timeout: float, partition: Mapping[str, Any]):
        assert not strategy.keeps_rows, "the strategy of an engine is given the run, whose loop keeps the rows"
        self.strategy, self.grid, self.timeout, self.partition = strategy, grid, timeout, partition
        side = strategy.side
        self.protocol, self.server, self.models, self.device = side.protocol, side.server, side.models, side.device

    def run_round(self, round: int) -> RoundRecord:
        strategy = self.strategy
        run = strategy.run
        if run.out is not None:  # the nodes may forget client state older than the oldest checkpoint
            saved = checkpoint.saved_rounds(run.out)
            strategy.keep_from = min(saved) if saved else strategy.keep_from
        server_round = round - strategy.first_round + 1
        replies = self.grid.send_and_receive(
            strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(), self.grid), timeout=self.timeout)
        strategy.aggregate_train(server_round, replies)
        replies = self.grid.send_and_receive(
            strategy.configure_evaluate(server_round, ArrayRecord(), ConfigRecord(), self.grid), timeout=self.timeout)
        strategy.aggregate_evaluate(server_round, replies)
        assert strategy.last_record is not None and strategy.last_record.round == round
        return strategy.last_record

    def pooled_test_sizes(self) -> list[tuple[str, int]]:
        """``(test set, test size)`` of every client whose test counts are pooled: own data, each node's declared
        test size (partition.json's record of it); partition mode, the engine's."""
        tests = self.strategy.side.tests
        if tests is None:
            return [(str(client.get("domain") or "all"), int(client.get("test_size", 0)))
                    for client in self.partition["clients"]]
        return tests.pooled_test_sizes()

    @property
    def client_names(self) -> list[str] | None:
        infos = self.strategy.nodes.infos
        if infos is not None:
            return [info.name for info in infos]
        federation = self.strategy.side.federation
        return federation.client_names if federation is not None else None

    def state_dict(self) -> dict[str, Any]:
        return self.strategy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.strategy.load_state_dict(state)

    def end_run(self) -> None:
        """Nothing to end on the server (each node forgets its clients' state when asked: the ServerApp's end)."""
