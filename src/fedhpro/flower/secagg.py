"""Secure aggregation on Flower (``flower.secure-aggregation=secagg+``): the server learns only sums.

Flower's own SecAgg+ does the cryptography: :func:`flwr.client.mod.secaggplus_mod` on the nodes and
:class:`flwr.server.workflow.SecAggPlusWorkflow` on the server (key agreement, Shamir shares of each
node's mask seeds, pairwise and private masks, recovery of a node that drops out after sharing its
keys). Nothing here encrypts or masks anything; this module runs it (:func:`node_mod`, :func:`run_round`)
and checks what the nodes send at each stage, and :mod:`fedhpro.flower.secure_sum` decides *what* is
summed and how the round protocol (:mod:`fedhpro.engines.protocol`) gets the method's replies back from
the sum.

SecAgg+ quantizes every entry, clipped to ``[-r, r]`` (``flower.secagg-clipping-range``), to an integer
of ``[0, Q]`` (``flower.secagg-quantization-range``) with stochastic rounding, so each entry of the sum
is off by less than ``K * 2r / Q`` for ``K`` summed clients. A node refuses (its reply becomes an
error, the SecAgg+ dropout path) an upload holding a non-finite value or one beyond ``r``: clipping
would change the result without a word. SecAgg+'s own weighting is neutralised (every node says
``num_examples = max_weight = 1``) and the server multiplies the average it returns by ``K``.

Refused (:func:`check_secure_run`, one line each): rules that need each update (``aggregation=median|
trimmed-mean|norm-clip``), injected faults that change one client's reply on the server
(``faults.corrupt|scale|sign_flip``), a method whose server step is not a function of sums (it says why
in its :attr:`MethodSpec.needs_each_upload <fedhpro.methods.base.MethodSpec.needs_each_upload>`, or its
reply layout does not declare how its class tensors are averaged: :func:`~fedhpro.flower.secure_sum.summed_rows`),
integer weights (a max, not a sum), and rounds with fewer than 2 participants (a "sum" of one upload is
that upload).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import (
    Code,
    FitIns,
    FitRes,
    Parameters,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy as LegacyStrategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid
from torch import Tensor

from fedhpro.aggregation import AGGREGATION_RULES
from fedhpro.config import Config
from fedhpro.engines.replies import counts_problem, examples_problem
from fedhpro.errors import ConfigError, FedHProError, UpdateError
from fedhpro.flower.records import HEADER
from fedhpro.flower.secure_sum import METRIC_SCALE, SecureLayout, holder_counts, rebuild_replies
from fedhpro.flower.settings import SecureSettings
from fedhpro.methods import declared_method
from fedhpro.methods.base import Server
from fedhpro.privacy import client_level

#: the summed vector's layout and the replies rebuilt from the sum (fedhpro.flower.secure_sum), as the ClientApp
#: and the strategy use them from here
__all__ = ["METRIC_SCALE", "SecureLayout", "check_secure_config", "check_secure_run", "client_content",
           "client_vector", "holder_counts", "node_mod", "rebuild_replies", "run_round", "statistics_round"]

#: the ConfigRecord in a node's masked reply naming its training metrics (names only, no values)
NAMES_RECORD = "fedhpro.secagg"
MAX_METRICS = 256  # metric names a node may name
MAX_METRIC_NAME = 128  # characters of one metric name
#: header entries of a SecAgg+ round: the scale s of the summed values, SecAgg+'s clipping range
SCALE, CLIP = "secagg-scale", "secagg-clip"
#: header entries of a SecAgg+ round of feature statistics (data.standardize=federated): the largest weight a
#: site counts as (the packing's bound) and the asked site's own weight
STATISTICS, WEIGHT = "secagg-statistics", "secagg-weight"
#: the stream of the seed a node gives SecAgg+'s stochastic rounding (numpy's global generator), so that the
#: same seed and config give the same sums
QUANTIZATION = 0x5EC


# ---------------------------------------------------------------------------- what cannot be summed


def check_secure_config(config: Config) -> None:
    """ConfigError (one line, why) for a config secure aggregation cannot run, from the config alone (before
    any node is asked): a robust rule, a fault injected into one client's reply, a method that says its server
    needs each client's own upload (its ``MethodSpec.needs_each_upload``, quoted)."""
    rule = config.aggregation.rule
    if AGGREGATION_RULES.get(rule):
        raise ConfigError(f"aggregation={rule} needs {AGGREGATION_RULES[rule]} of each client's update, which "
                          "flower.secure-aggregation=secagg+ hides from the server (it sees only the sum); use "
                          "aggregation=mean or flower.secure-aggregation=none")
    faults = config.faults
    for name in ("corrupt", "scale", "sign_flip"):
        if float(getattr(faults, name, 0.0)) > 0:
            raise ConfigError(f"faults.{name} changes one client's reply on the server, which never sees one "
                              "under flower.secure-aggregation=secagg+; set it to 0 (faults.dropout works)")
    if client_level(config.privacy):
        raise ConfigError("privacy=client cannot go with flower.secure-aggregation=secagg+ yet: the round protocol "
                          "checks and sums each privatized upload itself; use one of them")
    method = config.run.method
    reason = declared_method(method).needs_each_upload  # the method's own declaration
    if reason:
        raise ConfigError(f"method={method} cannot run under flower.secure-aggregation=secagg+: {reason}, and the "
                          "server learns only the sum of the uploads")


