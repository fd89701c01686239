"""The fedhpro ServerApp: any registered method's server part driving Flower SuperNodes.

One run, as the in-process simulator does it (see :mod:`fedhpro.flower.engine`):

1. resolve the config (defaults, the app's ``base`` settings, then Flower's ``run_config``);
2. wait for the nodes and ask each what it holds (a ``query`` message; :mod:`fedhpro.flower.nodes`):
   * partition mode (a named data set): its ``partition-id``; partition ``k`` is
     the simulator's client ``k``, ``clients`` defaults to the nodes' ``num-partitions``;
   * own-data mode (``dataset=clients``): a description of its own folder (name,
     domain, classes, input shape, sizes; no data); nodes are ordered by name, as
     the simulator orders client folders, the class list is resolved over all of
     them (one line naming the nodes when they disagree), and the server builds
     the method's server part from that alone: it holds no data;
3. each round, :class:`~fedhpro.flower.strategy.MethodStrategy` runs the shared round protocol
   (:class:`~fedhpro.engines.protocol.RoundProtocol`: sampling, fault draws,
   validation, drops, skipped rounds) and only moves its messages: one per
   participant, holding the method's broadcast payload; the replies go back to
   the protocol in client order;
4. evaluation: with one global model in partition mode, on the server's test
   sets; otherwise federated: every node tests (the global model, or its
   personal model) on its own test data and the server pools the counts per
   test set (:func:`~fedhpro.engines.evaluation.pool_accuracy`);
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

import dataclasses
import hashlib
import json
import math
import secrets
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from fedhpro.aggregation import claim_cap
from fedhpro.config import PRESENTATION_KEYS, Config
from fedhpro.data.clients import client_notes
from fedhpro.data.feature_statistics import (
    CLIENT,
    FEDERATED,
    feature_ranges,
    resolved_standardize,
    shared_scaling,
    unpacked_scaling,
)
from fedhpro.engines.observers import RoundObserver
from fedhpro.engines.protocol import RoundRecord
from fedhpro.errors import ConfigError, FedHProError
from fedhpro.experiment import EngineRun, RunStart, run_with_engine
from fedhpro.flower import secagg
from fedhpro.flower.engine import ServerSide, build_server_side, config_text, own_data
from fedhpro.flower.nodes import Nodes, _client_keys, discover_nodes, discover_own_data, error_reason
from fedhpro.flower.records import EVAL_RECORD, HEADER, NODE_RECORD, PRIVACY, SERVER_STATE
from fedhpro.flower.settings import FlowerSettings, config_from_run_config
from fedhpro.flower.strategy import FlowerEngine, MethodStrategy, round_timeout, secure_for
from fedhpro.measurements import record_observers
from fedhpro.privacy import is_private
from fedhpro.trained import server_models, write_models

#: what this module's users import from it besides the ServerApp: the message records' names (the ClientApp's too)
__all__ = ["EVAL_RECORD", "HEADER", "NODE_RECORD", "PRIVACY", "SERVER_STATE", "MethodStrategy", "app",
           "make_server_app", "run_server"]


def run_server(grid: Grid, run_config: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> MethodStrategy:
    """Run the experiment that ``base`` + ``run_config`` describe on the nodes of ``grid``; return the strategy.

    With ``resume=<folder>`` it continues the run in that folder from its newest checkpoint instead, with
    that run's config (``fedhpro run``'s rule: keys that would change what it computes are refused).
    """
    config, settings = config_from_run_config(run_config, base)
    folder = config.run.resume or config.run.out
    out = Path(folder) if folder else None
    # the out folder is this ServerApp's until it ends (fedhpro run's rule): a second run on it is refused in
    # one line; claimed before the folder is read, so a resume reads no files a live run is writing, and the
    # config resolved before any node is asked
    build = FlowerRun(grid, settings)
    run_with_engine(config, out, "resume" if config.run.resume else "out", build)
    assert build.strategy is not None, "the builder made the strategy before the rounds"
    return build.strategy


class FlowerRun:
    """The builder (:data:`~fedhpro.experiment.EngineBuilder`) of a run on the nodes of ``grid``: the nodes
    found, then Flower as the engine (:class:`ObservedFlowerEngine`) of the run around the rounds as ``fedhpro
    run`` does it (:func:`fedhpro.experiment.run_with_engine`); at the end the nodes forget the run's client
    state. The strategy it made is kept in :attr:`strategy`."""

    def __init__(self, grid: Grid, settings: FlowerSettings):
        self.grid, self.settings = grid, settings
        self.strategy: MethodStrategy | None = None

    @contextmanager
    def __call__(self, start: RunStart) -> Iterator[EngineRun]:
        engine, built = self._built(start)
        yield built
        forget_client_state(self.grid, engine.strategy, engine.timeout)

    def _built(self, start: RunStart) -> tuple[ObservedFlowerEngine, EngineRun]:
        grid, settings, out = self.grid, self.settings, start.out
        # no progress bars in a server log; a deployment's noise must not be redrawable from the config: the OS's
        # randomness unless the run asks for seeded noise (privacy.secure_noise=false, e.g. to compare with the
        # simulator)
        config = start.config.updated({"progress": False, **(
            {"privacy.secure_noise": True} if is_private(start.config.privacy)
            and start.config.privacy.secure_noise is None else {})})
        if settings.secure_aggregation == "secagg+":
            secagg.check_secure_config(config)  # before any node is asked
        if config.run.unseen_clients > 0 or config.run.unseen_domain is not None:
            raise ConfigError("unseen_clients / unseen_domain are not available on Flower yet (every SuperNode is a "
                              "client that trains); measure unseen clients in simulation (fedhpro run)")
        needs_server_tests = config.run.validation > 0 or config.run.client_test != "shared"
        if needs_server_tests and own_data(config):  # before any node is waited for
            raise ConfigError(SERVER_TESTS_ONLY)
        side, config, nodes, partition, notes = _federation(grid, config, settings)
        if needs_server_tests and side.federated_evaluation:
            raise ConfigError(SERVER_TESTS_ONLY)
        timeout = round_timeout(settings.round_timeout, config, side)  # unset ("auto"): sized from the run's clients
        if settings.round_timeout is None:
            log(INFO, "fedhpro: flower.round-timeout (auto): %.0f s a round", timeout)
        settings = dataclasses.replace(settings, round_timeout=timeout)  # what SecAgg+'s stages wait too
        run = start.run(side.protocol, FlowerEngine.kind)
        known = Nodes(nodes, getattr(nodes, "infos", None), _client_keys(grid, nodes, settings))
        known.strangers.update(getattr(nodes, "strangers", ()))  # refused at discovery: a round does not ask them again
        self.strategy = strategy = MethodStrategy(side, config, known, run_key(config, secrets.token_hex(8)),
                                                  settings.node_auth, secure_for(config, side, settings), run)
        board, tracker = record_observers(config.run, out, ServerLog().warning, config.to_dict()) \
            if out is not None else ([], [])  # TensorBoard and the tracker write into the run folder
        engine = ObservedFlowerEngine(strategy, grid, timeout, partition, board + tracker)
        return engine, EngineRun(engine, run, config, config.run.dataset, partition, notes, ServerLog(),
                                 lambda folder: write_models(folder, server_models(side, partition)))


class ObservedFlowerEngine(FlowerEngine):
    """The Flower engine that shows each round's record to ``observers`` (TensorBoard, the tracker: they only
    read records) and ends them at the run's end, as the simulator does."""

    def __init__(self, strategy: MethodStrategy, grid: Grid, timeout: float, partition: Mapping[str, Any],
                 observers: list[RoundObserver]):
        super().__init__(strategy, grid, timeout, partition)
        self.observers = observers

    def run_round(self, round: int) -> RoundRecord:
        record = super().run_round(round)
        for observer in self.observers:
            observer.on_round_end(record)
        return record

    def end_run(self) -> None:
        super().end_run()
        for observer in self.observers:
            observer.on_run_end()


