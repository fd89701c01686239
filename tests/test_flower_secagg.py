"""Secure aggregation on Flower (``flower.secure-aggregation=secagg+``, fedhpro.flower.secagg).

* units: what a client packs, summed and rebuilt, aggregates like the method's own aggregation of the
  clients' real replies (the reference: the method's ``aggregate`` on those replies); the rebuilt class
  counts keep every class's number of holders; the settings' bounds;
* 3 nodes in this process (the ServerApp's ``run_server`` against the real ClientApp, mods included,
  every message copied as if it crossed the wire): an instrumented server sees only masked vectors and
  the unmasked sum, never a client's upload, and ends where the plain run ends (within the quantization
  bound); a node that drops out after sharing its keys is recovered by SecAgg+ (its masks rebuilt from its
  neighbours' shares) and the round equals a plain round without that client; too many dropouts stop the
  run in one line;
* refusals: one line each, before any node is asked where the config alone decides.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")

from conftest import NUM_CLASSES, TinyNet, run_flower_simulation  # noqa: E402
from flwr.app import Context, Error, Message, RecordDict  # noqa: E402
from flwr.common import bytes_to_ndarray  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage  # noqa: E402
from test_flower import tiny_config  # noqa: E402

from fedhpro import methods  # noqa: E402
from fedhpro.config import load_config  # noqa: E402
from fedhpro.engines.class_rows import declared_class_keys  # noqa: E402
from fedhpro.errors import ConfigError, FedHProError  # noqa: E402
from fedhpro.flower import client as client_app  # noqa: E402
from fedhpro.flower import secagg  # noqa: E402
from fedhpro.flower.engine import build_engine  # noqa: E402
from fedhpro.flower.server import HEADER, run_server  # noqa: E402
from fedhpro.flower.settings import SecureSettings, split_run_config  # noqa: E402

SECURE = {"flower.secure-aggregation": "secagg+"}


@pytest.fixture
def inside_a_run(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # outside a run, flwr refuses to address a Message
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


# ---------------------------------------------------------------------------- units


def client_replies(method: str, data_dir: Path, **extra: Any) -> tuple[Any, list[dict[str, Any]], list[dict]]:
    """``(engine, the 3 clients' real round-0 replies, their metrics)`` of a tiny run of ``method``."""
    engine = build_engine(load_config(tiny_config(data_dir, method=method, **extra)))
    payload = engine.server.broadcast(0)
    replies, metrics = [], []
    for k in range(3):
        model = engine.models.working_model if not engine.models.personal else engine.models.model_for(k, None)
        reply, losses = engine.client.fit(model, copy.deepcopy(payload), engine.federation.clients[k], {},
                                          torch.Generator().manual_seed(k))
        replies.append(reply)
        metrics.append(losses)
    return engine, replies, metrics


@pytest.mark.parametrize("method, extra", [
    ("fedavg", {}), ("fedproto", {}), ("fedsa", {}), ("fedhpro", {}),
    ("fedhpro", {"fedhpro.prototypes": "global", "fedhpro.classifier_step": "synthetic"}),
])
def test_the_sum_rebuilt_aggregates_like_the_real_replies(method, extra, digits_data_dir):
    """Reference: the method's own aggregate of the three real replies. Packed, summed (exactly, here:
    no quantization) and rebuilt, the same aggregate must come out, to float rounding."""
    engine, replies, metrics = client_replies(method, digits_data_dir, **extra)
    server, payload = engine.server, engine.server.broadcast(0)
    sizes = [len(engine.federation.clients[k]) for k in range(3)]
    scale = float(max(sizes))
    layout = secagg.SecureLayout(server, method)
    total = sum(layout.pack(r, payload["weights"], m, n, scale) for r, m, n in zip(replies, metrics, sizes))
    names = sorted({name for m in metrics for name in m})
    rebuilt, rebuilt_metrics = secagg.rebuild_replies(layout, total, payload["weights"], sizes, scale, 0.0, names)
    expected_metrics = {name: sum(n * m.get(name, 0.0) for n, m in zip(sizes, metrics)) / sum(sizes)
                        for name in names}
    assert rebuilt_metrics == pytest.approx(expected_metrics, rel=1e-9, abs=1e-12)
    # the method's aggregate of the real replies, and of the rebuilt ones, from the same server state
    state = copy.deepcopy(server.state_dict())
    reference_metrics = server.aggregate(0, [copy.deepcopy(r) for r in replies])
    expected = copy.deepcopy(server.state_dict())
    server.load_state_dict(copy.deepcopy(state))
    for reply in rebuilt:
        server.validate_reply(reply)
    got_metrics = server.aggregate(0, rebuilt)
    got = server.state_dict()
    assert set(got) == set(expected)
    compared = 0
    for key, value in expected.items():
        items = value.items() if isinstance(value, dict) else [(key, value)]
        for name, tensor in items:
            other = got[key][name] if isinstance(value, dict) else got[key]
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                torch.testing.assert_close(other, tensor, rtol=1e-5, atol=1e-5, msg=f"{key}/{name}")
                compared += 1
            elif isinstance(tensor, torch.Tensor):
                assert torch.equal(other, tensor), f"{key}/{name}"
    assert compared >= 1
    assert set(got_metrics) == set(reference_metrics)
    if declared_class_keys(server):  # the rebuilt replies hold each class with as many clients as the real ones
        held = torch.stack([r["class_counts"] > 0 for r in replies]).sum(0)
        assert torch.equal(torch.stack([r["class_counts"] > 0 for r in rebuilt]).sum(0), held)


def test_rebuilt_class_counts_keep_the_holders_within_each_clients_size():
    rng = np.random.default_rng(0)
    for _ in range(200):
        clients, classes = int(rng.integers(2, 7)), int(rng.integers(1, 12))
        truth = rng.random((clients, classes)) < 0.5
        truth[np.arange(clients), rng.integers(0, classes, clients)] = True  # every client holds a class
        capacity = [int(row.sum()) + int(rng.integers(0, 3)) for row in truth]
        matrix = secagg.holder_counts(truth.sum(0).tolist(), capacity)
        assert set(np.unique(matrix)) <= {0, 1}
        assert (matrix.sum(0) == truth.sum(0)).all()
        assert (matrix.sum(1) >= 1).all() and (matrix.sum(1) <= capacity).all()


def test_quantization_of_a_sum_stays_within_the_stated_bound():
    """Flower's own quantize/dequantize, as SecAgg+ applies them to K vectors: the sum is off by less than
    K * 2r/Q per entry (the bound the docs state), and values beyond r are what the node must refuse."""
    from flwr.common.secure_aggregation.quantization import dequantize, quantize

    settings = SecureSettings(clipping_range=4.0, quantization_range=2 ** 20)
    rng = np.random.default_rng(1)
    vectors = [rng.uniform(-4, 4, 5000) for _ in range(5)]
    quantized = sum(quantize([v], settings.clipping_range, settings.quantization_range)[0].astype(np.int64)
                    for v in vectors)
    summed = dequantize([quantized], settings.clipping_range, settings.quantization_range)[0]
    summed += -(len(vectors) - 1) * settings.clipping_range
    error = np.abs(summed - sum(vectors)).max()
    assert 0 < error < len(vectors) * settings.step
    assert settings.step == 8.0 / 2 ** 20


@pytest.mark.parametrize("run_config, words", [
    ({"flower.secure-aggregation": "secagg"}, "must be one of none, secagg+"),
    ({"flower.secagg-clipping-range": 0}, "must be > 0"),
    ({"flower.secagg-quantization-range": 2 ** 31}, "whole number in"),
    ({"flower.secagg-threshold": 1.5}, "share in"),
    ({"flower.secagg-shares": "x"}, "must be a number"),
])
def test_bad_secagg_settings_are_one_line_config_errors(run_config, words):
    with pytest.raises(ConfigError, match=words) as error:
        split_run_config(run_config)
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------- 3 nodes in this process


class WireGrid:
    """Flower's Grid for ``run_server``, with three nodes running the real ClientApp (``client_app.app``:
    the handlers and their mods) in this process. Every message and reply is deep-copied, as if it crossed
    the wire; a node that raises answers with an error, as Flower's runtime does. ``received`` keeps every
    reply the server got (the instrumented server); ``drop``: ``{(round, node, stage)}`` where that node
    vanishes for the rest of the round (no reply); ``fail``: likewise, it answers with an error."""

    def __init__(self, nodes: int = 3, drop: set | None = None, fail: set | None = None):
        self.contexts = {100 + k: Context(run_id=1, node_id=100 + k, state=RecordDict(), run_config={},
                                          node_config={"partition-id": k, "num-partitions": nodes})
                         for k in range(nodes)}
        self.drop, self.fail = set(drop or ()), set(fail or ())
        self.received: list[tuple[str, Message]] = []  # (stage or message type, reply)
        self.gone: set[tuple[int, int]] = set()  # (round, node): no reply for the rest of that round

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(self, messages, timeout=None) -> list[Message]:
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            configs = message.content.config_records.get(RECORD_KEY_CONFIGS)
            stage = str(configs[Key.STAGE]) if configs is not None else message.metadata.message_type
            header = message.content.config_records.get(HEADER)
            round = (int(message.metadata.group_id) if message.metadata.group_id
                     else int(header.get("round", -1)) if header is not None else -1)
            key = (round, node, stage)
            if key in self.drop or (round, node) in self.gone:  # it comes back for the next round
                self.gone.add((round, node))
                continue
            if key in self.fail:
                reply = Message(Error(code=2, reason="node failed here (test)"), reply_to=message)
            else:
                try:
                    reply = client_app.app(copy.deepcopy(message), self.contexts[node])
                except Exception as error:  # noqa: BLE001 - Flower answers a raising ClientApp with an error
                    reply = Message(Error(code=2, reason=f"{type(error).__name__}: {error}"), reply_to=message)
            reply = copy.deepcopy(reply)
            self.received.append((stage, reply))
            replies.append(reply)
        return replies


def run_in_process(settings: dict[str, Any], run_config: dict[str, Any], grid: WireGrid, out: Path):
    strategy = run_server(grid, run_config, {**settings, "out": str(out)})
    return strategy, torch.load(out / "server_state.pt", weights_only=True)["server"]


def max_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest |a - b| over every floating tensor of two server states."""
    largest = 0.0
    for key, value in a.items():
        items = value.items() if isinstance(value, dict) else [(key, value)]
        for name, tensor in items:
            other = b[key][name] if isinstance(value, dict) else b[key]
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                largest = max(largest, float((tensor.double() - other.double()).abs().max()))
    return largest


def received_arrays(reply: Message) -> list[np.ndarray]:
    """Every array a reply carries: its ArrayRecords' and every bytes value of its ConfigRecords that
    reads as a .npy array (SecAgg+ sends its masked vectors as bytes; keys, shares and ciphertexts do not
    read as arrays)."""
    arrays = [array.numpy() for record in reply.content.array_records.values() for array in record.values()]
    for record in reply.content.config_records.values():
        for value in record.values():
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, bytes):
                    try:
                        arrays.append(bytes_to_ndarray(item))
                    except Exception:  # noqa: BLE001 - not an array
                        pass
    return arrays


@pytest.mark.slow
def test_the_server_sees_only_masked_vectors_and_the_sum(digits_data_dir, tmp_path, inside_a_run, monkeypatch):
    settings = tiny_config(digits_data_dir, method="fedhpro", rounds=2)
    # ground truth, recorded on the nodes: each client's real reply and the vector it hands to SecAgg+
    truth: list[tuple[int, dict[str, Any], np.ndarray]] = []
    original_vector = secagg.client_vector

    def recording_vector(layout, server, reply, *args, **kwargs):
        vector = original_vector(layout, server, reply, *args, **kwargs)
        truth.append((len(truth), copy.deepcopy(dict(reply)), vector.copy()))
        return vector

    monkeypatch.setattr(secagg, "client_vector", recording_vector)
    sums: list[np.ndarray] = []
    original_round = secagg.run_round

    def recording_round(*args, **kwargs):
        outcome = original_round(*args, **kwargs)
        sums.append(outcome.total.copy())
        return outcome

    monkeypatch.setattr(secagg, "run_round", recording_round)
    grid = WireGrid()
    secure, secure_state = run_in_process(settings, SECURE, grid, tmp_path / "secure")
    plain, plain_state = run_in_process(settings, {}, WireGrid(), tmp_path / "plain")
    assert len(truth) == 6 and len(sums) == 2  # 3 clients x 2 rounds, one sum per round

    # what arrived at the server in the training rounds: no array in any ArrayRecord (secaggplus_mod empties
    # them), the masked vectors as bytes in SecAgg+'s ConfigRecord
    train_replies = [reply for stage, reply in grid.received if stage in Stage.all()]
    assert train_replies and not any(len(record) for r in train_replies for record in r.content.array_records.values())
    masked = [r.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS] for stage, r in grid.received
              if stage == Stage.COLLECT_MASKED_VECTORS]
    assert len(masked) == 6
    secure_settings = SecureSettings()
    for round in range(2):
        vectors = [vector for index, _, vector in truth[3 * round:3 * round + 3]]
        for raw in masked[3 * round:3 * round + 3]:
            seen = bytes_to_ndarray(raw[1])
            for vector in vectors:
                # the client's quantized vector, unmasked, would sit within 1 of these integers almost everywhere
                quantized = np.floor((np.clip(vector, -64, 64) + 64) * secure_settings.quantization_range / 128)
                assert np.mean(np.abs(seen - quantized) <= 1) < 0.01
        # the sum the server unmasked equals the sum of the real vectors within K quantization steps
        assert np.abs(sums[round] - sum(vectors)).max() < 3 * secure_settings.step
    # no array the server received equals (or is close to) any client's real upload
    uploads = [np.asarray(t, dtype=np.float64) for _, reply, _ in truth for key, value in reply.items()
               for t in (value.values() if isinstance(value, dict) else [value]) if isinstance(t, torch.Tensor)
               and t.numel() > 8]
    for _, reply in grid.received:
        for array in received_arrays(reply):
            for upload in uploads:
                if array.size == upload.size:
                    assert not np.allclose(array.reshape(-1).astype(np.float64), upload.reshape(-1), atol=1e-3)

    # the result: the plain run's, up to the quantization (measured, stated in docs/how-to/secure-aggregation.md)
    rows, plain_rows = secure.rows, plain.rows
    assert [r["participants"] for r in rows] == [[0, 1, 2]] * 2 and not any(r.get("dropped") for r in rows)
    assert [r["accuracy"]["AVG"] for r in rows] == [r["accuracy"]["AVG"] for r in plain_rows]
    assert [r["bytes_up"] for r in rows] == [r["bytes_up"] for r in plain_rows]
    for row, plain_row in zip(rows, plain_rows):  # metrics are summed / METRIC_SCALE: K x 1024 x 2r/Q
        assert row["train"] == pytest.approx(plain_row["train"], abs=3 * secagg.METRIC_SCALE * SecureSettings().step)
    assert 0 < max_difference(secure_state, plain_state) < 1e-4


@pytest.mark.slow
def test_a_node_dropping_after_sharing_its_keys_is_recovered(digits_data_dir, tmp_path, inside_a_run):
    """Node 102 (client 2) vanishes in round 0 after the key sharing, before its masked vector: SecAgg+
    rebuilds its pairwise masks from its neighbours' shares of its key, so the round sums clients 0 and 1.
    Reference: the plain run where client 2 fails in round 0 (its train message answers with an error)."""
    settings = tiny_config(digits_data_dir, method="fedproto", rounds=2)
    grid = WireGrid(drop={(0, 102, Stage.COLLECT_MASKED_VECTORS)})
    secure, secure_state = run_in_process(settings, SECURE, grid, tmp_path / "secure")
    plain, plain_state = run_in_process(settings, {}, WireGrid(fail={(0, 102, "train")}), tmp_path / "plain")
    first = secure.rows[0]
    assert first["participants"] == [0, 1, 2]
    assert [d["client"] for d in first["dropped"]] == [2]
    assert "collect_masked_vectors" in first["dropped"][0]["reason"]
    assert [r["accuracy"]["AVG"] for r in secure.rows] == [r["accuracy"]["AVG"] for r in plain.rows]
    assert 0 < max_difference(secure_state, plain_state) < 1e-4


@pytest.mark.slow
def test_a_node_dropping_while_unmasking_still_counts(digits_data_dir, tmp_path, inside_a_run):
    """Node 102 sent its masked vector, then vanishes before the unmask stage: its vector is in the sum
    and the others' shares of its mask seed remove its private mask. The round equals the plain one."""
    settings = tiny_config(digits_data_dir, method="fedavg", rounds=1)
    secure, secure_state = run_in_process(settings, SECURE, WireGrid(drop={(0, 102, Stage.UNMASK)}),
                                          tmp_path / "secure")
    plain, plain_state = run_in_process(settings, {}, WireGrid(), tmp_path / "plain")
    assert secure.rows[0]["participants"] == [0, 1, 2] and not secure.rows[0].get("dropped")
    assert 0 < max_difference(secure_state, plain_state) < 1e-5


@pytest.mark.slow
def test_the_same_seed_gives_the_same_sums(digits_data_dir, tmp_path, inside_a_run):
    """The masks come from the operating system but cancel exactly; the stochastic rounding is seeded per
    (seed, round, client): two runs give the same server state to the last bit."""
    settings = tiny_config(digits_data_dir, method="fedproto", rounds=1)
    _, first = run_in_process(settings, SECURE, WireGrid(), tmp_path / "first")
    _, second = run_in_process(settings, SECURE, WireGrid(), tmp_path / "second")
    assert max_difference(first, second) == 0.0


def test_flower_settings_can_come_with_the_apps_base_config():
    """make_server_app(base) and run_simulation (an empty run config): base may hold flower.* settings."""
    from fedhpro.flower.settings import config_from_run_config

    config, settings = config_from_run_config({}, {"method": "fedavg", **SECURE})
    assert config.run.method == "fedavg" and settings.secure_aggregation == "secagg+"
    assert config_from_run_config({"flower.secure-aggregation": "none"}, SECURE)[1].secure_aggregation == "none"


def test_too_many_dropouts_stop_the_run_in_one_line(digits_data_dir, tmp_path, inside_a_run):
    settings = tiny_config(digits_data_dir, method="fedavg", rounds=1)
    grid = WireGrid(fail={(0, 101, Stage.SHARE_KEYS), (0, 102, Stage.SHARE_KEYS)})
    with pytest.raises(FedHProError, match="every client failed") as error:
        run_in_process(settings, SECURE, grid, tmp_path / "out")
    assert "\n" not in str(error.value)


def test_a_value_beyond_the_clipping_range_is_refused_by_the_node(digits_data_dir, tmp_path, inside_a_run):
    """SecAgg+ would clip it without a word: the node refuses, and says which value and what to raise."""
    settings = tiny_config(digits_data_dir, method="fedavg", rounds=1)
    with pytest.raises(FedHProError, match="outside flower.secagg-clipping-range=1e-09; raise it"):
        run_in_process(settings, {**SECURE, "flower.secagg-clipping-range": 1e-9}, WireGrid(), tmp_path / "out")


class UntouchableGrid:
    def __getattr__(self, name):
        raise AssertionError(f"the grid was used ({name}) before the config was refused")


@pytest.mark.parametrize("extra, words", [
    ({"aggregation": "median"}, "aggregation=median needs a coordinate-wise median of each client's update"),
    ({"aggregation": "norm-clip"}, "aggregation=norm-clip needs each update's norm"),
    ({"faults.scale": 0.2}, "faults.scale changes one client's reply on the server"),
    ({"faults.corrupt": 0.2}, "faults.corrupt changes one client's reply"),
    ({"method": "fedtgp"}, "method=fedtgp cannot run .* trains the global prototypes on every client's own"),
    ({"method": "fedgmkd"}, "method=fedgmkd cannot run .* discrepancy"),
    ({"privacy": "client"}, "privacy=client cannot go with flower.secure-aggregation=secagg"),
])
def test_what_needs_each_update_is_refused_before_any_node_is_asked(extra, words, digits_data_dir, tmp_path):
    settings = tiny_config(digits_data_dir, **extra)
    with pytest.raises(ConfigError, match=words) as error:
        run_server(UntouchableGrid(), SECURE, {**settings, "out": str(tmp_path / "out")})
    assert "\n" not in str(error.value)


def test_a_round_of_one_participant_is_refused(digits_data_dir, tmp_path, inside_a_run):
    settings = tiny_config(digits_data_dir, method="fedavg", rounds=1, participation=0.2)
    with pytest.raises(ConfigError, match="needs at least 2 participants per round, this run has 1"):
        run_in_process(settings, SECURE, WireGrid(), tmp_path / "out")


# ---------------------------------------------------------------------------- what a method declares

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def registry(monkeypatch):
    """The method registry, restored after the test, with examples/own_method's two methods registered."""
    from test_plugins import restored

    monkeypatch.syspath_prepend(str(EXAMPLES / "own_method"))
    import fedhpro_fedavgm
    import fedhpro_feddecorr

    with restored(methods.REGISTRY, monkeypatch):
        methods.register("fedavgm", fedhpro_fedavgm.METHOD)
        methods.register("feddecorr", fedhpro_feddecorr.METHOD)
        yield methods


def declared_server(spec: methods.MethodSpec) -> methods.Server:
    """``spec``'s server part on a tiny model (no data: its reply layout is all secure aggregation reads)."""
    return spec.server(methods.MethodContext(model=TinyNet(), num_classes=NUM_CLASSES, options=spec.options(),
                                             train=methods.TrainSettings()))


@pytest.mark.parametrize("method", ["fedavgm", "feddecorr"])
def test_the_example_plug_in_methods_get_secagg_from_their_own_declarations(method, registry, digits_data_dir):
    """examples/own_method: FedAvgM uploads its weights, FedDecorr also its class counts (no class rows to
    average); neither says its server needs each upload, so both run under SecAgg+ (no method is named in
    fedhpro.flower), and the sum rebuilt aggregates as their own server aggregates the real replies."""
    assert registry.get_method(method).needs_each_upload == ""
    config = load_config(tiny_config(digits_data_dir, method=method))
    layout = secagg.check_secure_run(config, declared_server(registry.get_method(method)), 3, SecureSettings())
    assert layout.weighting == {} and layout.per_class == (method == "feddecorr")
    test_the_sum_rebuilt_aggregates_like_the_real_replies(method, {}, digits_data_dir)


def test_a_plug_in_method_whose_class_rows_say_no_averaging_is_refused_naming_the_key(registry):
    """FedProto's server under another name, its rows' averaging left undeclared: one line naming the key
    and how to declare it; FedProto itself (which declares it) gets SecAgg+."""
    from fedhpro.methods.fedproto import METHOD as FEDPROTO
    from fedhpro.methods.fedproto import FedProtoServer

    class Undeclared(FedProtoServer):
        rows_averaged = None

    spec = registry.register("my-proto", dataclasses.replace(FEDPROTO, server=Undeclared))
    with pytest.raises(ConfigError) as error:
        secagg.check_secure_run(load_config({"method": "my-proto"}), declared_server(spec), 3, SecureSettings())
    message = str(error.value)
    assert message.startswith("method=my-proto: its reply's class rows 'prototypes' do not say how the server "
                              "averages them; declare ClassRows(shape, dtype, averaged='holders')"), message
    assert "averaged='counts'" in message and "\n" not in message
    layout = secagg.check_secure_run(load_config({"method": "fedproto"}), declared_server(FEDPROTO), 3,
                                     SecureSettings())
    assert layout.weighting == {"prototypes": "holders"} and math.isfinite(layout.size)


def test_a_plug_in_method_that_needs_each_upload_is_refused_quoting_its_reason(registry, tmp_path):
    spec = methods.MethodSpec(name="ranked", options=registry.get_method("fedavg").options, server=methods.Server,
                              client=methods.Client, needs_each_upload="its server ranks the clients' own updates")
    registry.register("ranked", spec)
    with pytest.raises(ConfigError) as error:
        run_server(UntouchableGrid(), SECURE, {"method": "ranked", "rounds": 1, "out": str(tmp_path / "out")})
    assert str(error.value) == ("method=ranked cannot run under flower.secure-aggregation=secagg+: its server ranks "
                                "the clients' own updates, and the server learns only the sum of the uploads")


@pytest.mark.slow
def test_secagg_on_flowers_simulation_engine(digits_data_dir, tmp_path):
    """Flower's own simulation engine (Ray: each node's messages cross processes), 3 SuperNodes, FedHPro for
    2 rounds under SecAgg+: the simulator's accuracies, and its server state within the quantization bound."""

    from flwr.serverapp import Grid, ServerApp
    from test_flower import reference


    settings = tiny_config(digits_data_dir, method="fedhpro", rounds=2)
    outcome: dict[str, Any] = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            outcome["strategy"] = run_server(grid, SECURE, {**settings, "out": str(tmp_path / "flower")})
        except Exception as error:  # noqa: BLE001 - reported below, in the test's process
            outcome["error"] = error

    run_flower_simulation(server_app, client_app.app)  # Ray on loopback, PYTHONPATH put back
    if "error" in outcome:
        raise outcome["error"]
    rows = outcome["strategy"].rows
    expected_rows, expected_state = reference(settings, tmp_path / "simulator")
    assert [r["participants"] for r in rows] == [[0, 1, 2]] * 2 and not any(r.get("dropped") for r in rows)
    assert [r["accuracy"]["AVG"] for r in rows] == [r["accuracy"]["AVG"] for r in expected_rows]
    state = torch.load(tmp_path / "flower" / "server_state.pt", weights_only=True)["server"]
    assert 0 < max_difference(state, expected_state) < 1e-4


# ---------------------------------------------------------------------------- privacy=client on Flower


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    {"method": "fedproto", "privacy": "client", "privacy.noise": "local", "privacy.clip": 0.5,
     "privacy.noise_multiplier": 0.05},  # more local noise garbles the tiny model: its loss explodes (a diverged run)
    {"method": "fedhpro", "privacy": "client", "privacy.noise": "central", "privacy.noise_multiplier": 0.3},
    {"method": "fedavg", "privacy": "client", "privacy.noise_multiplier": 0.05, "privacy.clip": 5.0,
     "privacy.clip_quantile": 0.5, "participation": 0.67, "privacy.noise_cohort": 3},  # adaptive clip, noise cohort
])
def test_client_level_dp_on_flower_equals_the_simulator(extra, digits_data_dir, tmp_path, inside_a_run):
    """The node privatizes its reply where the simulator's client does (fedhpro.privacy.client.privatize_upload,
    the same seeded noise streams, asked for with privacy.secure_noise=false), the ServerApp's round protocol
    releases the sum: the same rows (epsilon included) and the same server state as ``fedhpro.run``, to the
    last bit."""
    extra = {**extra, "privacy.secure_noise": False}
    from test_flower import assert_same_state, core, reference

    settings = tiny_config(digits_data_dir, rounds=2, **extra)
    grid = WireGrid()
    strategy, state = run_in_process(settings, {}, grid, tmp_path / "flower")
    expected_rows, expected_state = reference(settings, tmp_path / "simulator")
    assert core(strategy.rows) == core(expected_rows)
    assert [row["privacy"] for row in strategy.rows] == [row["privacy"] for row in expected_rows]
    if "privacy.clip_quantile" in extra:  # the clip moved, the same on both engines
        clips = [row["privacy"]["clip"] for row in strategy.rows]
        assert clips[0] == 5.0 and clips[1] != clips[0]
    assert_same_state(state, expected_state)
    # what the nodes sent: privatized replies (public counts, the privacy's holder vector), no training metrics
    replies = [reply for stage, reply in grid.received if stage == "train"]
    assert len(replies) == sum(row["num_participants"] for row in expected_rows) > 0
    for reply in replies:
        assert reply.content.config_records["fedhpro.scalars"]["num_examples"] == 1
        assert dict(reply.content.metric_records["fedhpro.metrics"]) == {}


