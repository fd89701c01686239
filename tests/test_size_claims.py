"""Sizes are claims: what one participant can buy by declaring them (``aggregation.max_share``, the roster).

The attack, as found on a secured own-data deployment: a third node declares 10^9 training and test samples,
sends all-zero weights and forges its evaluation (``correct = total = 10^9``). Without a bound it zeroes the
global model and reports 99.99999 %; here the global model moves no further than an honest node of the
capped size could move it, and the headline accuracy is not the forged one. On both engines:

* Flower: ``run_server`` (the real ServerApp code) over an in-process grid whose nodes run the real ClientApp
  on their own site folders; the hostile node is that ClientApp with its answers rewritten on the way out;
* the simulator: a client that holds far more samples than the others and sends zeros.

The references are independent of the code under test: a closed-form water-filling cap, a bisection for it,
the FedAvg mean written out by hand, and a run where the hostile node honestly holds the capped size.
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
from hypothesis import given, settings
from hypothesis import strategies as st

from fedhpro.aggregation import claim_cap, lower_median, share_cap
from fedhpro.config import AggregationOptions
from fedhpro.engines.evaluation import TestCount as Count
from fedhpro.engines.evaluation import pool_accuracy
from fedhpro.engines.replies import capped_reply
from fedhpro.engines.simulator import Simulator
from fedhpro.methods import METHODS, TrainSettings

TRAIN = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=0.0)
CLAIM = 10 ** 9


# ---------------------------------------------------------------------------- the cap, against references


def bisected_cap(sizes: list[float], share: float) -> float:
    """The water-filling cap found by bisection on ``c = share * sum(min(n, c))`` (an independent reading)."""
    positive = [n for n in sizes if n > 0]
    if not positive or share >= 1 or max(positive) <= share * sum(positive):
        return math.inf
    if share * len(positive) <= 1:
        return min(positive)
    low, high = 0.0, max(positive)  # f(c) = share * sum(min(n, c)) - c: > 0 below the cap, < 0 above it
    for _ in range(200):
        middle = (low + high) / 2
        if share * sum(min(n, middle) for n in positive) - middle > 0:
            low = middle
        else:
            high = middle
    return (low + high) / 2


@pytest.mark.parametrize(("sizes", "share", "cap"), [
    ([100, 100, CLAIM], 0.5, 200.0),  # the attack: the liar weighs as much as the two others together
    ([10, 10, 10, 70], 0.5, 30.0),  # c = 0.5 * (30 + c)
    ([1, 1, 1, 1000], 0.3, 0.9 / 0.7),  # c = 0.3 * (3 + c)
    ([100, 200, 300], 0.5, math.inf),  # 300 / 600 is not above half: nothing to cap
    ([5, 50], 0.4, 5.0),  # 0.4 * 2 < 1: no cap keeps both below 40 %, so both weigh the same
    ([7, 7, 7], 0.2, 7.0),
    ([3, 0, 9], 1.0, math.inf),
])
def test_share_cap_hand_values(sizes, share, cap):
    assert share_cap(sizes, share) == pytest.approx(cap)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 10 ** 12), min_size=1, max_size=12), st.floats(0.05, 1.0))
def test_share_cap_of_hostile_claims_matches_bisection_and_bounds_every_share(sizes, share):
    """Well-formed but hostile claims (up to 10^12, zeros, one giant among small ones): the cap equals the
    bisection's, and with it no client holds more than ``share`` of the total (when that can be kept)."""
    cap = share_cap(sizes, share)
    reference = bisected_cap(sizes, share)
    if math.isinf(reference):
        assert math.isinf(cap)
        return
    assert cap == pytest.approx(reference, rel=1e-9)
    weights = [min(n, cap) for n in sizes if n > 0]
    if share * len(weights) > 1:
        assert max(weights) <= share * sum(weights) * (1 + 1e-9)
    else:
        assert len(set(weights)) == 1


