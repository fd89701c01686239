"""A node that does not fit is refused, not the run.

The attacks, as found on an own-data Flower deployment (three sites holding cat and dog images):

1. a node describes data of another kind or input shape than the others', or 100,000 class names: the run
   stopped with a ConfigError at discovery, with or without a roster admitting the node. Now the node is left
   out with a warning (and partition.json's ``refused``) and the two others run; with no strict majority of
   kind and shape the run stops in one line;
2. a node declares 99,990 extra class names (under ``data.max_classes``): every round's download grew 208x and
   every site fell to chance. Now it adds more than the bound (the lower median of the nodes' class counts) and
   is left out; a class only one node holds (honest label skew) is named in a warning, not refused;
3. a FedProto node sends class rows of 1e30 (finite, but their squares overflow float32): every client's loss
   became non-finite and the run aborted in round 2. Now such rows (and non-finite ones) are refused as an
   invalid update by every engine;
4. a node's training metrics are inf, NaN or 1e308: they were accepted (the round's train loss became null).
   Now the reply is refused whole, as an invalid update.

The grid is ``run_server`` (the real ServerApp code) over the in-process grid whose nodes run the real
ClientApp on their own site folders (the pattern of test_discovery_denial.py); a hostile node is that
ClientApp with its answers rewritten on the way out. The expected values are written out by hand.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TinyNet, make_federation

from fedhpro.engines.replies import MAX_METRIC_VALUE, MAX_ROW_NORM, metrics_problem, rows_problem
from fedhpro.engines.simulator import Simulator
from fedhpro.errors import UpdateError
from fedhpro.methods import METHODS, TrainSettings

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")

from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict  # noqa: E402
from test_flower_own_data import write_site  # noqa: E402

from fedhpro.data.clients import ClientInfo, ClientsOptions, scan_client  # noqa: E402
from fedhpro.errors import ConfigError  # noqa: E402
from fedhpro.flower import records  # noqa: E402
from fedhpro.flower.local_grid import LocalGrid, inside_a_run  # noqa: E402
from fedhpro.flower.nodes import class_bound, misfits, node_classes, single_holders, untrained_tests  # noqa: E402
from fedhpro.flower.records import NODE_RECORD  # noqa: E402
from fedhpro.flower.server import run_server  # noqa: E402

SITES = {"clinic-0": ["cat", "dog"], "clinic-1": ["cat", "dog"], "clinic-2": ["cat", "dog"]}
HOSTILE = 102  # the node of clinic-2
TRAIN = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=0.0)


# ---------------------------------------------------------------------------- the rule, at the unit level


def info(name: str, classes: list[str] | None = None, kind: str = "images", shape: tuple[int, ...] = (3, 16, 16),
         max_label: int | None = None, declared: list[str] | None = None) -> ClientInfo:
    return ClientInfo(name, None, kind, classes, declared, max_label, list(shape), 24, 12)


def test_honest_nodes_fit_and_label_skew_is_named_not_refused():
    # test_flower_own_data's sites: counts 2, 2, 3; the bound is 2 and lab-0 adds one class (owl)
    skewed = {1: info("clinic-0", ["cat", "dog"]), 2: info("clinic-1", ["dog", "fox"]),
              3: info("lab-0", ["cat", "fox", "owl"])}
    assert misfits(skewed, ClientsOptions()) == {}
    assert single_holders(list(skewed.values())) == [("owl", "lab-0")]
    # every node's classes its own (disjoint label skew): each holds no more than the bound
    disjoint = {k: info(f"s{k}", [f"c{2 * k}", f"c{2 * k + 1}"]) for k in range(5)}
    assert misfits(disjoint, ClientsOptions()) == {}
    assert len(single_holders(list(disjoint.values()))) == 10
    # a node of more classes than the bound (4 > 2) adding no more than it (fox, owl: 2 <= 2)
    wider = {1: info("a", ["cat", "dog"]), 2: info("b", ["cat", "dog"]), 3: info("c", ["cat", "dog", "fox", "owl"])}
    assert misfits(wider, ClientsOptions()) == {}


def test_a_node_adding_more_classes_than_the_bound_is_refused():
    extra = [f"x{i}" for i in range(99_990)]
    liar = {1: info("clinic-0", ["cat", "dog"]), 2: info("clinic-1", ["cat", "dog"]),
            3: info("clinic-2", ["cat", "dog", *extra])}
    refused = misfits(liar, ClientsOptions())
    assert list(refused) == [3] and refused[3].startswith("it names 99990 classes that no node of at most 2 classes "
                                                          "names ('x0', 'x1', 'x10', 'x100', 'x1000', ... 99985 more),"
                                                          " more than 2")
    assert "list the federation's classes in data.classes" in refused[3]
    # one more than the bound: refused; exactly the bound: not
    assert list(misfits({**liar, 3: info("clinic-2", ["cat", "dog", "x", "y", "z"])}, ClientsOptions())) == [3]
    assert misfits({**liar, 3: info("clinic-2", ["cat", "dog", "x", "y"])}, ClientsOptions()) == {}
    # two liars sharing their invented names gain nothing by it (neither is a node of at most 2 classes)
    pair = {**liar, 4: info("clinic-3", ["cat", "dog", *extra]), 5: info("clinic-4", ["cat", "dog"])}
    assert sorted(misfits(pair, ClientsOptions())) == [3, 4]
    # labels by index count as classes 0..max_label; classes.txt counts too
    tensors = {k: info(f"t{k}", None, "tensors", (5,), max_label=1) for k in range(3)}
    assert misfits({**tensors, 2: info("t2", None, "tensors", (5,), max_label=99_999)}, ClientsOptions()) \
        .keys() == {2}
    assert node_classes(info("t", None, "tensors", (5,), max_label=2)) == {"0", "1", "2"}
    declared = {k: info(f"d{k}", ["cat"], declared=["cat", "dog"]) for k in range(3)}
    assert misfits({**declared, 2: info("d2", ["cat"], declared=["cat", "dog", *extra[:10]])}, ClientsOptions()) \
        .keys() == {2}


@pytest.mark.parametrize(("counts", "bound"), [([2, 2, 100_000], 2), ([2, 100_000], 2), ([1, 3, 5, 7], 3),
                                               ([0, 0, 0], 1), ([], 1)])
def test_the_class_bound_is_the_lower_median_at_least_one(counts, bound):
    assert class_bound(counts) == bound


def test_a_node_of_another_kind_or_shape_than_the_strict_majority_is_refused():
    nodes = {1: info("a", ["cat", "dog"]), 2: info("b", ["cat", "dog"]), 5: info("e", ["cat", "dog"]),
             3: info("c", None, "tensors", (5,), max_label=1), 4: info("d", ["cat", "dog"], shape=(3, 32, 32))}
    refused = misfits(nodes, ClientsOptions())
    assert sorted(refused) == [3, 4]
    assert refused[3] == ("its data (tensors of shape [5]) differ from those of the strict majority of the "
                          "admitted nodes (images of shape [3, 16, 16], 3 of 5); give it the same kind of data and "
                          "features")
    assert refused[4].startswith("its data (images of shape [3, 32, 32]) differ")
    # no strict majority (3 of 6, or 2 of 4, is not one): nobody can say who is right; one line naming the groups
    for more in ({6: info("f", None, "tensors", (5,), max_label=1)}, {}):
        crowd = {**nodes, **more} if more else {k: v for k, v in nodes.items() if k != 5}
        with pytest.raises(ConfigError) as caught:
            misfits(crowd, ClientsOptions())
        message = str(caught.value)
        assert "\n" not in message and message.startswith("the admitted nodes' data differ in kind or input shape "
                                                          "and no strict majority agrees (images of shape "
                                                          "[3, 16, 16]: a, b"), message
        assert "tensors of shape [5]: c" in message and "images of shape [3, 32, 32]: d" in message
    # two nodes that disagree: no majority either
    with pytest.raises(ConfigError, match="no strict majority agrees"):
        misfits({1: nodes[1], 3: nodes[3]}, ClientsOptions())


def test_with_data_classes_a_node_naming_other_classes_is_refused_and_the_bound_is_the_list():
    options = ClientsOptions(classes=["cat", "dog", "fox"])
    nodes = {1: info("a", ["cat", "dog"]), 2: info("b", ["fox"]), 3: info("c", ["cat", "owl"]),
             4: info("d", None, "tensors", (5,), max_label=3)}
    refused = misfits({k: v for k, v in nodes.items() if k != 4}, options)
    assert refused == {3: "it names 1 classes that data.classes does not list ('owl'); add them to data.classes or "
                          "fix its labels"}
    tensors = {k: info(f"t{k}", None, "tensors", (5,), max_label=2) for k in range(3)}
    assert misfits({**tensors, 2: info("t2", None, "tensors", (5,), max_label=3)}, options).keys() == {2}
    assert misfits({**tensors, 2: info("t2", None, "tensors", (5,), max_label=3)},
                   ClientsOptions(num_classes=3)).keys() == {2}


# ---------------------------------------------------------------------------- on the ServerApp, over a grid


def describing(**changes: Any):
    """A node that describes its folder with ``changes`` made to its true description."""

    def forge(kind, header, reply, message):
        if kind == MessageType.QUERY and str(header["query"]) == "data":
            described = json.loads(str(reply.content.config_records[NODE_RECORD]["info"]))
            described.update(changes)
            return Message(RecordDict({NODE_RECORD: ConfigRecord({"info": json.dumps(described)})}),
                           reply_to=message)
        return reply

    return forge


@pytest.fixture(autouse=True)
def _inside_a_run(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):  # put back after the test
        monkeypatch.setattr(TaskIdentity, name, getattr(TaskIdentity, name, None))
    inside_a_run()  # outside a run, flwr refuses to address a Message


@pytest.fixture(scope="module")
def sites(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sites")
    for k, (site, classes) in enumerate(SITES.items()):
        write_site(root / site, classes, seed=k, train=12, test=6)  # 24 training, 12 test images each
    return {site: root / site for site in SITES}


def own_run(sites: dict[str, Path], tmp: Path, forge=None, **config) -> Path:
    folders = {100 + k: folder for k, folder in enumerate(sites.values())}
    out = tmp / "out"
    settings = {"dataset": "clients", "method": "fedavg", "rounds": 1, "clients": 3, "feature_dim": 8,
                "local_epochs": 1, "batch_size": 8, "data.image_size": 16, "device": "cpu", "progress": False,
                "seed": 3, "flower.node-wait": 2, "out": str(out), **config}
    run_server(LocalGrid(folders, tmp / "state", forge), settings)
    return out


def rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def partition(out: Path) -> dict[str, Any]:
    return json.loads((out / "partition.json").read_text())


def write_roster(tmp: Path) -> Path:
    roster = tmp / "roster.yaml"
    roster.write_text("sites:\n" + "".join(f"  {site}: {{train: 24, test: 12}}\n" for site in SITES))
    return roster


EXTRA = [f"class-{i:05d}" for i in range(99_990)]
MISFITS = {
    "99990-extra-classes": ({"class_names": ["cat", "dog", *EXTRA]}, "it names 99990 classes that no node of at most "
                                                                     "2 classes names"),
    "100000-classes": ({"class_names": [f"c{i:06d}" for i in range(100_000)]}, "it names 100000 classes"),
    "input-shape": ({"input_shape": [3, 32, 32]}, "its data (images of shape [3, 32, 32]) differ from those of the "
                                                  "strict majority of the admitted nodes (images of shape "
                                                  "[3, 16, 16], 2 of 3)"),
    "data-kind": ({"kind": "tensors", "class_names": None, "max_label": 1, "input_shape": [5]},
                  "its data (tensors of shape [5]) differ"),
}


@pytest.mark.parametrize(("attack", "roster"), [(attack, False) for attack in MISFITS]
                         + [("99990-extra-classes", True), ("input-shape", True)],
                         ids=[*MISFITS, "99990-extra-classes-roster-admits-it", "input-shape-roster-admits-it"])
def test_a_node_that_does_not_fit_is_refused_and_the_run_goes_on(sites, tmp_path, caplog, attack, roster):
    changes, why = MISFITS[attack]
    extra = {"clients": None, "flower.roster": str(write_roster(tmp_path))} if roster else {}
    with caplog.at_level(logging.WARNING):
        out = own_run(sites, tmp_path, {HOSTILE: describing(**changes)}, **extra)
    record = partition(out)
    assert [client["name"] for client in record["clients"]] == ["clinic-0", "clinic-1"]
    assert record["classes"] == ["cat", "dog"] and record["num_classes"] == 2  # the run's size is the honest one
    assert [item["node"] for item in record["refused"]] == [HOSTILE] and why in record["refused"][0]["reason"]
    assert f"node {HOSTILE} is refused: {why}" in caplog.text
    warning = next(line for line in caplog.text.splitlines() if "the run goes on" in line)
    assert "2 of 3 data-holding SuperNodes were admitted (clinic-0, clinic-1)" in warning and "after" not in warning
    if roster:
        assert warning.endswith("the roster's sites without a node: clinic-2"), warning
    (row,) = rows(out)
    assert row["participants"] == [0, 1] and "dropped" not in row
    model = torch.load(out / "model.pt", weights_only=True)
    # 54,234 parameters of 2 classes (a head of 100,000 classes alone would hold 800,000 at d = 8)
    assert sum(value.numel() for value in model.get("weights", model).values()) < 100_000
    assert "takes no part in this run" not in caplog.text  # refused at discovery: never asked again


def test_with_no_strict_majority_of_kind_and_shape_the_run_stops_in_one_line(sites, tmp_path):
    forge = {101: describing(input_shape=[3, 32, 32]), HOSTILE: describing(**MISFITS["data-kind"][0])}
    with pytest.raises(ConfigError) as caught:
        own_run(sites, tmp_path, forge)
    message = str(caught.value)
    assert "\n" not in message and message == (
        "the admitted nodes' data differ in kind or input shape and no strict majority agrees (images of shape "
        "[3, 16, 16]: clinic-0; images of shape [3, 32, 32]: clinic-1; tensors of shape [5]: clinic-2); give every "
        "SuperNode the same kind of data and features")


def test_too_few_fitting_nodes_stop_the_run_in_one_line(sites, tmp_path):
    # flower.min-clients=3: the operator needs all three; one refused for its classes leaves two
    with pytest.raises(ConfigError) as caught:
        own_run(sites, tmp_path, {HOSTILE: describing(**MISFITS["99990-extra-classes"][0])},
                **{"flower.min-clients": 3})
    message = str(caught.value)
    assert "\n" not in message and message.startswith("only 2 of 3 data-holding SuperNodes answered (clinic-0, "
                                                      "clinic-1; at least 3 needed); refused: node 102: it names "
                                                      "99990 classes"), message


def test_a_class_only_one_node_holds_is_named_not_refused(tmp_path, caplog):
    root = tmp_path / "skewed"
    skewed = {"clinic-0": ["cat", "dog"], "clinic-1": ["dog", "fox"], "lab-0": ["cat", "fox", "owl"]}
    for k, (site, classes) in enumerate(skewed.items()):
        write_site(root / site, classes, seed=k, train=4, test=2)
    with caplog.at_level(logging.WARNING):
        out = own_run({site: root / site for site in skewed}, tmp_path)
    assert partition(out)["classes"] == ["cat", "dog", "fox", "owl"] and "refused" not in partition(out)
    assert "classes only one node holds: 'owl' (lab-0); not refused (honest label skew has them)" in caplog.text


# ---------------------------------------------------------------------------- class rows and metrics, every engine


@pytest.mark.parametrize(("value", "refused"), [
    (0.5, None), (-3, None), (MAX_METRIC_VALUE, None), (-MAX_METRIC_VALUE, None), (torch.tensor(2.0), None),
    (math.inf, "training metric 'loss' is inf, not a finite number"),
    (-math.inf, "training metric 'loss' is -inf, not a finite number"),
    (math.nan, "training metric 'loss' is nan, not a finite number"),
    (1e308, "training metric 'loss' is 1e+308, beyond +-1e+30"),
    (-1e31, "training metric 'loss' is -1e+31, beyond +-1e+30"),
    (True, "training metric 'loss' is a bool, not a number"), ("0.5", "training metric 'loss' is a str, not a number"),
])
def test_a_training_metric_must_be_a_finite_bounded_number(value, refused):
    assert metrics_problem({"accuracy": 50.0, "loss": value}) == refused
    # n_k-weighted sums of bounded metrics cannot overflow: a billion samples at the bound, a million clients
    assert math.isfinite(1e9 * MAX_METRIC_VALUE * 1e6)


@pytest.mark.parametrize("value", [math.inf, math.nan, 1e308])
def test_flower_metric_records_refuse_non_finite_and_unbounded_values(value):
    content = RecordDict({records.METRICS: MetricRecord({"loss": value})})
    with pytest.raises(UpdateError, match="training metric 'loss' is") as caught:
        records.decode_metrics(content)
    assert "\n" not in str(caught.value)
    assert records.decode_metrics(RecordDict({records.METRICS: MetricRecord({"loss": 1e30})})) == {"loss": 1e30}


def test_class_rows_a_client_holds_must_be_finite_and_bounded():
    counts = torch.tensor([3, 0, 2])
    rows = torch.ones(3, 4)
    assert rows_problem({"prototypes": rows, "class_counts": counts}, ["prototypes"]) is None
    for bad, words in [(math.nan, "NaN or Inf"), (math.inf, "NaN or Inf"), (1e30, "L2 norm 2e+30, beyond 1e+15")]:
        held = rows.clone()
        held[2] = bad
        problem = rows_problem({"prototypes": held, "class_counts": counts}, ["prototypes"])
        assert problem is not None and words in problem, problem
        unheld = rows.clone()
        unheld[1] = bad  # a class the client does not hold: never read, as the methods' own checks skip it
        assert rows_problem({"prototypes": unheld, "class_counts": counts}, ["prototypes"]) is None
    # the bound itself passes (a row of norm exactly 1e15: 4 entries of 5e14), one step above does not
    edge = torch.zeros(3, 4, dtype=torch.float64)
    edge[0] = MAX_ROW_NORM / 2
    assert rows_problem({"prototypes": edge, "class_counts": counts}, ["prototypes"]) is None
    edge[0] *= 1.0001
    assert "beyond 1e+15" in rows_problem({"prototypes": edge, "class_counts": counts}, ["prototypes"])
    # without counts every row is held; undeclared keys are not looked at
    assert "soft_predictions" in rows_problem({"soft_predictions": torch.full((2, 2), 1e30)}, ["soft_predictions"])
    assert rows_problem({"other": torch.full((2, 2), math.nan)}, ["prototypes"]) is None


def liar_in_simulator(method: str, rows: float | None = None, metrics: dict[str, float] | None = None) -> Simulator:
    """A 3-client simulator whose client 2 sends its held class rows as ``rows`` or its metrics as ``metrics``."""
    federation = make_federation([24, 24, 24], seed=1)
    sim = Simulator(METHODS[method], METHODS[method].options(), federation, TinyNet, TRAIN, rounds=2, seed=0)
    original = sim.client.fit
    sim.measured = {}  # client -> the metrics its training measured (before the liar's are rewritten)

    def fit(model, payload, data, state, generator):
        reply, measured = original(model, payload, data, state, generator)
        sim.measured[next(k for k, client in enumerate(sim.federation.clients) if client is data)] = measured
        if data is sim.federation.clients[2]:
            if rows is not None:
                reply = {**reply, "prototypes": torch.full_like(reply["prototypes"], rows)}
            if metrics is not None:
                measured = {**measured, **metrics}
        return reply, measured

    sim.client.fit = fit
    return sim


def test_simulator_fedproto_rows_of_1e30_are_refused_and_the_run_goes_on():
    sim = liar_in_simulator("fedproto", rows=1e30)
    records_ = [sim.run_round(0).to_json(), sim.run_round(1).to_json()]  # the attack aborted round 2
    for row in records_:
        assert row["participants"] == [0, 1, 2]
        assert row["dropped"] == [{"client": 2, "reason": "invalid update: prototypes holds a class row of L2 norm "
                                                          "4e+30, beyond 1e+15 (its square would overflow the "
                                                          "model's arithmetic)"}]
        assert all(math.isfinite(value) for value in row["train"].values()), row["train"]
    assert bool(torch.isfinite(sim.server.prototypes).all())
    assert float(sim.server.prototypes.abs().max()) < 1e3  # the honest clients' mean, not the liar's


@pytest.mark.parametrize("value", [math.inf, math.nan, 1e308])
def test_simulator_a_reply_with_non_finite_metrics_is_refused_whole(value):
    honest = liar_in_simulator("fedavg")
    honest_row = honest.run_round(0).to_json()
    sim = liar_in_simulator("fedavg", metrics={"loss": value})
    row = sim.run_round(0).to_json()
    (dropped,) = row["dropped"]
    assert dropped["client"] == 2 and dropped["reason"].startswith("invalid update: training metric 'loss' is")
    # refused whole: not measured (the bytes of the two others), its metrics not in the round's mean, which is
    # clients 0 and 1's (24 samples each), by hand from what their training measured
    assert row["bytes_up"] == honest_row["bytes_up"] * 2 // 3
    for name in ("ce", "loss"):
        assert row["train"][name] == pytest.approx((sim.measured[0][name] + sim.measured[1][name]) / 2, rel=1e-12)


def test_simulator_honest_rounds_are_unchanged_by_the_checks():
    # the checks only look: an honest FedProto round passes every reply untouched (no drop, finite rows)
    sim = liar_in_simulator("fedproto")
    row = sim.run_round(0).to_json()
    assert "dropped" not in row and row["participants"] == [0, 1, 2]


def forged_train(rows: float | None = None, metrics: dict[str, float] | None = None):
    """A node whose training replies carry its prototypes as ``rows`` (every held row) or ``metrics``."""

    def forge(kind, header, reply, message):
        if kind != MessageType.TRAIN:
            return reply
        payload = records.decode_payload(reply.content)
        if rows is not None:
            payload["prototypes"] = torch.full_like(payload["prototypes"], rows)
        measured = records.decode_metrics(reply.content)
        if metrics is not None:
            measured = {**measured, **metrics}
        content = RecordDict({**records.encode_payload(payload), records.METRICS: MetricRecord(measured)})
        return Message(content, reply_to=message)

    return forge


def test_flower_fedproto_rows_of_1e30_are_refused_and_the_run_goes_on(sites, tmp_path):
    out = own_run(sites, tmp_path, {HOSTILE: forged_train(rows=1e30)}, method="fedproto", rounds=2)
    for row in rows(out):  # the attack: "every client failed ... non-finite loss" in round 2
        assert row["participants"] == [0, 1, 2]
        assert row["dropped"] == [{"client": 2, "reason": "invalid update: prototypes holds a class row of L2 norm "
                                                          "2.83e+30, beyond 1e+15 (its square would overflow the "
                                                          "model's arithmetic)"}]
        assert all(math.isfinite(value) for value in row["train"].values()), row["train"]
    assert json.loads((out / "summary.json").read_text())["accuracy"] is not None


def test_flower_a_reply_with_non_finite_metrics_is_refused_whole(sites, tmp_path):
    # NaN and 1e308 take the same path (decode_metrics, above)
    out = own_run(sites, tmp_path, {HOSTILE: forged_train(metrics={"loss": math.inf})})
    (row,) = rows(out)
    (dropped,) = row["dropped"]
    assert dropped["client"] == 2 and dropped["reason"].startswith("invalid update: training metric 'loss' is")
    assert row["train"]["loss"] is not None and math.isfinite(row["train"]["loss"])


def test_a_classes_txt_other_than_the_strict_majority_s_is_refused():
    listed = ["cat", "dog"]
    nodes = {k: info(f"s{k}", ["cat"], declared=listed) for k in range(3)}
    refused = misfits({**nodes, 2: info("s2", ["cat"], declared=["cat", "dog", "fox"])}, ClientsOptions())
    assert refused == {2: "its classes.txt (3 classes) differs from that of the strict majority of the nodes that have "
                          "one (2 classes, 2 of 3); give it the same class list, or set data.classes"}
    # nodes without a classes.txt do not vote; one against one is no majority (resolve_classes names them)
    pair = {0: nodes[0], 1: info("s1", ["cat"], declared=["dog", "cat"]), 2: info("s2", ["cat"])}
    assert misfits(pair, ClientsOptions()) == {}
    # data.num_classes bounds labels by index, and a named node is still bounded by the class counts
    extra = [f"x{i}" for i in range(50)]
    named = {k: info(f"n{k}", ["cat", "dog"]) for k in range(3)}
    assert misfits({**named, 2: info("n2", ["cat", "dog", *extra])}, ClientsOptions(num_classes=2)).keys() == {2}


# ---------------------------------------------------------------------------- a class tested where none trains it


def test_untrained_tests_names_the_classes_some_node_tests_and_none_trains():
    nodes = {1: ClientInfo("a", None, "tensors", None, None, 2, [4], 10, 5, ["0", "1"], ["0", "2"]),
             2: ClientInfo("b", None, "tensors", None, None, 3, [4], 10, 5, ["1"], ["1", "3"]),
             3: ClientInfo("c", None, "tensors", None, None, 1, [4], 10, 5, ["2"], ["1"])}
    assert untrained_tests(nodes) == {2: ["3"]}  # "2" is tested at a, trained at c: learned
    assert untrained_tests({1: nodes[1]}) == {1: ["2"]}


@pytest.mark.parametrize("keep", [False, True], ids=["refused", "kept"])
def test_flower_a_node_testing_a_class_no_node_trains_is_named(tmp_path, caplog, keep):
    """Each node sees its own data only, so the server tells a class tested but trained nowhere from the
    nodes' class lists per split: the node is left out (the run goes on), or, with
    data.untrained_classes=keep, the class is named in a warning."""
    root = tmp_path / "sites"
    for k, site in enumerate(SITES):
        write_site(root / site, ["cat", "dog"], seed=k, train=4, test=2)
    write_site(root / "owl-tests", ["owl"], seed=9, train=0, test=2)  # test/owl/ only
    (root / "owl-tests" / "test" / "owl").rename(root / "clinic-2" / "test" / "owl")
    assert scan_client(root / "clinic-2", ClientsOptions()).test_classes == ["cat", "dog", "owl"]
    extra = {"data.untrained_classes": "keep"} if keep else {}
    with caplog.at_level(logging.WARNING):
        out = own_run({site: root / site for site in SITES}, tmp_path, **extra)
    record = partition(out)
    if keep:
        assert record["classes"] == ["cat", "dog", "owl"] and "refused" not in record
        assert ("test samples of classes no admitted node trains (clinic-2: 'owl'): never learned, they count as "
                "errors (data.untrained_classes=keep)") in caplog.text
    else:
        assert record["classes"] == ["cat", "dog"] and [c["name"] for c in record["clients"]] == ["clinic-0",
                                                                                                  "clinic-1"]
        assert ("its test samples hold 1 class that no admitted node trains ('owl'): the model never learns them"
                in record["refused"][0]["reason"])
