"""A test set named by one unvouched site weighs in the headline as one site, not as all the others.

Without a roster, a site names its own test set (its domain) and answers its own evaluation: a liar declaring a
domain of its own ("lab") with forged evaluation would otherwise be half of ``AVG``, the unweighted mean over
test sets. Where test sets are claims, ``AVG`` weighs each test set by its number of tested clients, up to the
median client's test set's (:func:`fedhpro.engines.evaluation.headline_weights`). References: hand-computed
weights and means; the unweighted mean, to the bit, wherever every test set has as many clients.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedhpro.engines.evaluation import TestCount as Count
from fedhpro.engines.evaluation import headline_weights, pool_accuracy


@pytest.mark.parametrize("names, weights", [
    (["all"] * 9 + ["lab"], {"all": 1.0, "lab": 1 / 9}),
    (["a", "b", "c"], {"a": 1.0, "b": 1.0, "c": 1.0}),  # each site its own domain: unchanged
    (["a", "a", "b", "b"], {"a": 1.0, "b": 1.0}),
    (["a"] * 4 + ["b"] * 2, {"a": 1.0, "b": 0.5}),  # the median client's test set has 4 clients
    (["all", "lab"], {"all": 1.0, "lab": 1.0}),  # two sites: nobody to tell which one lies
])
def test_headline_weights_by_hand(names, weights):
    assert headline_weights(names) == pytest.approx(weights, rel=1e-15)


def test_a_test_set_of_one_site_weighs_as_one_site_in_the_headline_where_test_sets_are_claims():
    counts = [Count("all", 6, 12)] * 9 + [Count("lab", 12, 12)]
    claimed = pool_accuracy(counts, max_share=0.75, max_ratio=2.0)
    assert claimed["all"] == 50.0 and claimed["lab"] == 100.0
    assert claimed["AVG"] == pytest.approx((50.0 + 100.0 / 9) / (1 + 1 / 9))  # 55.0, by hand
    # vouched test sets (a roster; the simulator): the paper's unweighted mean over test sets
    assert pool_accuracy(counts, max_share=0.75)["AVG"] == 75.0


@pytest.mark.parametrize("names", [["a", "b", "c", "d"], ["a", "a", "b", "b", "c", "c"], ["all"] * 5])
def test_where_every_test_set_has_as_many_sites_the_headline_is_the_unweighted_mean_to_the_bit(names):
    rng = np.random.default_rng(0)
    counts = [Count(name, int(rng.integers(0, 13)), 12) for name in names]
    claimed = pool_accuracy(counts, max_share=0.75, max_ratio=2.0)
    plain = pool_accuracy(counts, max_share=0.75)
    assert claimed == plain


# ---------------------------------------------------------------------------- Flower


pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")

from flwr.app import ConfigRecord, Message, MessageType, RecordDict  # noqa: E402
from test_flower_own_data import write_site  # noqa: E402

from fedhpro.flower.local_grid import LocalGrid, inside_a_run  # noqa: E402
from fedhpro.flower.server import EVAL_RECORD, NODE_RECORD, run_server  # noqa: E402


def own_domain_liar(domain: str):
    """The hostile node: declares a domain of its own at discovery and answers every evaluation all right."""

    def forge(kind, header, reply, message):
        if kind == MessageType.QUERY and str(header["query"]) == "data":
            info = json.loads(str(reply.content.config_records[NODE_RECORD]["info"]))
            info.update(domain=domain)
            return Message(RecordDict({NODE_RECORD: ConfigRecord({"info": json.dumps(info)})}), reply_to=message)
        if kind == MessageType.EVALUATE:
            record = reply.content.config_records[EVAL_RECORD]
            return Message(RecordDict({EVAL_RECORD: ConfigRecord(
                {"test-set": domain, "correct": record["total"], "total": record["total"]})}), reply_to=message)
        return reply

    return forge


@pytest.fixture(autouse=True)
def _inside_a_run(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):  # put back after the test
        monkeypatch.setattr(TaskIdentity, name, getattr(TaskIdentity, name, None))
    inside_a_run()  # outside a run, flwr refuses to address a Message


def test_flower_a_site_naming_a_domain_of_its_own_weighs_as_one_site_in_the_headline(tmp_path):
    sites = {}
    for k in range(4):
        sites[k] = tmp_path / "sites" / f"clinic-{k}"
        write_site(sites[k], ["cat", "dog"], seed=k, train=12, test=6)
    out = tmp_path / "out"
    grid = LocalGrid({100 + k: folder for k, folder in sites.items()}, tmp_path / "state", {103: own_domain_liar("lab")})
    run_server(grid, {"dataset": "clients", "method": "fedavg", "rounds": 1, "clients": 4, "feature_dim": 8,
                      "local_epochs": 1, "batch_size": 8, "data.image_size": 16, "device": "cpu", "progress": False,
                      "seed": 3, "flower.node-wait": 2, "out": str(out)})
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    accuracy = row["accuracy"]
    honest = accuracy["clinic"]  # the honest sites' test set (clinic-0..2 by the name-prefix rule)
    assert accuracy["lab"] == 100.0 and honest < 100.0
    # three honest sites test on "clinic", one liar on "lab": lab weighs 1/3 (before: 1, half the headline)
    assert accuracy["AVG"] == pytest.approx((honest + accuracy["lab"] / 3) / (1 + 1 / 3))
    assert accuracy["AVG"] < (honest + accuracy["lab"]) / 2
    assert "each test set weighs by its number of sites" in (out / "summary.json").read_text()
