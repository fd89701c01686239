"""What one reply's content can buy (``aggregation.update_bound``), on Flower deployments whose nodes hold their
own data.

The attack, as found on loopback: a node claiming twice the median size (the most ``aggregation.max_ratio``
lets it), training honestly, then sending ``g + boost (T - g)`` with ``boost`` the round's total weight over its
own and ``T`` its model with the classifier rows swapped: the aggregate is ``T``, every honest site at chance.
Here the bound scales each reply's pull ``n_k ||Delta_k||`` (and each class row's) to ``update_multiple`` x the
round's median, and the honest sites keep the honest run's accuracy.

The references are independent of the code under test: the clip written out by hand on tiny replies, and the
honest run of the same sites.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TinyNet, make_federation
from flwr.app import Message, MessageType, RecordDict
from test_flower_own_data import write_site

from fedhpro.config import AggregationOptions, load_config
from fedhpro.engines.chain import PlainFold, RoundState
from fedhpro.engines.content import BoundedFold, bounded_updates
from fedhpro.engines.private import ClientLevel, NoAccountant
from fedhpro.engines.protocol import RoundProtocol
from fedhpro.engines.robust import RobustFold
from fedhpro.engines.sampling import PoissonSampling
from fedhpro.engines.simulator import Simulator
from fedhpro.errors import ConfigError
from fedhpro.flower import records
from fedhpro.flower.local_grid import LocalGrid, inside_a_run
from fedhpro.flower.server import run_server
from fedhpro.methods import METHODS, TrainSettings
from fedhpro.privacy.client import ClientPrivacy

TRAIN = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=0.0)

# ---------------------------------------------------------------------------- the bound, against a hand clip


def reply(delta: list[float], n: int, **extra: Any) -> dict[str, Any]:
    return {"weights": {"w": torch.tensor(delta), "steps": torch.tensor(3)}, "num_examples": n, **extra}


def test_each_pull_is_clipped_to_kappa_times_the_median_pull():
    """Pulls n ||Delta||: 10 x 1 = 10, 10 x 2 = 20, 20 x 10 = 200; median 20, kappa 2: limit 40, so the third
    update is scaled by 40 / 200 = 0.2 (from the global weights 1, 1), the others unchanged (to the bit)."""
    glob = {"w": torch.tensor([1.0, 1.0]), "steps": torch.tensor(0)}
    replies = [reply([2.0, 1.0], 10), reply([1.0, 3.0], 10), reply([7.0, 9.0], 20)]  # ||Delta||: 1, 2, 10
    out, metrics, entries = bounded_updates(replies, glob, 2.0)
    assert torch.equal(out[0]["weights"]["w"], replies[0]["weights"]["w"])
    assert torch.equal(out[1]["weights"]["w"], replies[1]["weights"]["w"])
    assert torch.allclose(out[2]["weights"]["w"], torch.tensor([1.0 + 0.2 * 6, 1.0 + 0.2 * 8]))
    assert out[2]["weights"]["steps"] is replies[2]["weights"]["steps"]  # integer tensors are not updates
    assert replies[2]["weights"]["w"].tolist() == [7.0, 9.0]  # the input is not changed
    assert metrics == {"bounded_updates": 1.0, "bounded_rows": 0.0}
    assert entries == [{"client": 2, "factor": 0.2}]
    # the plain norm of norm-clip: the 10 against 2 x median(1, 2, 10) = 4: scaled by 0.4
    plain, _, _ = bounded_updates(replies, glob, 2.0, weighted=False)
    assert torch.allclose(plain[2]["weights"]["w"], torch.tensor([1.0 + 0.4 * 6, 1.0 + 0.4 * 8]))


def test_each_class_row_is_clipped_over_the_replies_that_hold_the_class():
    """Class 0, held by all three with counts 1, 1, 2: pulls 1 x 1, 1 x 3, 2 x 100 -> median 3, kappa 1.5:
    limit 4.5, the third row scaled by 4.5 / 200. Class 1, held by the first two only (the third's row, not
    held, is left alone however long): pulls 5 x 2 = 10 and 5 x 4 = 20, median 15, limit 22.5: nothing."""
    rows = [torch.tensor([[1.0, 0.0], [2.0, 0.0]]), torch.tensor([[0.0, 3.0], [0.0, 4.0]]),
            torch.tensor([[-60.0, -80.0], [1e30, 0.0]])]
    counts = [torch.tensor([1, 5]), torch.tensor([1, 5]), torch.tensor([2, 0])]
    replies = [{"prototypes": r, "class_counts": c, "num_examples": int(c.sum())} for r, c in zip(rows, counts)]
    out, metrics, entries = bounded_updates(replies, {}, 1.5, num_classes=2, class_keys=["prototypes"])
    assert torch.equal(out[0]["prototypes"], rows[0]) and torch.equal(out[1]["prototypes"], rows[1])
    assert torch.allclose(out[2]["prototypes"][0], torch.tensor([-60.0, -80.0]) * 4.5 / 200)
    assert out[2]["prototypes"][1, 0] == 1e30
    assert metrics["bounded_rows"] == 1.0 and entries == [{"client": 2, "rows": 1}]


def test_a_row_of_1e30_is_measured_in_float64_and_bounded():
    rows = [torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, -1.0]]), torch.full((1, 2), -1e30)]
    replies = [{"prototypes": r, "class_counts": torch.tensor([4]), "num_examples": 4} for r in rows]
    out, _, _ = bounded_updates(replies, {}, 2.0, num_classes=1, class_keys=["prototypes"])
    norm = float(out[2]["prototypes"].double().norm())
    assert torch.isfinite(out[2]["prototypes"]).all() and norm == pytest.approx(2.0 * 2 ** 0.5, rel=1e-5)


# ---------------------------------------------------------------------------- where the round applies it


class Stand:
    """A stand-in server: only what the chain reads."""

    num_classes = 2

    def new_replies(self) -> list:
        return []


def chain_of(**options: Any):
    aggregation = AggregationOptions(**{k: v for k, v in options.items() if k != "content_claimed"})
    protocol = RoundProtocol(Stand(), 3, rounds=1, aggregation=aggregation,
                             content_claimed=options.get("content_claimed", False))
    return protocol.chain(RoundState(protocol=protocol, round=0, payload={}, num_classes=2))[1]


def test_the_bound_is_on_only_where_the_content_is_a_claim_or_asked_for():
    assert type(chain_of()) is PlainFold  # the simulator and partition mode: the chain of before
    assert type(chain_of(rule="median")) is RobustFold
    bounded = chain_of(content_claimed=True)  # own data: around the method's fold
    assert isinstance(bounded, BoundedFold) and type(bounded.inner) is PlainFold and bounded.multiple == 2.0
    robust = chain_of(content_claimed=True, rule="median", update_multiple=3.0)
    assert isinstance(robust, BoundedFold) and type(robust.inner) is RobustFold and robust.multiple == 3.0
    assert type(chain_of(content_claimed=True, update_bound="off")) is PlainFold
    assert isinstance(chain_of(update_bound="on"), BoundedFold)  # asked for in the simulator
    protocol = RoundProtocol(Stand(), 3, rounds=1, aggregation=AggregationOptions(update_bound="on"),
                             content_claimed=True)
    # privacy=client: its clip bounds every upload; the sum is released whole
    protocol.round_privacy = ClientLevel(PoissonSampling(0, 3, 1.0), NoAccountant(), ClientPrivacy(1.0, 1.0), None)
    assert not protocol.bounds_content


@pytest.mark.parametrize(("key", "value", "words"), [
    ("aggregation.update_bound", "maybe", "update_bound"),
    ("aggregation.update_multiple", 0.5, "update_multiple"),
])
def test_a_bad_setting_is_one_line(key, value, words):
    with pytest.raises(ConfigError, match=words) as error:
        load_config({key: value})
    assert "\n" not in str(error.value)


def boosted_round(bound: str) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, torch.Tensor],
                                        list[dict[str, torch.Tensor]]]:
    """One simulator round of three equal clients, the third sending ``g + 5 (w - g)`` (its own update x 5):
    ``(the new global weights, the round's row, the broadcast weights, each client's weights as sent)``."""
    sim = Simulator(METHODS["fedavg"], METHODS["fedavg"].options(), make_federation([24, 24, 24], seed=1), TinyNet,
                    TRAIN, rounds=1, seed=0, aggregation=AggregationOptions(update_bound=bound))
    before = {k: v.clone() for k, v in sim.server.global_weights().items()}
    sent: list[dict[str, torch.Tensor]] = []
    original = sim.client.fit

    def fit(model, payload, data, state, generator):
        reply, metrics = original(model, payload, data, state, generator)
        weights = {k: v.clone() for k, v in reply["weights"].items()}
        if data is sim.federation.clients[2]:
            weights = {k: before[k] + 5 * (v - before[k]) if v.is_floating_point() else v for k, v in weights.items()}
        sent.append(weights)
        return {**reply, "weights": weights}, metrics

    sim.client.fit = fit
    row = sim.run_round(0).to_json()
    return sim.server.global_weights(), row, before, sent


def test_simulator_asked_for_the_bound_gives_the_hand_computed_mean():
    """update_bound=on in the simulator: the FedAvg mean of the replies with each update scaled by
    min(1, 2 x median pull / its pull), computed here from the replies as sent (equal weights 24)."""
    model, row, glob, sent = boosted_round("on")
    floats = [k for k in glob if glob[k].is_floating_point()]
    norms = [sum(float((w[k].double() - glob[k].double()).pow(2).sum()) for k in floats) ** 0.5 for w in sent]
    limit = 2 * sorted(norms)[1]
    factors = [min(1.0, limit / norm) for norm in norms]
    assert factors[:2] == [1.0, 1.0] and factors[2] < 1.0  # the x5 update is the one scaled
    for k in floats:
        expected = glob[k].double() + sum(f * (w[k].double() - glob[k].double()) for f, w in zip(factors, sent)) / 3
        assert torch.allclose(model[k].double(), expected, atol=1e-6), k
    assert row["bounded"] == [{"client": 2, "factor": pytest.approx(factors[2], rel=1e-5)}]
    assert row["server"]["bounded_updates"] == 1.0
    # auto: the simulator knows its clients, so nothing is bounded and the row is as before
    model, row, glob, sent = boosted_round("auto")
    assert "bounded" not in row and "bounded_updates" not in row["server"]
    for k in floats:
        expected = sum(w[k].double() for w in sent) / 3
        assert torch.allclose(model[k].double(), expected, atol=1e-6), k


# ---------------------------------------------------------------------------- the attack on Flower


def boosted(claim: int, boost: float, target: str = "swap"):
    """The liar: declares ``claim`` training samples, trains honestly, sends ``g + boost (T - g)`` with ``T``
    its model with the classifier's two class rows swapped (``target="swap"``) or zero (``"zero"``)."""

    def forge(kind, header, reply, message):
        if kind == MessageType.QUERY and str(header["query"]) == "data":
            record = reply.content.config_records[records.NODE_RECORD]
            info = json.loads(str(record["info"]))
            info.update(train_size=claim)
            record["info"] = json.dumps(info)
            return reply
        if kind == MessageType.TRAIN:
            payload = records.decode_payload(reply.content)
            glob = records.decode_payload(message.content)["weights"]
            aim = dict(payload["weights"])
            key = [k for k, v in aim.items() if v.dim() == 2 and v.shape[0] == 2][-1]
            for name in (key, key[:-len("weight")] + "bias"):
                aim[name] = aim[name].flip(0)
            if target == "zero":
                aim = {k: torch.zeros_like(v) for k, v in aim.items()}
            payload["weights"] = {k: glob[k] + boost * (v - glob[k]) if v.is_floating_point() else v
                                  for k, v in aim.items()}
            payload["num_examples"] = claim
            return Message(RecordDict({**records.encode_payload(payload),
                                       records.METRICS: reply.content[records.METRICS]}), reply_to=message)
        return reply

    return forge