def check_secure_run(config: Config, server: Server, participants: int, settings: SecureSettings) -> SecureLayout:
    """The run's :class:`SecureLayout`, or a one-line ConfigError naming what secure aggregation cannot do
    (:func:`check_secure_config`, then what needs the method's server part and the round's size)."""
    check_secure_config(config)
    if participants < 2:
        raise ConfigError(f"flower.secure-aggregation=secagg+ needs at least 2 participants per round, this run has "
                          f"{participants} (participation x clients): the sum of one upload is that upload")
    modulus = settings.modulus(participants)
    if participants * modulus >= 2 ** 63:
        raise ConfigError(f"{participants} participants with flower.secagg-quantization-range="
                          f"{settings.quantization_range} overflow SecAgg+'s 64-bit sums; lower the range")
    return SecureLayout(server, config.run.method)


# ---------------------------------------------------------------------------- node side


def client_vector(layout: SecureLayout, server: Server, reply: Mapping[str, Any], global_weights: Mapping[str, Tensor],
                  metrics: Mapping[str, float], num_samples: int, scale: float, clipping_range: float) -> np.ndarray:
    """What a node sends: its reply checked as the server would check it (the server cannot: it never sees
    it), packed (:meth:`SecureLayout.pack`) and refused beyond ``[-clipping_range, clipping_range]``
    (UpdateError naming the entry: SecAgg+ would clip it without a word)."""
    problem = examples_problem(reply, -1, num_samples) or counts_problem(reply, layout.num_classes
                                                                         if layout.per_class else None)
    if problem is not None:
        raise UpdateError(problem.replace("client -1", "this client"))
    server.validate_reply(dict(reply), who="this client's reply")
    vector = layout.pack(reply, global_weights, metrics, num_samples, scale)
    outside = ~(np.abs(vector) <= clipping_range)  # NaN counts as outside
    if outside.any():
        index = int(np.argmax(outside))
        start = 0
        for entry in layout.entries:
            if index < start + entry.size:
                break
            start += entry.size
        raise UpdateError(f"secure aggregation: '{entry.name}' holds {vector[index]:.6g}, outside "
                          f"flower.secagg-clipping-range={clipping_range:g}; raise it (each summed value is then "
                          "quantized more coarsely) or lower lr")
    return vector


def client_content(vector: np.ndarray, metric_names: Sequence[str]) -> RecordDict:
    """The reply content ``secaggplus_mod`` expects (a legacy FitRes: the vector as its one array,
    ``num_examples = 1``, so SecAgg+'s weighting is neutral) plus the metric names (no values)."""
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([vector]), 1, {})
    content = compat.fitres_to_recorddict(fitres, keep_input=True)
    content.config_records[NAMES_RECORD] = ConfigRecord({"metric-names": sorted(metric_names)})
    return content


class NodeFailed(FedHProError):
    """The node's own handler failed inside SecAgg+: raised so that Flower answers with an error reply."""


def node_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """The ClientApp's train mod: a message of a SecAgg+ round goes through Flower's ``secaggplus_mod``
    (which calls the train handler in its collect stage); every other message passes unchanged. A
    handler that fails there raises, so the node answers with an error and SecAgg+ treats it as dropped."""
    if msg.metadata.message_type != MessageType.TRAIN or RECORD_KEY_CONFIGS not in msg.content.config_records:
        return call_next(msg, context)

    def handler(inner: Message, inner_context: Context) -> Message:
        out = call_next(inner, inner_context)
        if out.has_error():
            raise NodeFailed(out.error.reason)
        return out

    return secaggplus_mod(msg, context, handler)


# ---------------------------------------------------------------------------- server side


@dataclass
class SecureOutcome:
    """One SecAgg+ round: the summed vector of ``summed`` (node ids), why the others dropped, and the metric
    names the summed nodes reported."""

    summed: list[int] = field(default_factory=list)
    total: np.ndarray | None = None
    failures: dict[int, str] = field(default_factory=dict)
    metric_names: dict[int, list[str]] = field(default_factory=dict)
    halted: str | None = None  # the stage where SecAgg+ stopped (too few nodes left), None: it finished


