"""Fuzzing what nodes send: generated malformed node-query answers, training replies and evaluation replies.

Every generated message goes through the server's validators (and, for a sample of them, the whole
server path: discovery, rejoin, a training round, federated evaluation). None may raise anything but a
one-line fedhpro error (:class:`~fedhpro.errors.FedHProError`) or end in a clean drop, and none may change
the global state of an honest run: a round with one malformed training reply ends with the server state
of the same round without it (every tensor equal), an evaluation with a malformed answer with the accuracy
of the honest answers.

Reproducible: hypothesis with ``derandomize=True`` (the same examples on every run) and no example database;
the counts below make at least 700 messages (``test_enough_messages_were_generated`` checks the total).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from typing import Any

import pytest
import torch

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")
hypothesis = pytest.importorskip("hypothesis")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_flower_limits import NODES, Grid, simulator, strategy_for  # noqa: E402
from test_node_messages import SITES, AnswerGrid, described, own_strategy  # noqa: E402

from fedhpro.config import load_config  # noqa: E402
from fedhpro.data.clients import resolve_classes  # noqa: E402
from fedhpro.errors import FedHProError  # noqa: E402
from fedhpro.flower import records  # noqa: E402
from fedhpro.flower.answers import (  # noqa: E402
    MAX_CLASS_NAME,
    MAX_INPUT_VALUES,
    MAX_NAME,
    MAX_SAMPLES,
    client_info,
    eval_count,
    partition_answer,
)
from fedhpro.flower.records import EVAL_RECORD  # noqa: E402
from fedhpro.runtime import denormals_flushed  # noqa: E402

#: examples per generator: 150 + 200 + 250 + 200 = 800 messages
PARTITIONS, DESCRIPTIONS, TRAINING, EVALUATIONS = 150, 200, 250, 200
MAX_CLASSES = 50  # data.max_classes of the fuzzed own-data run (small: a bound that is easy to cross)
GENERATED: dict[str, int] = {}


def fuzz(examples: int):
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def counted(name: str) -> None:
    GENERATED[name] = GENERATED.get(name, 0) + 1


@pytest.fixture(autouse=True, scope="module")
def _inside_a_run():
    from flwr.supercore.task_identity import TaskIdentity

    flushed = denormals_flushed()  # earlier tests may have flushed denormals (fedhpro.runtime): hypothesis'
    torch.set_flush_denormal(False)  # float draws need them, so the module runs without (and restores it)
    with pytest.MonkeyPatch.context() as patch:  # outside a run, flwr refuses to address a Message
        patch.setattr(TaskIdentity, "_run_id", 1)
        patch.setattr(TaskIdentity, "_node_id", 0)
        patch.setattr(TaskIdentity, "_task_id", 1)
        yield
    torch.set_flush_denormal(flushed)


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    from fedhpro.flower import nodes as server

    monkeypatch.setattr(server, "log", lambda *args: None)


# ----------------------------------------------------------------------------- values a ConfigRecord can hold

SCALARS = st.one_of(st.integers(min_value=-2 ** 63, max_value=2 ** 63 - 1), st.floats(), st.booleans(),
                    st.text(max_size=12), st.binary(max_size=8))
CONFIG_VALUES = st.one_of(SCALARS, st.lists(st.integers(-5, 10 ** 6), max_size=4), st.lists(st.floats(), max_size=3),
                          st.lists(st.text(max_size=4), max_size=3))
JSON = st.recursive(st.none() | st.booleans() | st.integers(-10 ** 12, 10 ** 12) | st.floats() | st.text(max_size=10),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                max_size=4), max_leaves=12)


def config_record(values: dict[str, Any]) -> ConfigRecord | None:
    try:
        return ConfigRecord(values)
    except (TypeError, ValueError):  # a value Flower itself refuses to carry
        return None


# ----------------------------------------------------------------------------- node-query answers


@fuzz(PARTITIONS)
@given(st.dictionaries(st.sampled_from(["partition-id", "num-partitions", "info", "extra"]), CONFIG_VALUES,
                       max_size=4))
def test_partition_answers(values):
    counted("partition answers")
    record = config_record(values)
    try:
        partition, count = partition_answer(record)
    except FedHProError as error:
        assert "\n" not in str(error)
        return
    assert isinstance(partition, int) and isinstance(count, int) and 0 <= partition < count
    assert set(values) == {"partition-id", "num-partitions"}


GOOD = dataclasses.asdict(SITES[9])


@st.composite
def descriptions(draw) -> str:
    """A node's description: valid fields with some replaced by junk, raw junk, or a valid one cut short."""
    how = draw(st.sampled_from(["fields", "fields", "fields", "json", "text", "cut"]))
    if how == "json":
        return json.dumps(draw(JSON))
    if how == "text":
        return draw(st.text(max_size=60))
    values = dict(GOOD)
    for key in draw(st.lists(st.sampled_from([*GOOD, "extra"]), min_size=1, max_size=3, unique=True)):
        if key != "extra" and draw(st.booleans()):
            del values[key]
        else:
            values[key] = draw(st.one_of(
                JSON, st.integers(-10 ** 15, 10 ** 15),
                st.lists(st.integers(-3, MAX_INPUT_VALUES * 2), max_size=6),
                st.lists(st.text(max_size=MAX_CLASS_NAME + 2), max_size=4),
                st.lists(st.just("c"), min_size=MAX_CLASSES + 1, max_size=MAX_CLASSES + 1),
                st.sampled_from(["images", "tensors", "pickle", "../x", "a/b", "\x00", "x" * (MAX_NAME + 1)])))
    text = json.dumps(values)
    return text[:draw(st.integers(0, len(text) - 1))] if how == "cut" else text