@pytest.mark.slow
def test_flower_draws_privacy_noise_from_the_os_unless_told_otherwise(digits_data_dir, tmp_path, inside_a_run):
    """privacy.secure_noise unset: seeded noise in the simulator (reproducible), the operating system's on Flower
    (anyone who knows the config could redraw seeded noise): two Flower runs of one config differ from each
    other and from the simulator, and the run's config.yaml records the choice."""
    from test_flower import reference

    settings = tiny_config(digits_data_dir, rounds=1, method="fedavg", privacy="client",
                           **{"privacy.noise_multiplier": 0.5})
    first, state_a = run_in_process(settings, {}, WireGrid(), tmp_path / "a")
    _, state_b = run_in_process(settings, {}, WireGrid(), tmp_path / "b")
    _, expected = reference(settings, tmp_path / "simulator")
    assert first.config.privacy.secure_noise is True
    assert load_config(tmp_path / "a" / "config.yaml").privacy.secure_noise is True
    assert max_difference(state_a, state_b) > 0 and max_difference(state_a, expected) > 0


@pytest.mark.slow
@pytest.mark.parametrize("limit_rounds", [0, 2])
def test_privacy_budget_stops_a_flower_run_where_the_simulator_stops(limit_rounds, digits_data_dir, tmp_path,
                                                                    inside_a_run):
    """privacy.max_epsilon on Flower: the run stops before the round that would take epsilon above it (before
    round 0, or after 2 of 4 rounds), with the simulator's rows, summary.json privacy block (its ``stopped``
    line included) and model, bit for bit."""
    import json

    from test_flower import core

    import fedhpro

    base = tiny_config(digits_data_dir, rounds=4, method="fedavg", privacy="client",
                       **{"privacy.noise_multiplier": 1.0, "privacy.secure_noise": False})
    # the epsilon each round reaches, unlimited
    epsilons = [row["privacy"]["epsilon"] for row in fedhpro.run(base, out=str(tmp_path / "probe")).metrics]
    limit = (epsilons[limit_rounds - 1] + epsilons[limit_rounds]) / 2 if limit_rounds else epsilons[0] / 2
    settings = {**base, "privacy.max_epsilon": limit}
    strategy = run_server(WireGrid(), {}, {**settings, "out": str(tmp_path / "flower")})
    expected_rows = fedhpro.run(settings, out=str(tmp_path / "simulator")).metrics
    assert len(strategy.rows) == len(expected_rows) == limit_rounds
    assert core(strategy.rows) == core(expected_rows)
    flower = json.loads((tmp_path / "flower" / "summary.json").read_text())
    simulator = json.loads((tmp_path / "simulator" / "summary.json").read_text())
    assert flower["privacy"] == simulator["privacy"] and "stopped" in flower["privacy"]
    assert flower["accuracy"] == simulator["accuracy"]
    model_f = torch.load(tmp_path / "flower" / "model.pt", weights_only=True)
    model_s = torch.load(tmp_path / "simulator" / "model.pt", weights_only=True)
    assert max_difference(model_f, model_s) == 0.0