def reversed_rows(norm: float):
    """FedProto's row liar: its prototypes reversed, each row scaled to L2 norm ``norm``, its size true."""

    def forge(kind, header, reply, message):
        if kind == MessageType.TRAIN:
            payload = records.decode_payload(reply.content)
            rows = payload["prototypes"].double()
            payload["prototypes"] = (-rows / rows.norm(dim=1, keepdim=True).clamp(min=1e-12) * norm).float()
            return Message(RecordDict({**records.encode_payload(payload),
                                       records.METRICS: reply.content[records.METRICS]}), reply_to=message)
        return reply

    return forge


@pytest.fixture(autouse=True)
def _inside_a_run(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):  # put back after the test
        monkeypatch.setattr(TaskIdentity, name, getattr(TaskIdentity, name, None))
    inside_a_run()  # outside a run, flwr refuses to address a Message


@pytest.fixture(scope="module")
def sites(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("sites")
    for k in range(3):
        write_site(root / f"clinic-{k}", ["cat", "dog"], seed=k, train=12, test=6)  # 24 training, 12 test
    return [root / f"clinic-{k}" for k in range(3)]


def own_run(sites: list[Path], tmp: Path, forge=None, **config) -> dict[str, Any]:
    out = tmp / "out"
    grid = LocalGrid({100 + k: folder for k, folder in enumerate(sites)}, tmp / "state", forge)
    run_server(grid, {"dataset": "clients", "method": "fedavg", "rounds": 2, "local_epochs": 2, "lr": 0.05,
                      "clients": 3, "feature_dim": 8, "batch_size": 8, "data.image_size": 16, "device": "cpu",
                      "progress": False, "seed": 3, "flower.node-wait": 2, "out": str(out), **config})
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"sites": summary["site_accuracy"]["per_client"], "rows": rows}