@fuzz(DESCRIPTIONS)
@given(descriptions())
def test_descriptions(text):
    counted("descriptions")
    options = load_config({"dataset": "clients", "data.max_classes": MAX_CLASSES}).data
    try:
        info = client_info(ConfigRecord({"info": text}), MAX_CLASSES)
    except FedHProError as error:
        assert "\n" not in str(error)
        return
    # what passed is within every bound, and the class list it leads to is bounded too
    assert info.kind in ("images", "tensors") and 1 <= len(info.name) <= MAX_NAME
    assert 0 <= info.train_size <= MAX_SAMPLES and 0 <= info.test_size <= MAX_SAMPLES
    assert 1 <= len(info.input_shape) and math.prod(info.input_shape) <= MAX_INPUT_VALUES
    assert info.max_label is None or 0 <= info.max_label < MAX_CLASSES
    for names in (info.class_names, info.declared_classes):
        assert names is None or len(names) <= MAX_CLASSES
    try:
        classes = resolve_classes([info], options)
    except FedHProError:
        return
    assert len(classes) <= MAX_CLASSES


@pytest.fixture(scope="module")
def rejoining():
    """An own-data run's strategy (3 sites, no data) whose first site's node is gone."""
    flushed = denormals_flushed()
    try:
        grid = AnswerGrid({node: described(info) for node, info in SITES.items()})
        strategy = own_strategy(grid)
    finally:  # the server side flushes denormals (as fedhpro run does); hypothesis' float draws need them
        torch.set_flush_denormal(flushed)
    grid.offline = {9}
    return strategy, grid