@pytest.mark.slow
def test_flower_sample_level_dp_draws_os_noise_unless_told_otherwise(digits_data_dir, tmp_path, inside_a_run):
    """privacy=sample on Flower: the nodes' DP-SGD noise comes from the operating system when
    privacy.secure_noise is unset (two runs of one config differ), and is the simulator's seeded noise with
    privacy.secure_noise=false (the same server state to the bit)."""
    from test_flower import assert_same_state, reference

    settings = tiny_config(digits_data_dir, rounds=1, method="fedavg", privacy="sample",
                           **{"privacy.noise_multiplier": 1.0})
    _, state_a = run_in_process(settings, {}, WireGrid(), tmp_path / "a")
    _, state_b = run_in_process(settings, {}, WireGrid(), tmp_path / "b")
    assert max_difference(state_a, state_b) > 0
    seeded = {**settings, "privacy.secure_noise": False}
    _, state = run_in_process(seeded, {}, WireGrid(), tmp_path / "seeded")
    _, expected = reference(seeded, tmp_path / "simulator")
    assert_same_state(state, expected)


def lying_packer(monkeypatch, rounds: set[int] | None, nodes: int = 3):
    """Make the first node to pack in each round of ``rounds`` (all rounds: None) add 1 to the num_examples it
    packs (it claims one more sample than it holds: the sum cannot come from the summed clients)."""
    real = secagg.client_vector
    calls = []

    def lying(layout, server, reply, global_weights, metrics, num_samples, scale, clipping_range):
        vector = real(layout, server, reply, global_weights, metrics, num_samples, scale, clipping_range)
        round, position = divmod(len(calls), nodes)
        calls.append(round)
        if position == 0 and (rounds is None or round in rounds):
            start = 0
            for entry in layout.entries:
                if entry.name == "num_examples":
                    break
                start += entry.size
            vector = vector.copy()
            vector[start] += 1.0 / scale
        return vector

    monkeypatch.setattr(secagg, "client_vector", lying)


