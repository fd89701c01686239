"""Secure aggregation on Flower (``flower.secure-aggregation=secagg+``): the server learns only sums.

Flower's own SecAgg+ does the cryptography: :func:`flwr.client.mod.secaggplus_mod` on the nodes and
:class:`flwr.server.workflow.SecAggPlusWorkflow` on the server (key agreement, Shamir shares of each
node's mask seeds, pairwise and private masks, recovery of a node that drops out after sharing its
keys). Nothing here encrypts or masks anything; this module only decides *what* is summed and how the
round protocol (:mod:`fedhpro.engines.protocol`) gets the method's replies back from the sum.

What a node sends (:class:`SecureLayout`, one flat float64 vector, the same layout on every node,
built from the method's :meth:`~fedhpro.methods.base.Server.reply_layout`), with ``n_k`` its
``num_examples`` and ``s`` the largest training-set size of the run (the header's ``secagg-scale``,
so every entry stays within ``[-1, 1]`` times the values themselves):

* ``weights/<key>``: ``(n_k / s) * (w_k - w_global)``, its update times its FedAvg weight;
* ``num_examples``: ``n_k / s``;
* with per-class uploads: ``held`` (1 for each class the client holds, else 0), ``class_counts``
  (``n_k^c / s``) and, per class tensor, its rows times ``held`` (a method that averages over the
  holders of a class: FedProto, FedSA, FedHPro's class gradients) or times ``n_k^c / s`` (a count-
  weighted mean: FedHPro's global prototypes, Eq. 4);
* ``metrics``: each training metric times ``n_k / (s M)`` (``M`` = :data:`METRIC_SCALE`: losses may exceed the
  clipping range, and need less precision than weights) in a slot of :data:`METRIC_SLOTS` chosen by a
  hash of its name (the names travel in clear: they say which losses exist, no values).

SecAgg+ quantizes every entry, clipped to ``[-r, r]`` (``flower.secagg-clipping-range``), to an integer
of ``[0, Q]`` (``flower.secagg-quantization-range``) with stochastic rounding, so each entry of the sum
is off by less than ``K * 2r / Q`` for ``K`` summed clients. A node refuses (its reply becomes an
error, the SecAgg+ dropout path) an upload holding a non-finite value or one beyond ``r``: clipping
would change the result without a word. SecAgg+'s own weighting is neutralised (every node says
``num_examples = max_weight = 1``) and the server multiplies the average it returns by ``K``.

What the server rebuilds (:func:`rebuild_replies`): one reply per summed client, all carrying the same
aggregate (the FedAvg weights ``w_global + sum_k (n_k/s) Delta_k / sum_k (n_k/s)``, each class row's
mean), with class counts of 0 and 1 that give every class exactly as many holders as it had
(``round(sum held)``), so the method's own ``aggregate`` (a mean over the holders, a count-weighted
mean divided by the holders, or FedAvg) returns the aggregate: every supported method runs unchanged
and its numbers equal the plain run's up to the quantization. The replies go through
:meth:`~fedhpro.engines.protocol.OpenRound.receive` as any reply does (the protocol still bounds
``num_examples`` and ``class_counts`` and runs the method's checks, now on the aggregate).

Refused (:func:`check_secure_run`, one line each): rules that need each update (``aggregation=median|
trimmed-mean|norm-clip``), injected faults that change one client's reply on the server
(``faults.corrupt|scale|sign_flip``), methods whose server step is not a function of sums (FedTGP trains
on every client's prototypes, FedGMKD weights each client by its own discrepancy; a plug-in method
unless it is plain FedAvg), integer weights (a max, not a sum), and rounds with fewer than 2
participants (a "sum" of one upload is that upload).
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
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
from fedhpro.engines.protocol import capped_reply, counts_problem, examples_problem
from fedhpro.errors import ConfigError, FedHProError, UpdateError
from fedhpro.flower.settings import SecureSettings
from fedhpro.methods.base import ClassRows, Server

#: the values of ``flower.secure-aggregation``
SECURE_AGGREGATION = ("none", "secagg+")
#: how a method averages a class tensor: over the clients that hold the class, or weighted by the counts
HOLDERS, COUNTS = "holders", "counts"
#: the built-in methods with per-class uploads whose server step is a function of sums, by class key
CLASS_WEIGHTING: dict[str, dict[str, str]] = {
    "fedproto": {"prototypes": HOLDERS, "class_gradients": HOLDERS},
    "fedsa": {"prototypes": HOLDERS, "class_gradients": HOLDERS},
    # Eq. 4 (count-weighted, then divided by the holders) for P; Eq. 6 (mean over holders) for the gradients
    "fedhpro": {"prototypes": COUNTS, "class_gradients": HOLDERS, "classifier_weight_gradients": HOLDERS,
                "classifier_bias_gradients": HOLDERS},
}
#: methods whose server step needs every client's own upload, and why
NEEDS_EACH_UPLOAD = {
    "fedtgp": "its server trains the global prototypes on every client's own prototypes",
    "fedgmkd": "its DAT step weights each client by the discrepancy of that client's own soft predictions",
}
#: slots of the training metrics in the summed vector (a metric's slot is a hash of its name)
METRIC_SLOTS = 4096
#: the training metrics are summed divided by this: a loss of up to METRIC_SCALE x clipping range fits, each
#: summed metric is then off by less than K x METRIC_SCALE x 2r/Q (about 4e-4 for 3 clients at the defaults)
METRIC_SCALE = 1024.0
#: the ConfigRecord in a node's masked reply naming its training metrics (names only, no values)
NAMES_RECORD = "fedhpro.secagg"
MAX_METRICS = 256  # metric names a node may name
MAX_METRIC_NAME = 128  # characters of one metric name
#: tolerance, in units of one summed client's quantization error, of the aggregate's whole-number checks
WHOLE_TOLERANCE = 0.25
#: header entries of a SecAgg+ round: the scale s of the summed values, SecAgg+'s clipping range
SCALE, CLIP = "secagg-scale", "secagg-clip"
#: the stream of the seed a node gives SecAgg+'s stochastic rounding (numpy's global generator), so that the
#: same seed and config give the same sums
QUANTIZATION = 0x5EC


# ---------------------------------------------------------------------------- the summed vector


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def metric_slot(name: str) -> int:
    """The slot of the training metric ``name`` (a hash of the name, the same on every node)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") % METRIC_SLOTS