@fuzz(DESCRIPTIONS // 4)
@given(descriptions())
def test_descriptions_at_rejoin(rejoining, text):
    """The whole rejoin path: a new node with a generated description never takes a client (none of them is
    site-a's exact description) and is ignored; the run's map of clients is unchanged."""
    counted("descriptions at rejoin")
    strategy, grid = rejoining
    try:  # a draw that happens to be site-a's exact description would rightly take client 0 back
        hypothesis.assume(client_info(ConfigRecord({"info": text}), MAX_CLASSES) != SITES[9])
    except FedHProError:
        pass
    node = 1000 + GENERATED["descriptions at rejoin"]
    grid.answers[node] = described(text)
    strategy._rejoin(grid)
    assert strategy.nodes == {0: 9, 1: 7, 2: 3} and node in strategy.strangers | set(strategy.waiting)
    del grid.answers[node]


# ----------------------------------------------------------------------------- training replies


@pytest.fixture(scope="module")
def honest():
    """FedProto on 3 tiny clients: the server's state before round 0, each client's honest reply to its
    broadcast, and the state after round 0 without client 1 (the reference of a dropped reply)."""
    sim = simulator("fedproto")
    before = copy.deepcopy(sim.server.state_dict())
    broadcast = sim.server.broadcast(0)
    replies = {}
    for k in range(3):
        replies[k] = sim.client.fit(sim.models.model_for(k), broadcast, sim.federation.clients[k], {},
                                    torch.Generator().manual_seed(k))
    return sim, before, replies


def training_round(sim, before, replies, bad: RecordDict) -> tuple[dict[str, Any], dict[str, Any]]:
    """Round 0 with clients 0 and 2 honest and ``bad`` from client 1: ``(the row, the server's state)``."""
    sim.server.load_state_dict(copy.deepcopy(before))
    strategy = strategy_for(sim, "fedproto")
    grid = Grid(NODES.values())
    answers = []
    for message in strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid):
        k = strategy.partition_of[message.metadata.dst_node_id]
        reply, metrics = replies[k]
        content = bad if k == 1 else RecordDict({**records.encode_payload(reply),
                                                 records.METRICS: records.encode_metrics(metrics)})
        answers.append(Message(content, reply_to=message))
    strategy.aggregate_train(1, answers)
    return strategy.rows[-1] if strategy.rows else {"dropped": strategy._round.dropped}, sim.server.state_dict()


@pytest.fixture(scope="module")
def reference(honest):
    sim, before, replies = honest
    reply, metrics = replies[1]
    refused = RecordDict({**records.encode_payload({**reply, "num_examples": 10 ** 9}),
                          records.METRICS: records.encode_metrics(metrics)})
    row, state = training_round(sim, before, replies, refused)
    assert [item["client"] for item in row["dropped"]] == [1]
    return copy.deepcopy(state)


PAYLOAD_MUTATIONS = ["extra-key", "missing-key", "missing-weight", "weight-dtype", "weight-shape",
                     "weight-nonfinite", "prototype-nonfinite", "counts-value", "counts-dtype", "counts-length",
                     "num-examples", "scalar-as-tensor"]
RECORD_MUTATIONS = ["no-layout", "stray-array", "layout-kind", "npy-bytes", "metrics-list", "stray-scalar"]