def test_an_invalid_secure_sum_skips_its_round_and_the_run_goes_on(digits_data_dir, tmp_path, inside_a_run,
                                                                  monkeypatch):
    """One node packs one sample more than it holds in round 0 (before: "every client failed ... invalid secure
    sum", the run ended naming no one). Round 0 is skipped with the global model kept, the summed clients named
    as the ones among whom the liar is (SecAgg+ hides which); round 1 sums as usual."""
    settings = tiny_config(digits_data_dir, method="fedavg", rounds=2)
    lying_packer(monkeypatch, {0})
    secure, _ = run_in_process(settings, SECURE, WireGrid(), tmp_path / "secure")
    first, second = secure.rows
    assert first["skipped"] is True
    assert [d["client"] for d in first["dropped"]] == [0, 1, 2]
    assert all("invalid secure sum (one or more of clients 0, 1, 2 sent it" in d["reason"] for d in first["dropped"])
    assert not second.get("skipped") and not second.get("dropped")
    assert secure.failed_sums == 0


def test_three_invalid_secure_sums_in_a_row_stop_the_run_in_one_line(digits_data_dir, tmp_path, inside_a_run,
                                                                     monkeypatch):
    settings = tiny_config(digits_data_dir, method="fedavg", rounds=4)
    lying_packer(monkeypatch, None)
    with pytest.raises(FedHProError, match="secure sum was invalid in 3 rounds in a row") as error:
        run_in_process(settings, SECURE, WireGrid(), tmp_path / "out")
    assert "\n" not in str(error.value)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["skipped"] for row in rows] == [True, True]