class _SumStrategy(LegacyStrategy):
    """The legacy Strategy ``SecAggPlusWorkflow`` calls: it asks the given nodes and keeps the sum it gets."""

    def __init__(self, nodes: Sequence[int], grid: Grid):
        self.nodes, self.grid = list(nodes), grid
        self.summed: list[int] = []
        self.total: np.ndarray | None = None

    def initialize_parameters(self, client_manager):
        return None

    def configure_fit(self, server_round, parameters, client_manager):
        # the contents are fedhpro's own messages, put in place by SecureWorkflow.setup_stage
        return [(GridClientProxy(node, self.grid, 0), FitIns(Parameters([], ""), {})) for node in self.nodes]

    def aggregate_fit(self, server_round, results, failures):
        self.summed = [int(proxy.node_id) for proxy, _ in results]
        if results:
            # SecAgg+ returns the average over the summed nodes (each weighted 1): times their number, the sum
            average = parameters_to_ndarrays(results[0][1].parameters)
            self.total = np.asarray(average[0], dtype=np.float64) * len(results)
        return None, {}

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


class SecureWorkflow(SecAggPlusWorkflow):
    """Flower's SecAgg+ workflow, sending fedhpro's own message to each node in its collect stage (the round's
    payload and the node's header) instead of a legacy FitIns; the protocol itself is Flower's."""

    def __init__(self, contents: Mapping[int, RecordDict], settings: SecureSettings, participants: int,
                 timeout: float):
        super().__init__(num_shares=float(settings.shares), reconstruction_threshold=float(settings.threshold),
                         max_weight=1.0, clipping_range=float(settings.clipping_range),
                         quantization_range=int(settings.quantization_range),
                         modulus_range=settings.modulus(participants), timeout=timeout)
        self.contents = contents
        self.stage = Stage.SETUP

    def setup_stage(self, grid, context, state):
        going = super().setup_stage(grid, context, state)
        for node in list(state.nid_to_fitins):
            state.nid_to_fitins[node] = self.contents[node]
        return going

    def share_keys_stage(self, grid, context, state):
        self.stage = Stage.SHARE_KEYS
        return super().share_keys_stage(grid, context, state)

    def collect_masked_vectors_stage(self, grid, context, state):
        self.stage = Stage.COLLECT_MASKED_VECTORS
        return super().collect_masked_vectors_stage(grid, context, state)

    def unmask_stage(self, grid, context, state):
        self.stage = Stage.UNMASK
        return super().unmask_stage(grid, context, state)


class CheckingGrid:
    """The grid as SecAgg+ uses it, checking each node's reply before the workflow reads it: a reply that
    does not hold what its stage must hold (keys, shares, a masked vector of the layout's size, valid metric
    names) becomes an error reply, which SecAgg+ treats as a dropped node. Records why each node failed."""

    def __init__(self, grid: Grid, size: int, describe_error: Callable[[Error], str]):
        self.grid, self.size, self.describe_error = grid, size, describe_error
        self.failures: dict[int, str] = {}
        self.metric_names: dict[int, list[str]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)

    def send_and_receive(self, messages, timeout=None):
        messages = list(messages)
        stages = {str(m.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]) for m in messages}
        stage = stages.pop() if len(stages) == 1 else "?"
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        by_node = {}
        for reply in replies:
            by_node.setdefault(int(reply.metadata.src_node_id), reply)
        checked = []
        for message in messages:
            node = int(message.metadata.dst_node_id)
            reply = by_node.get(node)
            if reply is None:
                self.failures.setdefault(node, f"no reply in SecAgg+ stage {stage} before flower.round-timeout")
                continue
            if reply.has_error():
                self.failures.setdefault(node, f"SecAgg+ stage {stage}: {self.describe_error(reply.error)}")
                checked.append(reply)
                continue
            problem = self._problem(stage, node, reply)
            if problem is not None:
                self.failures.setdefault(node, f"invalid SecAgg+ reply in stage {stage}: {problem}")
                checked.append(Message(Error(code=ErrorCode.UNKNOWN, reason=problem), reply_to=message))
            else:
                checked.append(reply)
        return checked

    def _problem(self, stage: str, node: int, reply: Message) -> str | None:
        record = reply.content.config_records.get(RECORD_KEY_CONFIGS)
        if record is None:
            return f"no '{RECORD_KEY_CONFIGS}' record"
        if stage == Stage.SETUP:
            return _typed(record, {Key.PUBLIC_KEY_1: bytes, Key.PUBLIC_KEY_2: bytes})
        if stage == Stage.SHARE_KEYS:
            return _typed(record, {Key.DESTINATION_LIST: [int], Key.CIPHERTEXT_LIST: [bytes]}, same_length=True)
        if stage == Stage.UNMASK:
            return _typed(record, {Key.NODE_ID_LIST: [int], Key.SHARE_LIST: [bytes]}, same_length=True)
        if stage != Stage.COLLECT_MASKED_VECTORS:
            return None
        problem = _typed(record, {Key.MASKED_PARAMETERS: [bytes]})
        if problem is not None:
            return problem
        masked = cast(list[bytes], record[Key.MASKED_PARAMETERS])
        if len(masked) != 2:
            return f"{len(masked)} masked arrays, not 2 (SecAgg+'s weight and the vector)"
        for data, shape in zip(masked, ((1,), (self.size,)), strict=True):
            problem = _masked_problem(data, shape)
            if problem is not None:
                return problem
        names = reply.content.config_records.get(NAMES_RECORD)
        values = None if names is None else names.get("metric-names")
        if (not isinstance(values, list) or len(values) > MAX_METRICS
                or not all(isinstance(v, str) and 0 < len(v) <= MAX_METRIC_NAME for v in values)):
            return f"'{NAMES_RECORD}' does not name at most {MAX_METRICS} training metrics"
        self.metric_names[node] = [str(value) for value in values]
        return None