@pytest.fixture(scope="module")
def honest(sites, tmp_path_factory) -> dict[str, list[float]]:
    """Each site's accuracy in the honest runs (FedAvg, FedProto): the reference of every attack."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = {name: getattr(TaskIdentity, name, None) for name in ("_run_id", "_node_id", "_task_id")}
    inside_a_run()  # before the per-test fixture: this one is the module's
    try:
        return {method: own_run(sites, tmp_path_factory.mktemp(f"honest-{method}"), method=method)["sites"]
                for method in ("fedavg", "fedproto")}
    finally:
        for name, value in saved.items():
            setattr(TaskIdentity, name, value)


@pytest.mark.parametrize(("claim", "boost", "target"), [
    (48, 96 / 48, "swap"),  # twice the median claim (48 of 96), T = its model with the class rows swapped
    (48, 96 / 48, "zero"),  # ... T = 0
    (24, 72 / 24, "zero"),  # its true size, boosted by the round's total over its weight
])
def test_flower_a_boosted_liar_no_longer_owns_the_model(sites, honest, tmp_path, claim, boost, target):
    """Three sites, the last one lying. Unbounded (update_bound=off, as before the bound) every honest site is at
    chance; by default every honest site stays within 5 points of the honest run, and the rows say whose reply
    was scaled."""
    attack = {102: boosted(claim, boost, target)}
    unbounded = own_run(sites, tmp_path / "off", attack, **{"aggregation.update_bound": "off"})
    assert max(unbounded["sites"][:2]) <= 60.0  # the attack as found
    bounded = own_run(sites, tmp_path / "default", attack)
    assert all(after >= before - 5.0 for before, after in zip(honest["fedavg"][:2], bounded["sites"][:2]))
    assert all(entry["client"] == 2 for row in bounded["rows"] for entry in row.get("bounded", []))
    assert all(row["bounded"][0]["factor"] < 1.0 for row in bounded["rows"])
    assert [row["server"]["bounded_updates"] for row in bounded["rows"]] == [1.0, 1.0]


@pytest.mark.parametrize("norm", [1e6, 1e30])
def test_flower_fedproto_rows_reversed_and_huge_are_bounded(sites, honest, tmp_path, norm):
    """FedProto, the last site sending its prototypes reversed at norm 1e6 (unbounded: every site at chance) or
    1e30 (unbounded: every client's next loss is non-finite and the run stops). By default a row of 1e6 is scaled
    to twice its class's median pull; a row of 1e30 (its square overflows float32) is refused with the reply, which
    drops that client for the round; either way the run goes on and the honest sites keep the honest run's
    accuracy."""
    bounded = own_run(sites, tmp_path / "default", {102: reversed_rows(norm)}, method="fedproto")
    assert all(after >= before - 5.0 for before, after in zip(honest["fedproto"][:2], bounded["sites"][:2]))
    if norm < 1e15:
        assert all(row["bounded"] == [{"client": 2, "rows": 2}] for row in bounded["rows"])
    else:
        assert all("bounded" not in row for row in bounded["rows"])
        assert all([entry["client"] for entry in row["dropped"]] == [2] for row in bounded["rows"])
        assert all("beyond 1e+15" in row["dropped"][0]["reason"] for row in bounded["rows"])