@pytest.mark.parametrize(("sizes", "median"), [
    ([5, 1, 3, 2], 2.0), ([24, 24, CLAIM], 24.0), ([24, CLAIM], 24.0), ([7], 7.0), ([0, 9, 4], 4.0), ([0], math.nan)])
def test_lower_median_hand_values(sizes, median):
    assert lower_median(sizes) == pytest.approx(median, nan_ok=True)


@pytest.mark.parametrize(("sizes", "share", "ratio", "cap"), [
    ([24, 24, CLAIM], 0.75, 2.0, 48.0),  # 2 x the median 24, far below the share cap's 144
    ([24] * 9 + [CLAIM], 0.75, 2.0, 48.0),  # among 10 sites the share cap would leave 648
    ([24, CLAIM], 0.75, 2.0, 48.0),  # two sites: the lower median is the honest one's
    ([24, 24, CLAIM], 0.75, 0.0, 144.0),  # no ratio: the share cap alone, c = 0.75 * (48 + c)
    ([24, 30, 40], 0.75, 2.0, math.inf),  # 40 <= 2 x 30 and <= 3/4 of 94: nothing binds
    ([10, 10, 100], 0.5, 4.0, 20.0),  # the share cap binds first: c = 0.5 * (20 + c) = 20 < 4 x 10
    ([10, 10, 100], 0.75, 1.0, 10.0),  # ratio 1: nobody above the median site
])
def test_claim_cap_hand_values(sizes, share, ratio, cap):
    assert claim_cap(sizes, share, ratio) == pytest.approx(cap)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 60), st.integers(1, 10 ** 6), st.integers(1, 10 ** 12), st.floats(1.0, 8.0))
def test_one_liar_among_equal_sites_weighs_at_most_ratio_median_sites(sites, size, claim, ratio):
    """One liar claiming anything among ``sites - 1`` honest sites of one size: its share of the weight is at
    most ``r / (r + K - 1)`` (it weighs as at most ``r`` honest sites), falling with the number of sites."""
    sizes = [size] * (sites - 1) + [claim]
    cap = claim_cap(sizes, 1.0, ratio)
    weights = [min(n, cap) for n in sizes]
    assert weights[-1] / sum(weights) <= ratio / (ratio + sites - 1) * (1 + 1e-12)


def test_a_forged_test_count_buys_no_more_than_the_median_bound():
    """Where test sizes are claims: a site claiming 10^9 test samples, all right, among two honest sites of 12
    (6 right each) counts as 2 x 12 = 24 samples: (6 + 6 + 24) / (12 + 12 + 24) = 75 %, not 87.5 %; the median
    site's accuracy (50 %) stays the honest one."""
    counts = [Count("all", 6, 12), Count("all", 6, 12), Count("all", CLAIM, CLAIM)]
    # the share cap alone: c = 0.75 * (24 + c) = 72, (6 + 6 + 72) / (12 + 12 + 72): the 87.5 % found
    assert pool_accuracy(counts, max_share=0.75)["AVG"] == pytest.approx(87.5)
    assert pool_accuracy(counts, max_share=0.75, max_ratio=2.0) == {"all": 75.0, "AVG": 75.0}


def test_a_capped_reply_keeps_which_classes_it_holds():
    reply = {"weights": {}, "num_examples": 1000, "class_counts": torch.tensor([990, 9, 0, 1])}
    capped = capped_reply(reply, 100)
    assert capped["num_examples"] == 100
    assert capped["class_counts"].tolist() == [99, 1, 0, 1]  # floor(count / 10), a held class stays >= 1
    assert capped["class_counts"].dtype == torch.int64
    assert reply["num_examples"] == 1000 and reply["class_counts"].tolist() == [990, 9, 0, 1]  # not changed