@st.composite
def bad_replies(draw, reply: dict[str, Any], metrics: dict[str, float]) -> RecordDict:
    """Client 1's honest reply made invalid in one of the ways above (each one invalid whatever is drawn)."""
    reply = {**reply, "weights": dict(reply["weights"])}
    weights = reply["weights"]
    name = draw(st.sampled_from(sorted(weights)))
    how = draw(st.sampled_from(PAYLOAD_MUTATIONS + RECORD_MUTATIONS))
    counts = reply["class_counts"]
    if how == "extra-key":
        key = draw(st.text("abcxyz_", min_size=1, max_size=8).filter(lambda key: key not in reply))
        reply[key] = draw(st.one_of(st.integers(-5, 5), st.floats(), st.text(max_size=5),
                                    st.builds(torch.randn, st.integers(1, 5))))
    elif how == "missing-key":
        del reply[draw(st.sampled_from(sorted(reply)))]
    elif how == "missing-weight":
        del weights[name]
    elif how == "weight-dtype":
        weights[name] = weights[name].to(draw(st.sampled_from([torch.float64, torch.float16, torch.int32])))
    elif how == "weight-shape":
        shape = list(weights[name].shape) or [1]
        shape[draw(st.integers(0, len(shape) - 1))] += draw(st.sampled_from([-1, 1, 7]))
        weights[name] = torch.zeros([max(size, 0) for size in shape])
    elif how == "weight-nonfinite":
        tensor = weights[name].clone()
        tensor.view(-1)[draw(st.integers(0, tensor.numel() - 1))] = draw(st.sampled_from([math.nan, math.inf,
                                                                                         -math.inf]))
        weights[name] = tensor
    elif how == "prototype-nonfinite":
        held = [c for c in range(len(counts)) if counts[c] > 0]
        prototypes = reply["prototypes"].clone()
        prototypes[draw(st.sampled_from(held)), draw(st.integers(0, prototypes.shape[1] - 1))] = math.nan
        reply["prototypes"] = prototypes
    elif how == "counts-value":
        c = draw(st.integers(0, len(counts) - 1))
        value = draw(st.integers(-10 ** 18, 10 ** 18).filter(lambda v: v != int(counts[c])))
        reply["class_counts"] = counts.clone()
        reply["class_counts"][c] = value
    elif how == "counts-dtype":
        reply["class_counts"] = counts.to(draw(st.sampled_from([torch.float32, torch.float64, torch.int32,
                                                                 torch.bool])))
    elif how == "counts-length":
        size = len(counts) + draw(st.sampled_from([-1, 1, 100]))
        reply["class_counts"] = torch.zeros(max(size, 0), dtype=torch.int64)
    elif how == "num-examples":
        n = reply["num_examples"]
        reply["num_examples"] = draw(st.one_of(st.integers(-2 ** 63, 2 ** 63 - 1).filter(lambda v: v != n),
                                               st.floats(), st.booleans(), st.text(max_size=4)))
    elif how == "scalar-as-tensor":
        reply["num_examples"] = torch.tensor(reply["num_examples"])
    content = RecordDict({**records.encode_payload(reply), records.METRICS: records.encode_metrics(metrics)})
    if how == "no-layout":
        del content[records.LAYOUT]
    elif how == "stray-array":
        content[draw(st.sampled_from(["stray", "weights2", "fedhpro.x"]))] = ArrayRecord(
            {"x": records.to_array(torch.ones(draw(st.integers(1, 50))))})
    elif how == "layout-kind":
        layout = content.config_records[records.LAYOUT]
        layout[draw(st.sampled_from(sorted(layout)))] = draw(st.sampled_from(["scalar", "tensor", "tensors", "x"]))
        if all(layout.get(f"kind.{key}") == kind for key, kind in (("weights", "tensors"), ("prototypes", "tensor"),
                                                                    ("class_counts", "tensor"),
                                                                    ("num_examples", "scalar"))):
            layout["kind.weights"] = "scalar"  # the draw left it as it was: make it wrong
    elif how == "npy-bytes":
        record = content.array_records["weights"]
        array = record[name]
        data = bytearray(array.data)
        cut = draw(st.sampled_from(["magic", "short", "long"]))
        if cut == "magic":
            data[:6] = b"NOTNPY"
        elif cut == "short":
            data = data[:draw(st.integers(0, len(data) - 1))]
        else:  # beyond the longest header NumPy writes (a few trailing bytes np.load would ignore)
            data += bytes(draw(st.integers(1024, 4096)))
        record[name] = Array(dtype=array.dtype, shape=tuple(array.shape), stype=array.stype, data=bytes(data))
    elif how == "metrics-list":
        content[records.METRICS] = MetricRecord({"loss": draw(st.lists(st.floats(-1, 1), min_size=1, max_size=3))})
    elif how == "stray-scalar":
        content.config_records[records.SCALARS][draw(st.sampled_from(["extra", "weights"]))] = 1
    return content