class ServerLog:
    """The ServerApp's :class:`~fedhpro.engines.printout.Voice`: every line in Flower's log."""

    def note(self, line: str) -> None:
        log(INFO, "fedhpro: note: %s", line)

    def warning(self, line: str) -> None:
        log(WARNING, "fedhpro: %s", line)

    def stopped(self, line: str) -> None:  # privacy.max_epsilon: a normal end, its rows and summary kept
        log(WARNING, "fedhpro: %s", line)

    def printout(self, text: str) -> None:  # the end of the run, as fedhpro run prints it
        for line in text.splitlines():
            log(INFO, "fedhpro: %s", line)


#: validation= or client_test=matched where the nodes evaluate (their own data, or personal models): their
#: replies carry neither validation counts nor matched tests yet; only the ServerApp of partition mode with one
#: global model tests them (as the simulator does)
SERVER_TESTS_ONLY = ("validation= and client_test=matched are not available yet where the Flower nodes evaluate "
                     "(nodes with their own data, or personal models): run them in simulation (fedhpro run), or on "
                     "partitions of a named data set with one global model; or leave validation=0 "
                     "client_test=shared")


def _federation(grid: Grid, config: Config, settings: FlowerSettings
                ) -> tuple[ServerSide, Config, dict[int, int], dict[str, Any], list[str]]:
    """``(server side, config, {client: node id}, partition.json's record, the data's notes)`` of the nodes
    on ``grid``: own data (each node describes its folder) or partitions of a named data set."""

    def warn(message: str) -> None:
        log(WARNING, "fedhpro: %s", message)

    nodes: dict[int, int]  # client index -> node id (own data: a Nodes, which also knows the clients' infos)
    if own_data(config):
        if config.run.data_dir:
            raise ConfigError("dataset=clients on Flower: the server holds no data, so data_dir must not be set in "
                              "the run config; give each SuperNode its own with --node-config \"data-dir=...\"")
        secure = settings.secure_aggregation == "secagg+"
        standardize, scaling_note = resolved_standardize(config.data.standardize, is_private(config.privacy),
                                                         secure, config.data.feature_low is not None)
        config = config.updated({"data.standardize": standardize})  # what the nodes apply (auto resolved)
        nodes, infos, classes = discover_own_data(grid, config, settings)
        config = config.updated({"data.classes": classes})
        scaling, scaling_notes, scaling_record = (secure_node_scaling(grid, config, nodes, infos, settings, warn)
                                                  if secure else
                                                  shared_node_scaling(config, nodes, infos, not settings.roster, warn))
        config = config.updated(scaling)
        standardize = config.data.standardize  # a failed secure sum falls back to each site's own statistics
        side = build_server_side(config, num_classes=len(classes), input_shape=tuple(infos[0].input_shape),
                                 num_samples=[info.train_size for info in infos], on_drop=warn,
                                 sizes_claimed=not settings.roster,  # with a roster the operator vouches for them
                                 # a roster vouches for sizes, not content; under SecAgg+ only the sum is seen
                                 content_claimed=settings.secure_aggregation != "secagg+")
        partition = {"dataset": "clients", "scheme": "given", "engine": "flower", "num_classes": len(classes),
                     "classes": classes,
                     "clients": [{"client": k, "node": nodes[k], **dataclasses.asdict(info)}
                                 for k, info in enumerate(infos)]}
        if infos[0].kind == "tensors":
            partition["standardize"] = standardize
            if standardize == FEDERATED:
                partition["scaling"] = {"mean": config.data.feature_mean, "std": config.data.feature_std,
                                        **scaling_record}
        if nodes.refused:  # the nodes left out at discovery, and why (no key when none: honest runs keep their bytes)
            partition["refused"] = [{"node": node, "reason": why}
                                    for node, why in sorted(nodes.refused.items())[:MAX_REFUSED_RECORDED]]
        notes = [f"clients: {len(infos)} SuperNodes holding their own data ({infos[0].kind}), {len(classes)} classes"]
        notes += ([scaling_note] if scaling_note and infos[0].kind == "tensors" else []) + scaling_notes
        # clients without a test split, what AVG is (weighted by sites where nobody vouches for them), ...
        return side, config, nodes, partition, notes + client_notes(infos, claimed=not settings.roster)
    nodes, clients = discover_nodes(grid, config.run.clients, settings)
    if config.run.clients is None:
        config = config.updated({"clients": clients})
    side = build_server_side(config, on_drop=warn)
    federation = side.federation
    assert federation is not None, "partition mode builds the whole federation"
    if federation.num_clients != clients:
        raise ConfigError(f"the federation has {federation.num_clients} clients but {clients} SuperNodes "
                          f"hold partitions; set clients={federation.num_clients} or run that many SuperNodes")
    return side, config, nodes, federation.partition, list(federation.notes)