class SecureLayout:
    """The flat vector a node sends under SecAgg+ for one method (see the module doc): its entries, how
    each class tensor is weighted, and :meth:`pack` (node) / :meth:`unpack` (server)."""

    def __init__(self, server: Server, method: str):
        layout = server.reply_layout()
        weights = layout.get("weights", {})
        if not isinstance(weights, Mapping):
            raise ConfigError(f"method={method}: its reply's weights are not a dict of tensors; secure aggregation "
                              "cannot sum them")
        integer = [name for name, (_, dtype) in weights.items() if not torch.empty(0, dtype=dtype).is_floating_point()]
        if integer:
            raise ConfigError(f"flower.secure-aggregation=secagg+: the model's weight '{integer[0]}' is an integer "
                              "counter, which FedAvg aggregates by its maximum, and a secure sum cannot give a "
                              "maximum; use a model without BatchNorm counters or flower.secure-aggregation=none")
        self.weights = {name: tuple(shape) for name, (shape, _) in weights.items()}
        self.weight_dtypes = {name: dtype for name, (_, dtype) in weights.items()}
        rows = {key: entry for key, entry in layout.items() if isinstance(entry, ClassRows)
                and entry.dtype.is_floating_point}
        self.weighting = class_weighting(server, method, layout, rows)
        self.row_forms = {key: (tuple(entry.shape), entry.dtype) for key, entry in rows.items()}
        self.num_classes = int(server.num_classes)
        entries = [Entry(f"weights/{name}", shape) for name, shape in self.weights.items()]
        entries.append(Entry("num_examples", (1,)))
        if rows:
            entries += [Entry("held", (self.num_classes,)), Entry("class_counts", (self.num_classes,))]
            entries += [Entry(f"rows/{key}", tuple(entry.shape)) for key, entry in rows.items()]
        entries.append(Entry("metrics", (METRIC_SLOTS,)))
        self.entries = entries
        self.size = sum(entry.size for entry in entries)

    @property
    def per_class(self) -> bool:
        return bool(self.row_forms)

    def pack(self, reply: Mapping[str, Any], global_weights: Mapping[str, Tensor], metrics: Mapping[str, float],
             num_samples: int, scale: float) -> np.ndarray:
        """The vector of one client's ``reply`` (checked by the caller), its training ``metrics`` and its
        training-set size ``num_samples`` (what the server weights its metrics by); ``scale``: the run's
        largest training-set size."""
        if float(reply["num_examples"]) > scale:  # above the cap the server sent (aggregation.max_share)
            reply = capped_reply(dict(reply), max(1, math.floor(scale)))
        count = float(reply["num_examples"])
        share = count / scale
        parts: list[Tensor] = []
        for name in self.weights:
            delta = reply["weights"][name].detach().cpu().double() - global_weights[name].detach().cpu().double()
            parts.append(share * delta)
        parts.append(torch.tensor([share], dtype=torch.float64))
        if self.per_class:
            counts = reply["class_counts"].detach().cpu().double()
            held = (counts > 0).double()
            parts += [held, counts / scale]
            for key, mode in self.weighting.items():
                row = reply[key].detach().cpu().double()
                factor = (held if mode == HOLDERS else counts / scale).reshape(-1, *([1] * (row.dim() - 1)))
                # rows of classes the client does not hold are ignored by every method: zeros (NaN there too)
                parts.append(torch.where(factor > 0, row * factor, torch.zeros((), dtype=torch.float64)))
        slots = torch.zeros(METRIC_SLOTS, dtype=torch.float64)
        for name, value in metrics.items():
            slots[metric_slot(name)] += float(value) * num_samples / (scale * METRIC_SCALE)
        parts.append(slots)
        return torch.cat([part.reshape(-1) for part in parts]).numpy()

    def unpack(self, vector: np.ndarray) -> dict[str, np.ndarray]:
        """``{entry name: array of its shape}`` of a vector of this layout."""
        if vector.shape != (self.size,):
            raise UpdateError(f"the secure sum has shape {vector.shape}, the layout {self.size} values")
        out, start = {}, 0
        for entry in self.entries:
            out[entry.name] = vector[start:start + entry.size].reshape(entry.shape)
            start += entry.size
        return out