def test_a_forged_test_count_buys_no_more_than_the_cap():
    honest = [Count("all", 33, 100), Count("all", 33, 100)]
    forged = pool_accuracy([*honest, Count("all", CLAIM, CLAIM)], max_share=0.5)
    assert pool_accuracy([*honest, Count("all", CLAIM, CLAIM)], max_share=1.0)["AVG"] > 99.99  # the attack
    # the same as an honest site of the capped size (200) that got everything right: (33 + 33 + 200) / 400
    assert forged == pool_accuracy([*honest, Count("all", 200, 200)]) == {"all": 66.5, "AVG": 66.5}
    # nothing binds: the plain pooled ratio, to the bit
    plain = [Count("a", 7, 9), Count("a", 5, 8), Count("b", 3, 11)]
    assert pool_accuracy(plain, max_share=0.6) == {"a": 100 * 12 / 17, "b": 100 * 3 / 11,
                                                   "AVG": (100 * 12 / 17 + 100 * 3 / 11) / 2}


# ---------------------------------------------------------------------------- the simulator


def zeros_from(sim: Simulator, hostile: int) -> None:
    """Client ``hostile`` trains as usual and then sends all-zero weights (a well-formed, harmful reply)."""
    original = sim.client.fit

    def fit(model, payload, data, state, generator):
        reply, metrics = original(model, payload, data, state, generator)
        if data is sim.federation.clients[hostile]:
            reply = {**reply, "weights": {k: torch.zeros_like(v) for k, v in reply["weights"].items()}}
        return reply, metrics

    sim.client.fit = fit


def first_round(sizes: list[int], max_share: float) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    federation = make_federation(sizes, seed=1)
    sim = Simulator(METHODS["fedavg"], METHODS["fedavg"].options(), federation, TinyNet, TRAIN, rounds=1, seed=0,
                    aggregation=AggregationOptions(max_share=max_share))
    zeros_from(sim, hostile=2)
    before = {k: v.clone() for k, v in sim.server.global_weights().items()}
    row = sim.run_round(0).to_json()
    assert before  # the model had weights to lose
    return sim.server.global_weights(), row


def test_simulator_a_client_of_many_samples_sending_zeros_moves_the_model_as_far_as_the_capped_size():
    capped, row = first_round([24, 24, 480], 0.75)  # the default: c = 0.75 * (48 + c) = 144
    honest_size, _ = first_round([24, 24, 144], 1.0)  # the hostile client honestly holding the cap
    uncapped, _ = first_round([24, 24, 480], 1.0)
    assert row["capped"] == [{"client": 2, "claimed": 480, "weight": 144}]
    for key in capped:
        if capped[key].is_floating_point():
            assert torch.equal(capped[key], honest_size[key]), key
    # by hand: (24 w0 + 24 w1 + 144 * 0) / 192 = a quarter of the honest mean; 480 samples leave 48/528 of it
    norm = sum(float(v.double().norm() ** 2) for v in capped.values() if v.is_floating_point()) ** 0.5
    norm_uncapped = sum(float(v.double().norm() ** 2) for v in uncapped.values() if v.is_floating_point()) ** 0.5
    assert norm_uncapped == pytest.approx(norm * (48 / 528) / (48 / 192), rel=1e-5)


def test_simulator_knows_the_sizes_so_the_median_bound_leaves_a_skewed_federation_alone():
    """The simulator's sizes are the data it holds, not claims: a client 20x the median keeps its weight under
    aggregation.max_ratio (only the share cap, which it does not reach, applies), to the bit."""
    federation = make_federation([24, 24, 480], seed=1)
    rows, models = [], []
    for ratio in (2.0, 0.0):
        sim = Simulator(METHODS["fedavg"], METHODS["fedavg"].options(), federation, TinyNet, TRAIN, rounds=1,
                        seed=0, aggregation=AggregationOptions(max_share=1.0, max_ratio=ratio))
        assert not sim.protocol.sizes_claimed and math.isinf(sim.protocol.weight_cap())
        rows.append(sim.run_round(0).to_json())
        models.append(sim.server.global_weights())
    assert "capped" not in rows[0] and rows[0]["train"] == rows[1]["train"]
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])


def test_simulator_without_a_dominant_client_is_unchanged_to_the_bit():
    a, row_a = first_round([24, 32, 40], 0.45)
    b, row_b = first_round([24, 32, 40], 1.0)
    assert "capped" not in row_a and row_a == row_b
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------- Flower


pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")

from flwr.app import ConfigRecord, Message, MessageType, RecordDict  # noqa: E402
from test_flower_own_data import write_site  # noqa: E402

from fedhpro.errors import ConfigError  # noqa: E402
from fedhpro.flower import records  # noqa: E402
from fedhpro.flower.local_grid import LocalGrid, inside_a_run  # noqa: E402
from fedhpro.flower.server import EVAL_RECORD, NODE_RECORD, run_server  # noqa: E402

SITES = {"clinic-0": ["cat", "dog"], "clinic-1": ["cat", "dog"], "clinic-2": ["cat", "dog"]}


def liar(train: int, test: int, correct: int):
    """The hostile node: declares ``train`` / ``test`` samples, sends all-zero weights with
    ``num_examples = train`` and answers every evaluation with ``correct`` of ``test``."""

    def forge(kind, header, reply, message):
        if kind == MessageType.QUERY and str(header["query"]) == "data":
            info = json.loads(str(reply.content.config_records[NODE_RECORD]["info"]))
            info.update(train_size=train, test_size=test)
            return Message(RecordDict({NODE_RECORD: ConfigRecord({"info": json.dumps(info)})}), reply_to=message)
        if kind == MessageType.TRAIN:
            payload = records.decode_payload(reply.content)
            payload["weights"] = {k: torch.zeros_like(v) for k, v in payload["weights"].items()}
            payload["num_examples"] = train
            metrics = records.METRICS
            content = RecordDict({**records.encode_payload(payload), metrics: reply.content[metrics]})
            return Message(content, reply_to=message)
        if kind == MessageType.EVALUATE:
            record = reply.content.config_records[EVAL_RECORD]
            return Message(RecordDict({EVAL_RECORD: ConfigRecord(
                {"test-set": record["test-set"], "correct": correct, "total": test})}), reply_to=message)
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


