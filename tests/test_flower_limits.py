"""Message limits on Flower: a reply that does not fit the method's declared layout is refused before
any of its arrays is decoded, and the round goes on with the other replies.

References: the layouts are checked against what each method's client really sends in a tiny run
(keys, shapes and dtypes read off the reply's tensors); the ``.npy`` size bounds against the bytes
``np.save`` writes; a round with one tampered reply against the hand-computed FedAvg of the others.
Replies are built as a SuperNode builds them (:func:`records.encode_payload` of a real ``fit``),
then tampered with, and handed to :class:`MethodStrategy` as a Grid would.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

from conftest import TinyBNNet, TinyNet, make_federation  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict  # noqa: E402

from fedhpro.config import load_config  # noqa: E402
from fedhpro.engines.simulator import Simulator  # noqa: E402
from fedhpro.errors import UpdateError  # noqa: E402
from fedhpro.flower import records  # noqa: E402
from fedhpro.flower.engine import ServerSide  # noqa: E402
from fedhpro.flower.strategy import MethodStrategy  # noqa: E402
from fedhpro.methods import BUILTIN_METHODS, Client, MethodContext, Server, TrainSettings  # noqa: E402
from fedhpro.methods.base import clone_weights, load_weights  # noqa: E402

TRAIN = TrainSettings(epochs=1, batch_size=8, lr=0.05)
SIZES = [12, 10, 8]


def simulator(name: str, *, shared: str | None = None, model=TinyNet, **options: Any) -> Simulator:
    """A tiny run of method ``name`` (3 clients, d=16, 4 classes) that evaluates only in its last round."""
    spec = BUILTIN_METHODS[name]
    opts = dataclasses.replace(spec.options(), **options)
    factory = model if spec.model_wrapper is None else (lambda: spec.model_wrapper(model(), opts, 4))
    return Simulator(spec, opts, make_federation(SIZES), factory, TRAIN, rounds=3, eval_every=10, shared=shared)


# ----------------------------------------------------------------------------
# declarations: every method's layout is what its client sends
# ----------------------------------------------------------------------------

#: every built-in method with its main option variants (the reply keys differ between them)
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("fedavg", {}), ("fedavg", {"model": TinyBNNet}), ("fedavg", {"shared": "classifier"}),
    ("fedprox", {}), ("moon", {}), ("fedrcl", {}),
    ("fedhpro", {}), ("fedhpro", {"prototypes": "global"}), ("fedhpro", {"gradient_timing": "before"}),
    *[(name, variant) for name in ("fedproto", "fedtgp", "fedgmkd", "fedsa")
      for variant in ({}, {"prototypes": "hyper"}, {"shared": "none", "protocol": "proto-only"})],
    ("fedproto", {"shared": "classifier"}),
]
if "classifier_step" in {field.name for field in dataclasses.fields(BUILTIN_METHODS["fedhpro"].options)}:
    VARIANTS.append(("fedhpro", {"classifier_step": "synthetic"}))  # uploads the classifier's gradients too


def described(value: Any) -> Any:
    """A reply entry as a layout entry, read off the value itself: the reference the declarations must equal."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    if isinstance(value, dict):
        return {name: described(tensor) for name, tensor in value.items()}
    return type(value)


def sent_replies(sim: Simulator, rounds: int = 2) -> list[dict[str, Any]]:
    """Every reply the clients of ``sim`` produce in its first ``rounds`` rounds."""
    replies = []
    fit = sim.client.fit

    def spy(*args, **kwargs):
        reply, metrics = fit(*args, **kwargs)
        replies.append(reply)
        return reply, metrics

    sim.client.fit = spy
    for round in range(rounds):
        sim.run_round(round)
    return replies


def test_every_builtin_method_is_covered_by_the_layout_variants():
    assert {name for name, _ in VARIANTS} == set(BUILTIN_METHODS)


def variant_id(name: str, variant: dict[str, Any]) -> str:
    return "-".join([name, *(getattr(v, "__name__", str(v)) for v in variant.values())] or [name])


@pytest.mark.parametrize("name, variant", VARIANTS, ids=[variant_id(n, v) for n, v in VARIANTS])
def test_declared_reply_layout_is_exactly_what_the_client_sends(name, variant):
    sim = simulator(name, **variant)
    replies = sent_replies(sim)
    assert len(replies) == 2 * len(SIZES) and all(row.dropped == [] for row in sim.history)
    layout = sim.server.reply_layout()
    for reply in replies:
        assert described(reply) == layout
        records.check_layout(RecordDict(records.encode_payload(reply)), layout)  # and the wire check accepts it