def shared_node_scaling(config: Config, nodes: Nodes, infos: list[Any], claimed: bool,
                        warn: Any) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    """``data.standardize=federated`` on nodes holding their own data: ``({data.feature_mean, data.feature_std}
    to set, notes)``, the scaling combined from the feature sums the admitted nodes sent
    (:func:`~fedhpro.data.feature_statistics.shared_scaling`), each counting as its training size, bounded
    as ``aggregation.max_ratio`` / ``max_share`` bound sizes where sizes are ``claimed``. Nothing to set
    where the run gives the scaling already (a resumed run keeps the one it started with; a late node gets
    it), where the mode is another, or where no node holds features to scale (images). The third item is
    partition.json's record of whose sums it pools and whose it left out."""
    data = config.data
    if data.standardize != FEDERATED or data.feature_mean is not None:
        return {}, [], {"given": "the run's config (data.feature_mean, data.feature_std)"}
    for name, why in sorted(nodes.sums_refused.items()):
        warn(f"client {name}'s feature sums are left out of the shared scaling: {why}")
    if not nodes.feature_sums:
        if any(info.kind == "tensors" for info in infos) and nodes.sums_refused:
            raise ConfigError("data.standardize=federated: no node sent feature sums the server could use "
                              f"({len(nodes.sums_refused)} left out, see the warnings); fix those nodes or set "
                              "data.standardize=client")
        return {}, [], {}
    sizes = {name: float(sums.count) for name, sums in nodes.feature_sums.items()}
    weights = sizes
    if claimed:  # a site counts as at most max_ratio median sites and max_share of the total, as in aggregation
        cap = claim_cap([float(info.train_size) for info in infos], config.aggregation.max_share,
                        config.aggregation.max_ratio)
        weights = {name: min(size, cap) for name, size in sizes.items()}
    scaling = shared_scaling(nodes.feature_sums, weights, limit=data.statistics_limit)
    for name, why in sorted(scaling.left_out.items()):
        warn(f"client {name}'s feature sums are left out of the shared scaling: {why}")
    nodes.sums_refused.update(scaling.left_out)
    note = (f"clients: features standardised by one scaling shared by every site (data.standardize=federated): "
            f"the pooled training mean and std of {len(scaling.sites)} sites' feature sums")
    record: dict[str, Any] = {"sites": sorted(nodes.feature_sums.keys() - nodes.sums_refused.keys())}
    if nodes.sums_refused:
        record["left_out"] = dict(sorted(nodes.sums_refused.items()))
    return {"data.feature_mean": scaling.mean.tolist(), "data.feature_std": scaling.std.tolist()}, [note], record