def own_run(sites: dict[str, Path], tmp: Path, forge=None, keys=None, extra_nodes=None, **config) -> Path:
    folders = {100 + k: folder for k, folder in enumerate(sites.values())}
    folders.update(extra_nodes or {})
    out = tmp / "out"
    grid = LocalGrid(folders, tmp / "state", forge, keys)
    settings = {"dataset": "clients", "method": "fedavg", "rounds": 2, "clients": 3, "feature_dim": 8,
                "local_epochs": 1, "batch_size": 8, "data.image_size": 16, "device": "cpu", "progress": False,
                "seed": 3, "flower.node-wait": 2, "out": str(out), **config}
    run_server(grid, settings)
    return out


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def model_norm(out: Path) -> float:
    state = torch.load(out / "model.pt", weights_only=True)
    weights = state.get("weights", state) if isinstance(state, dict) else state
    tensors = [v for v in weights.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return sum(float(t.double().norm() ** 2) for t in tensors) ** 0.5


def model_weights(out: Path) -> dict[str, torch.Tensor]:
    state = torch.load(out / "model.pt", weights_only=True)
    return state.get("weights", state)


@pytest.mark.parametrize(("bound", "train_cap", "test_cap"), [
    ({}, 48, 24),  # the default aggregation.max_ratio=2: twice the median site's 24 training / 12 test samples
    ({"aggregation.max_ratio": 0.0}, 144, 72),  # the share cap alone: c = 0.75 * (24 + 24 + c); 0.75 * (24 + c)
])
def test_flower_a_node_claiming_a_billion_samples_buys_only_the_capped_weight(sites, tmp_path, bound, train_cap,
                                                                               test_cap):
    """The attack as found: node clinic-2 declares 10^9 train and test samples, sends zeros, forges its
    evaluation. Unbounded it owns the model and the accuracy; bounded the run equals one where that node
    honestly holds the capped sizes and answers as well as it can (all of its test samples right)."""
    hostile = 102
    owned = own_run(sites, tmp_path / "unbounded", {hostile: liar(CLAIM, CLAIM, CLAIM)},  # no bound at all
                    **{"aggregation.max_share": 1.0, "aggregation.max_ratio": 0.0, "aggregation.update_bound": "off"})
    summary = read_json(owned / "summary.json")
    assert summary["accuracy"] > 99.99 and model_norm(owned) < 1e-6  # what the attacker bought before

    capped = own_run(sites, tmp_path / "capped", {hostile: liar(CLAIM, CLAIM, CLAIM)}, **bound)
    reference = own_run(sites, tmp_path / "reference", {hostile: liar(train_cap, test_cap, test_cap)},
                        **{"aggregation.max_share": 1.0, "aggregation.max_ratio": 0.0})
    rows = [json.loads(line) for line in (capped / "metrics.jsonl").read_text().splitlines()]
    assert [row["capped"] for row in rows] == [[{"client": 2, "claimed": CLAIM, "weight": train_cap}]] * 2
    expected = model_weights(reference)
    for key, value in model_weights(capped).items():
        if value.is_floating_point():
            assert torch.equal(value, expected[key]), key
    summary = read_json(capped / "summary.json")
    headline = summary["accuracy"]
    assert headline == read_json(reference / "summary.json")["accuracy"]
    # by hand: the two honest sites' correct counts plus the liar's test_cap, over 12 + 12 + test_cap
    honest = [round(a * 12 / 100) for a in summary["site_accuracy"]["per_client"][:2]]
    assert headline == pytest.approx(100 * (sum(honest) + test_cap) / (24 + test_cap))
    # beside the pooled figure, each site's own: the liar's 100 % is one of three, the median an honest site's
    site = summary["site_accuracy"]
    assert site["per_client"][2] == 100.0 and site["median"] == sorted(site["per_client"])[1] < 100.0
    assert any("client 2 holds 1000000000 of the 1000000024 test samples" in note for note in summary["notes"])
    assert any(note.startswith("site 'clinic-2' claims 1000000000 training samples") and
               f"it counts as {train_cap}" in note for note in summary["notes"]), summary["notes"]
    assert any(note.startswith("sizes are claims:") and "flower.roster" in note for note in summary["notes"])
    assert summary["size_claims"]["train_cap"] == train_cap and summary["size_claims"]["test_caps"] == {
        "clinic": test_cap}  # the sites' one domain (clinic-0..2: the prefix rule)
    assert headline < 99.0 and model_norm(capped) > 0.4 * model_norm(tmp_path / "unbounded" / "out")


def test_flower_a_liar_just_under_the_bound_is_named_and_the_printout_leads_with_the_median(sites, tmp_path,
                                                                                            caplog):
    """The second finding: a claim just under the cap (47 training / 23 test samples where the default bound
    is 48 / 24) is capped nowhere, so a bound alone leaves no trace; every claim above 1.5x the median site's
    is named at start, and the end of the run leads with the median site's accuracy."""
    with caplog.at_level(logging.INFO):
        out = own_run(sites, tmp_path, {102: liar(47, 23, 23)})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("capped" not in row for row in rows)  # under the bound: its claim counts in full
    notes = read_json(out / "summary.json")["notes"]
    assert ("site 'clinic-2' claims 47 training samples, 2.0x the median site's 24: under the bounds, it counts "
            "in full; if that size is right, vouch for it in flower.roster") in notes
    assert any(note.startswith("site 'clinic-2' claims 23 test samples of test set 'clinic', 1.9x") for note in notes)
    end = caplog.text[caplog.text.rindex("fedhpro: per client (unweighted"):].splitlines()
    assert end[0].endswith("(one site cannot move the median)")  # the printout leads with the median site
    assert "test accuracy (%):" in end[1] and "fedhpro: pooled accuracy: the sites' test sizes are claims" in end[-1]
    honest = own_run(sites, tmp_path / "honest")
    assert not any(note.startswith("site 'clinic-") for note in read_json(honest / "summary.json")["notes"])


def test_flower_a_roster_refuses_the_lying_node_and_the_honest_run_goes_on(sites, tmp_path, caplog):
    roster = tmp_path / "roster.yaml"
    roster.write_text("tolerance: 0.1\nsites:\n  clinic-0: {train: 24, test: 12}\n"
                      "  clinic-1: {train: 24, test: 12}\n")
    with caplog.at_level(logging.WARNING):
        out = own_run(sites, tmp_path, {102: liar(CLAIM, CLAIM, CLAIM)}, clients=None,
                      **{"flower.roster": str(roster)})
    partition = read_json(out / "partition.json")
    assert [c["name"] for c in partition["clients"]] == ["clinic-0", "clinic-1"]
    assert "node 102 is refused: its name 'clinic-2' is not in the roster" in caplog.text
    # the roster's sizes bind the liar even under the name of a real site
    roster.write_text("tolerance: 0.1\nsites:\n  clinic-0: {train: 24, test: 12}\n"
                      "  clinic-1: {train: 24, test: 12}\n  clinic-2: {train: 24, test: 12}\n")
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # refused at discovery; the run goes on with the two honest sites
        out = own_run(sites, tmp_path / "again", {102: liar(CLAIM, CLAIM, CLAIM)}, clients=None,
                      **{"flower.roster": str(roster)})
    assert [c["name"] for c in read_json(out / "partition.json")["clients"]] == ["clinic-0", "clinic-1"]
    assert ("node 102 is refused: it declares 1000000000 train samples but the roster expects 24 for site "
            "'clinic-2'") in caplog.text
    assert "the roster's sites without a node: clinic-2" in caplog.text


def ec_key() -> tuple[bytes, bytes]:
    """A node key pair's public half, as the SuperLink lists it (PEM) and as ``up`` writes it (OpenSSH)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    public = ec.generate_private_key(ec.SECP384R1()).public_key()
    return (public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo),
            public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))


def test_flower_an_impostor_or_a_surplus_node_cannot_deny_the_run(sites, tmp_path, caplog):
    impostor = {50: sites["clinic-0"]}  # a node answering first (lower id) with clinic-0's name and sizes
    with caplog.at_level(logging.WARNING):
        out = own_run(sites, tmp_path / "first-come", extra_nodes=impostor)
    assert len(read_json(out / "partition.json")["clients"]) == 3
    assert "already holds the client named 'clinic-0'" in caplog.text
    # a roster that pins clinic-0's key: the impostor is refused whatever it answers, the real node takes part
    keys = {node: ec_key() for node in (50, 100, 101, 102)}
    (tmp_path / "clinic-0.pub").write_bytes(keys[100][1])
    roster = tmp_path / "roster.yaml"
    roster.write_text("sites:\n  clinic-0: {train: 24, test: 12, key: clinic-0.pub}\n"
                      "  clinic-1: {train: 24, test: 12}\n  clinic-2: {train: 24, test: 12}\n")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        out = own_run(sites, tmp_path / "pinned", extra_nodes=impostor, clients=None,
                      keys={node: pair[0] for node, pair in keys.items()}, **{"flower.roster": str(roster)})
    assert read_json(out / "partition.json")["clients"][0]["node"] == 100
    assert "node 50 is refused: its public key is not the one the roster pins for site 'clinic-0'" in caplog.text
    # one data-holding node too many: refused with a warning, the run goes on with clients=2
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        out = own_run(sites, tmp_path / "surplus", clients=2)
    assert [c["name"] for c in read_json(out / "partition.json")["clients"]] == ["clinic-0", "clinic-1"]
    assert "node 102 is refused: the run already has its 2 data-holding SuperNodes" in caplog.text


def test_flower_a_bad_roster_is_one_line(sites, tmp_path):
    roster = tmp_path / "roster.yaml"
    for text, words in [("sites: []\n", "must hold 'sites:'"),
                        ("sites:\n  a: {train: -1, test: 2}\n", "train must be a whole number"),
                        ("sites:\n  a: {train: 1, test: 2}\nextra: 1\n", "unknown keys"),
                        ("sites:\n  a: {train: 1, test: 2, key: nothing.pub}\n", "cannot be read")]:
        roster.write_text(text)
        with pytest.raises(ConfigError, match=words) as error:
            own_run(sites, tmp_path / "bad", clients=None, **{"flower.roster": str(roster)})
        assert "\n" not in str(error.value)


def test_secagg_a_node_packs_at_most_the_capped_weight(digits_data_dir):
    """Under SecAgg+ the server sees only the sum, so the cap travels as the scale a node packs its update with:
    a reply claiming more samples than the scale packs exactly as one of the scale's size."""
    from test_flower import tiny_config

    from fedhpro.config import load_config
    from fedhpro.flower import secagg
    from fedhpro.flower.engine import build_engine

    engine = build_engine(load_config(tiny_config(digits_data_dir, method="fedproto")))
    layout = secagg.SecureLayout(engine.server, "fedproto")
    base = engine.server.global_weights()
    classes = engine.server.num_classes
    rows = {key: torch.ones(classes, *shape[1:]) for key, (shape, _) in layout.row_forms.items()}
    reply = {"weights": {k: v + 1 for k, v in base.items()}, "num_examples": 1000,
             "class_counts": torch.tensor([1000 - classes + 1] + [1] * (classes - 1)), **rows}
    packed = layout.pack(reply, base, {}, 1000, scale=100.0)
    honest = layout.pack(capped_reply(reply, 100), base, {}, 1000, scale=100.0)
    assert (packed == honest).all()
    assert layout.unpack(packed)["num_examples"][0] == 1.0  # a share of the scale, never above it


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=6), st.integers(1, 10 ** 12), st.floats(0.1, 1.0))
def test_no_claim_buys_more_than_the_share_of_the_aggregate(honest, claim, share):
    """The round protocol with FedAvg's server: honest clients send their model unchanged, one client claims
    ``claim`` samples (well-formed: its node declared that size) and sends the model + 1. The aggregate's
    shift is exactly that client's share of the weight, which never exceeds ``max_share`` (when a share that
    small can be kept: K * max_share > 1; else every client weighs alike)."""
    sizes = [*honest, claim]
    federation = make_federation([4] * len(sizes), seed=1)
    sim = Simulator(METHODS["fedavg"], METHODS["fedavg"].options(), federation, TinyNet, TRAIN, rounds=1, seed=0,
                    aggregation=AggregationOptions(max_share=share), on_drop=lambda line: None)
    sim.protocol.client_sizes = sizes
    current = sim.protocol.open(0)
    base = current.payload["weights"]
    for k, size in enumerate(sizes):
        shift = 1.0 if k == len(sizes) - 1 else 0.0
        weights = {key: value + shift if value.is_floating_point() else value for key, value in base.items()}
        assert current.receive(k, {"weights": weights, "num_examples": size}, {}, size)
    current.close()
    key = next(k for k, v in base.items() if v.is_floating_point())
    moved = float((sim.server.global_weights()[key].double() - base[key].double()).mean())
    cap = share_cap(sizes, share)
    weights = [n if n <= cap else max(1, math.floor(cap)) for n in sizes]
    assert moved == pytest.approx(weights[-1] / sum(weights), rel=1e-5, abs=1e-6)
    if share * len(sizes) > 1:
        assert moved <= share * (1 + 1e-5)
    elif share < 1:
        assert moved == pytest.approx(1 / len(sizes), rel=1e-5)


def test_flower_warns_of_a_near_vacuous_delta(sites, tmp_path, caplog):
    """privacy=client with the default delta 1/N^1.1 of N = 3 sites (0.30, above 1/N): one warning line in the
    log and the run's notes, on Flower as in the simulator."""
    with caplog.at_level(logging.WARNING):
        out = own_run(sites, tmp_path, rounds=1, privacy="client", **{"privacy.noise_multiplier": 0.5})
    notes = read_json(out / "summary.json")["notes"]
    assert any("delta" in note and "1/N" in note.replace(" ", "") for note in notes), notes
    assert "delta" in caplog.text