# ----------------------------------------------------------------------------
# the wire check (records) on its own
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fedproto_reply():
    """``(reply, layout)``: a real FedProto reply (weights, num_examples, prototypes, class_counts)."""
    sim = simulator("fedproto")
    return sent_replies(sim, rounds=1)[0], sim.server.reply_layout()


def encoded(reply: dict[str, Any]) -> RecordDict:
    return RecordDict(records.encode_payload(reply))


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def with_array(content: RecordDict, record: str, name: str, array: Array) -> RecordDict:
    """``content`` with ``array`` in place of ``record[name]`` (a sender that lies in its metadata)."""
    arrays = dict(content.array_records[record].items())
    arrays[name] = array
    content[record] = ArrayRecord(arrays)
    return content


def refused(content: RecordDict, layout, monkeypatch) -> str:
    """The one-line reason ``decode_payload`` refuses ``content`` with, having decoded none of its arrays."""
    decoded = []
    real_load = np.load
    monkeypatch.setattr(records, "_tensor", lambda *a, **k: decoded.append(a) or pytest.fail("an array was decoded"))
    monkeypatch.setattr(np, "load", lambda *a, **k: decoded.append(a) or real_load(*a, **k))
    with pytest.raises(UpdateError) as error:
        records.decode_payload(content, expected=layout)
    monkeypatch.undo()
    assert decoded == []
    reason = str(error.value)
    assert "\n" not in reason
    return reason


def test_a_fitting_reply_decodes_bit_for_bit(fedproto_reply):
    reply, layout = fedproto_reply
    decoded = records.decode_payload(encoded(reply), expected=layout)
    assert decoded.keys() == reply.keys() and decoded["num_examples"] == reply["num_examples"]
    for name, tensor in reply["weights"].items():
        assert torch.equal(decoded["weights"][name], tensor) and decoded["weights"][name].dtype == tensor.dtype
    assert torch.equal(decoded["prototypes"], reply["prototypes"])
    assert torch.equal(decoded["class_counts"], reply["class_counts"])


def _extra_key(r):
    r["stolen"] = torch.zeros(1000)
    return ["'stolen'", "does not declare", "Server.reply_layout()"]


def _missing_key(r):
    del r["class_counts"]
    return ["lacks 'class_counts'"]


def _float64(r):
    r["weights"]["classifier.weight"] = r["weights"]["classifier.weight"].double()
    return ["'classifier.weight'", "float64", "expects float32"]


def _ten_times_larger(r):
    r["weights"]["classifier.weight"] = torch.zeros(40, 16)
    return ["'classifier.weight'", "shape (40, 16)", "expects (4, 16)"]


def _extra_weight(r):
    r["weights"]["features.9.weight"] = torch.zeros(3)
    return ["'features.9.weight'", "does not declare"]


def _missing_weight(r):
    del r["weights"]["classifier.bias"]
    return ["lacks 'classifier.bias'"]


def _tensor_for_weights(r):
    r["weights"] = torch.zeros(3)
    return ["'weights' must be a dict of tensors", "holds a tensor"]


def _prototypes_shape(r):
    r["prototypes"] = r["prototypes"][:, :8]
    return ["'prototypes'", "shape (4, 8)", "expects (4, 16)"]


def _counts_dtype(r):
    r["class_counts"] = r["class_counts"].int()
    return ["'class_counts'", "int32", "expects int64"]


def _float_examples(r):
    r["num_examples"] = 1e30
    return ["'num_examples' must be of type int", "float"]


def _text_examples(r):
    r["num_examples"] = "12"
    return ["'num_examples' must be of type int", "str"]


@pytest.mark.parametrize("tamper", [_extra_key, _missing_key, _float64, _ten_times_larger, _extra_weight,
                                    _missing_weight, _tensor_for_weights, _prototypes_shape, _counts_dtype,
                                    _float_examples, _text_examples])
def test_a_reply_off_the_layout_is_refused_before_any_array_is_decoded(fedproto_reply, tamper, monkeypatch):
    reply, layout = fedproto_reply
    reply = {**reply, "weights": dict(reply["weights"])}
    words = tamper(reply)
    reason = refused(encoded(reply), layout, monkeypatch)
    for word in words:
        assert word in reason


def test_more_bytes_than_the_declared_shape_takes_are_refused(fedproto_reply, monkeypatch):
    reply, layout = fedproto_reply
    # right dtype and shape in the metadata, ten times the values in the data
    big = Array(dtype="float32", shape=(4, 16), stype="numpy.ndarray", data=npy(np.zeros((40, 16), np.float32)))
    content = with_array(encoded(reply), "weights", "classifier.weight", big)
    reason = refused(content, layout, monkeypatch)
    assert "'weights' entry 'classifier.weight' is 2688 bytes" in reason and "takes 256 to 384" in reason