@pytest.mark.slow
@fuzz(TRAINING)
@given(data=st.data())
def test_training_replies(honest, reference, data):
    sim, before, replies = honest
    counted("training replies")
    bad = data.draw(bad_replies(*replies[1]))
    row, state = training_round(sim, before, replies, bad)
    dropped = row["dropped"]
    assert [item["client"] for item in dropped] == [1], dropped
    assert dropped[0]["reason"].startswith("invalid update: ") and "\n" not in dropped[0]["reason"]
    assert state.keys() == reference.keys()
    for key, value in reference.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(state[key], value), key
        elif isinstance(value, dict):
            assert all(torch.equal(state[key][inner], tensor) for inner, tensor in value.items()), key
        else:
            assert state[key] == value, key


# ----------------------------------------------------------------------------- evaluation replies

EXPECTED = ("clinic", 4)


@fuzz(EVALUATIONS)
@given(st.dictionaries(st.sampled_from(["test-set", "correct", "total", "extra"]),
                       st.one_of(CONFIG_VALUES, st.sampled_from(["clinic", "lab", "all", "fake"]),
                                 st.integers(-5, 10)), max_size=4))
def test_evaluation_replies(values):
    counted("evaluation replies")
    record = config_record(values)
    try:
        count = eval_count(record, EXPECTED)
    except FedHProError as error:
        assert "\n" not in str(error)
        return
    assert (count.name, count.total) == EXPECTED and 0 <= count.correct <= count.total
    assert isinstance(count.correct, int) and isinstance(count.total, int)


@fuzz(EVALUATIONS // 4)
@given(st.dictionaries(st.sampled_from(["test-set", "correct", "total"]),
                       st.one_of(st.integers(-5, 10), st.sampled_from(["clinic", "lab", "fake"]), st.floats()),
                       min_size=2, max_size=3))
def test_evaluation_replies_through_the_server(rejoining, values):
    """The whole evaluation path: site-b's answer fuzzed, site-a (3 of 4) and site-c (1 of 4) honest; the
    accuracy is that of the honest answers plus site-b's only if its answer is one it can have."""
    counted("evaluation replies through the server")
    strategy, grid = rejoining
    record = config_record(values)
    strategy._round = strategy.side.protocol.open(0)
    strategy._times, strategy._server_metrics = {"clients": 0.0, "server": 0.0}, {}
    grid.offline = set()
    honest = {9: {"test-set": "clinic", "correct": 3, "total": 4}, 3: {"test-set": "lab", "correct": 1, "total": 4}}
    answers = []
    for message in strategy.configure_evaluate(1, ArrayRecord(), ConfigRecord(), grid):
        node = message.metadata.dst_node_id
        content = (RecordDict({EVAL_RECORD: record}) if node == 7 and record is not None
                   else RecordDict({EVAL_RECORD: ConfigRecord(honest.get(node, {"test-set": "x"}))}))
        answers.append(Message(content, reply_to=message))
    grid.offline = {9}
    strategy.aggregate_evaluate(1, answers)
    row = strategy.rows[-1]
    try:
        valid = record is not None and eval_count(record, EXPECTED)
    except FedHProError:
        valid = None
    clinic = [3, 4] if not valid else [3 + valid.correct, 8]
    assert row["accuracy"]["clinic"] == 100.0 * clinic[0] / clinic[1] and row["accuracy"]["lab"] == 25.0
    assert [item["client"] for item in row.get("not_evaluated", [])] == ([] if valid else [1])


def test_enough_messages_were_generated():
    """Every generator that ran in this session (a tier or ``-k`` may leave some out) made most of the examples it
    asks for (fewer: hypothesis rejected most of what a strategy drew)."""
    if not GENERATED:
        pytest.skip("no fuzzer of this file ran in this session")
    asked = {"partition answers": PARTITIONS, "descriptions": DESCRIPTIONS, "descriptions at rejoin": DESCRIPTIONS // 4,
             "training replies": TRAINING, "evaluation replies": EVALUATIONS,
             "evaluation replies through the server": EVALUATIONS // 4}
    short = {name: (count, asked[name]) for name, count in GENERATED.items() if count < 0.85 * asked[name]}
    assert not short, f"generated, asked: {short}"
    print(f"generated messages: {GENERATED} (total {sum(GENERATED.values())})")