def secure_node_scaling(grid: Grid, config: Config, nodes: Nodes, infos: list[Any], settings: FlowerSettings,
                        warn: Any) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    """``data.standardize=federated`` under SecAgg+: the shared scaling from one SecAgg+ round before
    training (:func:`~fedhpro.flower.secagg.statistics_round`) in which each site adds its sums of features
    clipped to their public ranges (``data.feature_low`` / ``feature_high``), weighed as its training size
    bounded as a claim; the server sees only the total. The sum's quantization leaves each summed entry off
    by less than ``K * 2 r / Q`` of the largest weight (``K`` sites), stated in the note and the record. A
    sum that fails (fewer than 2 sites summed, weights other than those asked for, means outside the
    ranges: one site lied, SecAgg+ hides which) falls back to each site's own statistics with a warning:
    the run goes on."""
    data = config.data
    if data.standardize != FEDERATED or data.feature_mean is not None or infos[0].kind != "tensors":
        return {}, [], {"given": "the run's config (data.feature_mean, data.feature_std)"} \
            if data.feature_mean is not None else {}
    features = int(infos[0].input_shape[0])
    ranges = feature_ranges(data.feature_low, data.feature_high, features)
    assert ranges is not None, "resolved_standardize refuses federated under SecAgg+ without ranges"
    sizes = [float(info.train_size) for info in infos]
    cap = claim_cap(sizes, config.aggregation.max_share, config.aggregation.max_ratio) if not settings.roster \
        else math.inf
    weights = {k: min(size, cap) for k, size in enumerate(sizes) if size > 0}
    secure = settings.secagg
    outcome = secagg.statistics_round(grid, {k: nodes[k] for k in weights}, config_text(config), weights, secure,
                                      features, float(settings.node_wait), error_reason)
    summed = [k for k in weights if nodes[k] in outcome.summed]
    bound = max(weights.values())
    tolerance = len(summed) * secure.step * bound / secure.clipping_range  # in weight units, each entry
    why = None
    if outcome.total is None or len(summed) < 2:
        why = f"SecAgg+ summed {len(summed)} sites ({outcome.halted or 'too few answered'})"
    else:
        total = torch.from_numpy(np.asarray(outcome.total, dtype=np.float64))
        expected = sum(weights[k] for k in summed)
        found = float(total[0]) * bound / secure.clipping_range
        mean, std, _ = unpacked_scaling(total, bound, secure.clipping_range, *ranges, tolerance)
        inside = bool(((mean >= ranges[0] - tolerance) & (mean <= ranges[1] + tolerance)).all())
        if abs(found - expected) > tolerance + 1e-9 * expected or not inside:
            why = (f"the secure sum of clients {', '.join(infos[k].name for k in summed)} is not that of their "
                   f"sites (weights {found:.6g} against {expected:.6g}{'' if inside else ', means outside the ranges'}"
                   "): one or more of them sent it, SecAgg+ hides which")
    if why is not None:
        warn(f"data.standardize=federated: {why}; each site scales by its own statistics instead "
             "(data.standardize=client)")
        return {"data.standardize": CLIENT}, [], {}
    note = (f"clients: features standardised by one scaling shared by every site (data.standardize=federated), "
            f"added up under SecAgg+ from {len(summed)} sites' sums of features clipped to data.feature_low/high; "
            f"quantization leaves each summed entry within {tolerance:.3g} of {bound:g} rows")
    record = {"sites": sorted(infos[k].name for k in summed), "secure": True, "tolerance": tolerance}
    return {"data.feature_mean": mean.tolist(), "data.feature_std": std.tolist()}, [note], record