def test_fewer_bytes_than_the_values_take_are_refused(fedproto_reply, monkeypatch):
    reply, layout = fedproto_reply
    short = Array(dtype="float32", shape=(4, 16), stype="numpy.ndarray", data=npy(np.zeros((4, 16), np.float32))[:200])
    reason = refused(with_array(encoded(reply), "weights", "classifier.weight", short), layout, monkeypatch)
    assert "is 200 bytes" in reason


def test_records_the_layout_does_not_announce_are_refused(fedproto_reply, monkeypatch):
    reply, layout = fedproto_reply
    content = encoded(reply)
    content["smuggled"] = ArrayRecord({"x": Array(np.zeros(10**4, np.float32))})
    assert "'smuggled'" in refused(content, layout, monkeypatch)
    content = encoded(reply)
    content[records.SCALARS] = ConfigRecord({**content.config_records[records.SCALARS], "note": "x" * 1000})
    assert "'note'" in refused(content, layout, monkeypatch)


def test_metadata_that_lies_about_the_npy_bytes_is_an_update_error_at_decoding(fedproto_reply):
    # same byte count, metadata (4, 16) float32, but the .npy bytes hold a (16, 4) array: it passes the
    # metadata check; decoding then refuses it (one line) instead of handing a wrong shape on
    reply, layout = fedproto_reply
    liar = Array(dtype="float32", shape=(4, 16), stype="numpy.ndarray", data=npy(np.zeros((16, 4), np.float32)))
    content = with_array(encoded(reply), "weights", "classifier.weight", liar)
    records.check_layout(content, layout)
    with pytest.raises(UpdateError, match=r"holds a float32 array of shape \(16, 4\) but announces float32 \(4, 16\)"):
        records.decode_payload(content, expected=layout)
    garbage = Array(dtype="float32", shape=(4, 16), stype="numpy.ndarray", data=b"\0" * 300)
    with pytest.raises(UpdateError, match="not a readable .npy array"):
        records.decode_payload(with_array(encoded(reply), "weights", "classifier.weight", garbage), expected=layout)


@pytest.mark.parametrize("shape", [(), (0,), (3,), (4, 16), (2, 3, 5), (1,) * 20, (70000, 2), (2, 70000)])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "bool", "uint8"])
def test_npy_size_bounds_hold_what_np_save_writes_in_either_memory_order(shape, dtype):
    least, most = records.npy_size_bounds(shape, dtype)
    values = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    assert least == values
    for order in "CF":
        assert least < len(npy(np.zeros(shape, dtype, order=order))) <= most
    assert most - least <= 256  # a header, not room for a payload


# ----------------------------------------------------------------------------
# a plug-in method: what it uploads must be declared
# ----------------------------------------------------------------------------


class ScoreClient(Client):
    """FedAvg's client that also uploads a ``score`` tensor (a plug-in method's extra key)."""

    def fit(self, model, payload, data, state, generator):
        reply, losses = super().fit(model, payload, data, state, generator)
        return {**reply, "score": torch.ones(2)}, losses


class DeclaredScoreServer(Server):
    def reply_layout(self):
        return {**super().reply_layout(), "score": ((2,), torch.float32)}


def plug_in_reply(server_class) -> tuple[dict[str, Any], Any]:
    data = make_federation([10]).clients[0]
    context = MethodContext(model=TinyNet(), num_classes=4, options=None, train=TRAIN)
    server = server_class(context)
    model = TinyNet()
    load_weights(model, clone_weights(context.model))
    reply, _ = ScoreClient(context).fit(model, server.broadcast(0), data, {}, torch.Generator().manual_seed(0))
    return reply, server.reply_layout()


def test_a_plug_in_method_that_uploads_an_undeclared_key_is_told_to_declare_it(monkeypatch):
    reply, layout = plug_in_reply(Server)
    reason = refused(encoded(reply), layout, monkeypatch)
    assert reason.startswith("the reply holds 'score'") and "declare it in Server.reply_layout()" in reason
    reply, layout = plug_in_reply(DeclaredScoreServer)
    assert torch.equal(records.decode_payload(encoded(reply), expected=layout)["score"], torch.ones(2))


# ----------------------------------------------------------------------------
# the server: a refused reply is dropped with its reason, the round goes on
# ----------------------------------------------------------------------------


class Grid:
    """What MethodStrategy asks of a Grid between configure_train and aggregate_train: the online nodes."""

    def __init__(self, nodes):
        self.nodes = list(nodes)

    def get_node_ids(self):
        return self.nodes