def class_weighting(server: Server, method: str, layout: Mapping[str, Any], rows: Mapping[str, Any]
                    ) -> dict[str, str]:
    """``{class key: HOLDERS | COUNTS}`` of a method whose server step is a function of sums; ConfigError (one
    line, why) for one that needs each client's upload."""
    if method in NEEDS_EACH_UPLOAD:
        raise ConfigError(f"method={method} cannot run under flower.secure-aggregation=secagg+: "
                          f"{NEEDS_EACH_UPLOAD[method]}, and the server learns only the sum of the uploads")
    known = CLASS_WEIGHTING.get(method)
    if known is None:
        plain = (set(layout) <= {"weights", "num_examples"} and type(server).aggregate is Server.aggregate
                 and server.folds_weights)
        if not plain:
            raise ConfigError(f"method={method} cannot run under flower.secure-aggregation=secagg+: only FedAvg-like "
                              "methods (weights and num_examples, the base Server.aggregate) and the built-in "
                              f"{', '.join(sorted(CLASS_WEIGHTING))} are known to need nothing but sums")
        return {}
    unknown = sorted(set(layout) - {"weights", "num_examples", "class_counts"} - set(known))
    if unknown or (rows and "class_counts" not in layout):
        what = f"'{unknown[0]}'" if unknown else "no class_counts"
        raise ConfigError(f"method={method}: its reply holds {what}, which secure aggregation does not know how "
                          "to sum; use flower.secure-aggregation=none")
    return {key: known[key] for key in rows}


def check_secure_config(config: Any) -> None:
    """ConfigError (one line, why) for a config secure aggregation cannot run, from the config alone (before
    any node is asked): a robust rule, a fault injected into one client's reply, a method needing each upload."""
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
    if getattr(config.privacy, "mode", "none") == "client":
        raise ConfigError("privacy=client cannot go with flower.secure-aggregation=secagg+ yet: the round protocol "
                          "checks and sums each privatized upload itself; use one of them")
    method = config.run.method
    if method in NEEDS_EACH_UPLOAD:
        raise ConfigError(f"method={method} cannot run under flower.secure-aggregation=secagg+: "
                          f"{NEEDS_EACH_UPLOAD[method]}, and the server learns only the sum of the uploads")


def check_secure_run(config: Any, server: Server, participants: int, settings: SecureSettings) -> SecureLayout:
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


# ---------------------------------------------------------------------------- the replies rebuilt from the sum


def _whole(values: np.ndarray, what: str, tolerance: float) -> np.ndarray:
    """``values`` rounded to whole numbers; UpdateError unless each is within ``tolerance`` of one."""
    rounded = np.rint(values)
    if values.size and float(np.abs(values - rounded).max()) > tolerance:
        raise UpdateError(f"the secure sum's {what} are not whole numbers (off by up to "
                          f"{float(np.abs(values - rounded).max()):.3g}): a node sent values it cannot hold")
    return rounded.astype(np.int64)