#: the most refused nodes partition.json names (a flood of nodes must not make it grow without bound)
MAX_REFUSED_RECORDED = 100


def run_key(config: Config, token: str) -> str:
    """The key under which the nodes keep a run's client state: 16 hex digits hashing what the run computes
    (its config without the presentation keys) and ``token``, drawn when the run starts and kept in its
    checkpoints, so that a resumed run finds its state and a new run of the same config starts clean."""
    values = {key: value for key, value in config.to_dict().items() if key not in PRESENTATION_KEYS}
    text = json.dumps(values, sort_keys=True, default=str) + token
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def forget_client_state(grid: Grid, strategy: MethodStrategy, timeout: float) -> None:
    """The run is over: every node deletes the clients' state it kept for it (best effort: a node that does
    not answer keeps it, in ``<state-dir>/<run key>``, until deleted by hand)."""
    if not strategy.run_key:
        return
    query = ConfigRecord({"query": "forget", "state-key": strategy.run_key})
    messages = [Message(RecordDict({HEADER: query}), node, MessageType.QUERY) for node in strategy.nodes.values()]
    for reply in grid.send_and_receive(messages, timeout=min(60.0, timeout)):
        if reply.has_error():
            log(WARNING, "fedhpro: node %d kept this run's client state: %s", reply.metadata.src_node_id,
                reply.error.reason)


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