NODES = {0: 101, 1: 102, 2: 103}


def strategy_for(sim: Simulator, name: str) -> MethodStrategy:
    config = load_config({"method": name, "rounds": 3, "eval_every": 10, "clients": len(SIZES)})
    side = ServerSide(config, sim.server, sim.protocol, sim.models, sim.device,
                      [len(data) for data in sim.federation.clients])
    return MethodStrategy(side, config, dict(NODES))


def flower_round(name: str, tamper, monkeypatch, decoded: list[str] | None = None
                 ) -> tuple[MethodStrategy, list[dict[str, Any]], Simulator]:
    """Round 0 of ``name`` through MethodStrategy: each node fits its client on the broadcast it decodes,
    replies as a SuperNode does; client 1's reply is tampered with. Returns the strategy, the three
    replies as sent (before tampering) and the simulator whose server the strategy drives. With
    ``decoded``, the name of every array the server decodes is appended to it."""
    from flwr.supercore.task_identity import TaskIdentity

    for field in ("_run_id", "_task_id", "_node_id"):  # outside a run, flwr refuses to address a Message
        monkeypatch.setattr(TaskIdentity, field, 1)
    sim = simulator(name)
    strategy = strategy_for(sim, name)
    grid = Grid(NODES.values())
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    replies, sent = [], []
    for message in messages:
        k = strategy.partition_of[message.metadata.dst_node_id]
        payload = records.decode_payload(message.content)
        reply, metrics = sim.client.fit(sim.models.model_for(k), payload, sim.federation.clients[k], {},
                                        torch.Generator().manual_seed(k))
        sent.append(reply)
        if k == 1:
            reply = {**reply, "weights": dict(reply["weights"])}
            tamper(reply)
        content = RecordDict({**records.encode_payload(reply), records.METRICS: records.encode_metrics(metrics)})
        replies.append(Message(content, reply_to=message))
    if decoded is not None:
        real = records._tensor

        def counting(array, device, name="array"):
            decoded.append(name)
            return real(array, device, name)

        monkeypatch.setattr(records, "_tensor", counting)
    strategy.aggregate_train(1, replies)
    assert list(strategy.configure_evaluate(1, ArrayRecord(), ConfigRecord(), grid)) == []  # not an eval round
    strategy.aggregate_evaluate(1, [])
    return strategy, sent, sim


def _huge_int_examples(r):
    r["num_examples"] = 10 ** 12  # an int, so it fits the layout: the protocol bounds it by the training set


@pytest.mark.parametrize("tamper, words", [
    (_extra_key, ["'stolen'", "Server.reply_layout()"]),
    (_float64, ["'classifier.weight'", "float64"]),
    (_ten_times_larger, ["'classifier.weight'", "shape (40, 16)"]),
    (_float_examples, ["'num_examples'", "float"]),
    (_huge_int_examples, ["num_examples=1000000000000", "holds 10 training samples"]),
], ids=["extra-key", "float64", "10x-larger", "num-examples-1e30", "num-examples-huge-int"])
def test_a_tampered_reply_is_dropped_with_one_line_and_the_round_completes(tamper, words, monkeypatch):
    strategy, sent, sim = flower_round("fedavg", tamper, monkeypatch)
    row = strategy.rows[-1]
    assert row["round"] == 0 and not row.get("skipped") and [d["client"] for d in row["dropped"]] == [1]
    reason = row["dropped"][0]["reason"]
    assert reason.startswith("invalid update: ") and "\n" not in reason
    for word in words:
        assert word in reason, reason
    # the round aggregated the two other replies: their n_k-weighted mean, by hand
    kept = [sent[0], sent[2]]
    total = sum(reply["num_examples"] for reply in kept)
    for name, tensor in sim.server.global_weights().items():
        expected = sum(reply["weights"][name].double() * reply["num_examples"] for reply in kept) / total
        torch.testing.assert_close(tensor.double(), expected.to(tensor.dtype).double(), rtol=1e-6, atol=1e-6)
    assert strategy.refused == {1: 0}  # the node is told to roll its state back


def test_the_server_decodes_no_array_of_a_refused_reply(monkeypatch):
    decoded: list[str] = []
    strategy, sent, _ = flower_round("fedproto", _extra_key, monkeypatch, decoded)
    # the two accepted replies' arrays, each once; nothing of client 1's (whose extra key is 1000 floats)
    per_reply = len(sent[0]["weights"]) + 2  # the weights, prototypes, class_counts
    assert len(decoded) == 2 * per_reply and "stolen" not in decoded
    assert [d["client"] for d in strategy.rows[-1]["dropped"]] == [1]