def _typed(record: ConfigRecord, forms: Mapping[str, Any], same_length: bool = False) -> str | None:
    """Why ``record`` does not hold ``forms`` (``{key: type}`` or ``{key: [element type]}``), or None."""
    lengths = set()
    for key, form in forms.items():
        value = record.get(key)
        if isinstance(form, list):
            if not isinstance(value, list) or not all(type(v) is form[0] for v in value):
                return f"'{key}' is not a list of {form[0].__name__}"
            lengths.add(len(value))
        elif type(value) is not form:
            return f"'{key}' is not {form.__name__}"
    if same_length and len(lengths) > 1:
        return f"{' and '.join(forms)} differ in length"
    return None


def _masked_problem(data: bytes, shape: tuple[int, ...]) -> str | None:
    """Why ``data`` is not an integer ``.npy`` array of ``shape`` (only its header is read), or None."""
    try:
        handle = io.BytesIO(data)
        version = np.lib.format.read_magic(handle)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        found, _, dtype = read_header(handle)
    except (ValueError, OSError, EOFError, TypeError) as error:
        return f"a masked array is not a .npy array ({type(error).__name__})"
    if tuple(found) != shape or dtype.kind not in "iu" or dtype.hasobject:
        return f"a masked array is {dtype} {tuple(found)}, not integers of shape {shape}"
    if len(data) - handle.tell() != math.prod(shape) * dtype.itemsize:
        return "a masked array's bytes do not match its shape"
    return None


def run_round(grid: Grid, round: int, contents: Mapping[int, RecordDict], settings: SecureSettings, size: int,
              timeout: float, describe_error: Callable[[Error], str]) -> SecureOutcome:
    """One training round's uploads summed by Flower's SecAgg+ over the nodes of ``contents`` (node id ->
    its message content: the round's payload and its header)."""
    nodes = sorted(contents)
    checking = CheckingGrid(grid, size, describe_error)
    strategy = _SumStrategy(nodes, grid)
    state = RecordDict({MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: round}),
                        MAIN_PARAMS_RECORD: ArrayRecord()})
    context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=state, run_config={}),
                            strategy=strategy, client_manager=SimpleClientManager())
    workflow = SecureWorkflow(contents, settings, len(nodes), timeout)
    workflow(cast(Grid, checking), context)
    outcome = SecureOutcome(summed=sorted(strategy.summed), total=strategy.total,
                            failures={node: why for node, why in checking.failures.items()
                                      if node not in strategy.summed},
                            metric_names={node: checking.metric_names.get(node, []) for node in strategy.summed})
    if strategy.total is None:
        outcome.halted = str(workflow.stage)
        outcome.summed, outcome.total = [], None
    return outcome



def statistics_round(grid: Grid, nodes: Mapping[int, int], config_json: str, weights: Mapping[int, float],
                     settings: SecureSettings, features: int, timeout: float,
                     describe_error: Callable[[Error], str]) -> SecureOutcome:
    """One SecAgg+ round before training that adds up the sites' feature statistics
    (``data.standardize=federated`` under SecAgg+): client ``k`` (node ``nodes[k]``) packs its range sums
    weighed as ``weights[k]`` (:func:`~fedhpro.data.feature_statistics.packed_sums`), and the server sees
    only their total (``2 * features + 1`` values)."""
    bound = max(weights.values())
    contents = {node: RecordDict({HEADER: ConfigRecord({
        "client": k, "config": config_json, "num-clients": len(nodes), "round": 0,
        STATISTICS: float(bound), WEIGHT: float(weights[k]), CLIP: settings.clipping_range})})
        for k, node in nodes.items()}
    return run_round(grid, 0, contents, settings, 2 * features + 1, timeout, describe_error)