def holder_counts(holders: Sequence[int], capacity: Sequence[int]) -> np.ndarray:
    """A ``K x C`` matrix of 0 and 1 with exactly ``holders[c]`` ones in column ``c``, at least one and at
    most ``capacity[k]`` in row ``k``: the class counts of the rebuilt replies (each reply's num_examples is
    its row's sum). Classes go, most held first, to the rows with no class yet, then with the most room.
    UpdateError when none is found (the holders cannot come from these clients)."""
    rows, classes = len(capacity), len(holders)
    matrix = np.zeros((rows, classes), dtype=np.int64)
    degree = np.zeros(rows, dtype=np.int64)
    for c in sorted(range(classes), key=lambda c: (-holders[c], c)):
        room = [k for k in range(rows) if degree[k] < capacity[k]]
        room.sort(key=lambda k: (degree[k] > 0, -(capacity[k] - degree[k]), k))
        if len(room) < holders[c]:
            raise UpdateError(f"the secure sum says {holders[c]} clients hold class {c}, more than can")
        for k in room[:holders[c]]:
            matrix[k, c] = 1
            degree[k] += 1
    if rows and int(degree.min()) == 0:
        raise UpdateError("the secure sum leaves a summed client without any class")
    return matrix


def rebuild_replies(layout: SecureLayout, total: np.ndarray, global_weights: Mapping[str, Tensor],
                    num_samples: Sequence[int], scale: float, step: float, metric_names: Sequence[str]
                    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """``(one reply per summed client, the training metrics)`` from the secure sum ``total`` of the clients
    with ``num_samples`` training samples (in client order): every reply carries the aggregate (see the
    module doc), so the method's own aggregation returns it. UpdateError when the sum cannot come from
    honest clients of these sizes (the checks that hold on a sum: whole counts and holders, at most the
    clients' samples, counts adding up to num_examples)."""
    parts = layout.unpack(total)
    summed = len(num_samples)
    # each summed entry is off by less than `summed` quantization steps; whole numbers are checked in units of s
    tolerance = WHOLE_TOLERANCE + summed * step * scale
    examples = float(parts["num_examples"][0]) * scale
    total_examples = int(_whole(np.array([examples]), "num_examples", tolerance)[0])
    if not summed <= total_examples <= sum(num_samples):
        raise UpdateError(f"the secure sum's num_examples is {total_examples}, but the {summed} summed clients hold "
                          f"{sum(num_samples)} training samples together")
    share = examples / scale  # sum_k n_k / s, the FedAvg denominator
    weights = {}
    for name in layout.weights:
        delta = torch.from_numpy(np.ascontiguousarray(parts[f"weights/{name}"])) / share
        base = global_weights[name].detach().cpu()
        weights[name] = (base.double() + delta).to(layout.weight_dtypes[name])
    if not layout.per_class:
        replies = [{"weights": weights, "num_examples": int(n)} for n in num_samples]
    else:
        holders = _whole(parts["held"], "class holders", WHOLE_TOLERANCE + summed * step)
        counts = _whole(parts["class_counts"] * scale, "class counts", tolerance)
        if bool((holders < 0).any()) or bool((holders > summed).any()) or bool((counts < holders).any()):
            raise UpdateError("the secure sum's class holders and counts do not fit together")
        if int(counts.sum()) != total_examples:
            raise UpdateError(f"the secure sum's class counts add up to {int(counts.sum())}, its num_examples to "
                              f"{total_examples}")
        matrix = holder_counts(holders.tolist(), list(num_samples))
        rows: dict[str, Tensor] = {}
        for key, mode in layout.weighting.items():
            shape, dtype = layout.row_forms[key]
            # holder-mean: sum of held rows / holders; count-weighted: sum of (n_k^c/s) rows / sum of n_k^c/s (a
            # method dividing that by the holders, Eq. 4, gets it right: the rebuilt replies have as many holders)
            denominator = holders.astype(np.float64) if mode == HOLDERS else parts["class_counts"]
            denominator = np.where(holders > 0, denominator, 1.0).reshape(-1, *([1] * (len(shape) - 1)))
            means = np.where((holders > 0).reshape(denominator.shape), parts[f"rows/{key}"] / denominator, 0.0)
            rows[key] = torch.from_numpy(np.ascontiguousarray(means)).to(dtype)
        replies = []
        for k in range(summed):
            reply: dict[str, Any] = {"weights": dict(weights), "num_examples": int(matrix[k].sum()),
                                     "class_counts": torch.from_numpy(matrix[k].copy())}
            for key, mean in rows.items():
                held = torch.from_numpy(matrix[k] > 0).reshape(-1, *([1] * (mean.dim() - 1)))
                reply[key] = torch.where(held, mean, torch.zeros((), dtype=mean.dtype))
            replies.append(reply)
    slots: dict[int, str] = {}
    for name in sorted(set(metric_names)):
        slot = metric_slot(name)
        if slot in slots:
            raise FedHProError(f"the training metrics '{slots[slot]}' and '{name}' share a slot of the secure sum; "
                               "rename one of them")
        slots[slot] = name
    factor = scale * METRIC_SCALE / float(sum(num_samples))
    metrics = {name: float(parts["metrics"][slot]) * factor for slot, name in sorted(slots.items(), key=lambda i: i[1])}
    return replies, metrics
