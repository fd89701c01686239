"""One node cannot deny a run at discovery, and what a node hands back in a round is bound and bounded.

The attacks, as found on an own-data Flower deployment (three sites, ``clients=3`` or a roster naming them):

1. a node answers discovery with JSON nested 200,000 deep, or with a 16 MB list: it was refused, and then the
   run stopped ("only 2 of 3 data-holding SuperNodes answered"). Now it is left out with one warning and the
   run goes on with the two others; a roster's site without a node is named; with too few left the run
   still stops with one line;
2. a node's training reply names 200,000 metrics of its own: metrics.jsonl grew to 10 MB. Now such a reply
   is refused like an invalid update (the round's ``dropped`` names it) and the row stays small;
3. ``flower.round-timeout`` left unset is sized from the run (hand-computed values), an explicit one wins;
4. a node returns a copy of another node's training reply: it is refused (``dropped``), and the global model
   is the FedAvg mean of the two honest replies, computed here by hand from the replies themselves.

The grid is ``run_server`` (the real ServerApp code) over an in-process grid whose nodes run the real
ClientApp on their own site folders (the pattern of test_size_claims.py); a hostile node is that ClientApp
with its answers rewritten on the way out.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")

from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict  # noqa: E402
from test_flower_own_data import write_site  # noqa: E402

from fedhpro.errors import ConfigError  # noqa: E402
from fedhpro.flower import records  # noqa: E402
from fedhpro.flower.local_grid import LocalGrid, inside_a_run  # noqa: E402
from fedhpro.flower.nodes import match_replies, needed_nodes  # noqa: E402
from fedhpro.flower.records import HEADER, NODE_RECORD  # noqa: E402
from fedhpro.flower.server import run_server  # noqa: E402
from fedhpro.flower.settings import (  # noqa: E402
    ROUND_TIMEOUT_CEILING,
    ROUND_TIMEOUT_FLOOR,
    auto_round_timeout,
    split_run_config,
)

SITES = {"clinic-0": ["cat", "dog"], "clinic-1": ["cat", "dog"], "clinic-2": ["cat", "dog"]}
HOSTILE = 102  # the node of clinic-2
DEEP = "[" * 200_000 + "]" * 200_000
BIG_LIST = "[" + "0," * (8 * 2 ** 20 - 1) + "0]"  # 16 MB of JSON list


def answering(text: str):
    """A node that answers the discovery query with ``text`` as its folder's description."""

    def forge(kind, header, reply, message):
        if kind == MessageType.QUERY and str(header["query"]) == "data":
            return Message(RecordDict({NODE_RECORD: ConfigRecord({"info": text})}), reply_to=message)
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


def own_run(sites: dict[str, Path], tmp: Path, forge=None, grid: list | None = None, **config) -> Path:
    folders = {100 + k: folder for k, folder in enumerate(sites.values())}
    out = tmp / "out"
    site_grid = LocalGrid(folders, tmp / "state", forge)
    if grid is not None:
        grid.append(site_grid)
    settings = {"dataset": "clients", "method": "fedavg", "rounds": 2, "clients": 3, "feature_dim": 8,
                "local_epochs": 1, "batch_size": 8, "data.image_size": 16, "device": "cpu", "progress": False,
                "seed": 3, "flower.node-wait": 2, "out": str(out), **config}
    run_server(site_grid, settings)
    return out


def rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def names(out: Path) -> list[str]:
    return [client["name"] for client in json.loads((out / "partition.json").read_text())["clients"]]


def write_roster(tmp: Path) -> Path:
    roster = tmp / "roster.yaml"
    roster.write_text("sites:\n" + "".join(f"  {site}: {{train: 24, test: 12}}\n" for site in SITES))
    return roster


# ---------------------------------------------------------------------------- 1. discovery


@pytest.mark.parametrize("answer", [DEEP, BIG_LIST], ids=["nested-200000-deep", "16-MB-list"])
def test_a_node_with_a_malformed_answer_cannot_deny_the_run(sites, tmp_path, caplog, answer):
    with caplog.at_level(logging.WARNING):
        out = own_run(sites, tmp_path / "clients", {HOSTILE: answering(answer)})
    assert names(out) == ["clinic-0", "clinic-1"] and len(rows(out)) == 2
    assert f"node {HOSTILE} is refused: its answer to the query is malformed" in caplog.text
    assert "2 of 3 data-holding SuperNodes were admitted (clinic-0, clinic-1); the run goes on" in caplog.text
    # a roster naming the node's site: the run goes on, and the warning names the site without a node
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        out = own_run(sites, tmp_path / "roster", {HOSTILE: answering(answer)}, clients=None,
                      **{"flower.roster": str(write_roster(tmp_path))})
    assert names(out) == ["clinic-0", "clinic-1"] and len(rows(out)) == 2
    warning = next(line for line in caplog.text.splitlines() if "the run goes on" in line)
    assert f"refused: node {HOSTILE}: its answer to the query is malformed" in warning
    assert warning.endswith("the roster's sites without a node: clinic-2"), warning
    assert caplog.text.count(f"node {HOSTILE} is refused") == 1  # never asked again, not even by a later round


def test_too_few_nodes_left_still_stop_with_one_line(sites, tmp_path):
    two_hostile = {101: answering(DEEP), HOSTILE: answering(BIG_LIST)}
    with pytest.raises(ConfigError) as caught:
        own_run(sites, tmp_path / "roster", two_hostile, clients=None,
                **{"flower.roster": str(write_roster(tmp_path))})
    message = str(caught.value)
    assert "\n" not in message and "only 1 of 3 data-holding SuperNodes answered (clinic-0; at least 2 needed)" \
        in message and "refused: node 101: its answer" in message and "node 102: its answer" in message
    assert message.endswith("the roster's sites without a node: clinic-1, clinic-2; start the missing SuperNodes, "
                            "set clients= to the number running, or raise flower.node-wait"), message
    # flower.min-clients: the operator's own minimum (here all three), whatever was refused
    with pytest.raises(ConfigError, match=r"only 2 of 3 data-holding SuperNodes answered \(clinic-0, clinic-1; "
                                          r"at least 3 needed\)"):
        own_run(sites, tmp_path / "min", {HOSTILE: answering(DEEP)}, **{"flower.min-clients": 3})
    with pytest.raises(ConfigError, match="flower.min-clients=4 is more than the 3 data-holding SuperNodes"):
        own_run(sites, tmp_path / "more", **{"flower.min-clients": 4})


@pytest.mark.parametrize(("expected", "accounted", "min_clients", "needed"), [
    (3, 1, None, 2),  # one of three refused: the two others go on
    (3, 0, None, 3),  # a site nobody accounts for (not started): the run stops, as it always did
    (10, 3, None, 7),
    (10, 9, None, 2),  # never fewer than two
    (2, 1, None, 2),  # two sites, one refused: one site is no federation
    (1, 1, None, 1),  # never more than the run waits for
    (10, 0, 4, 4),  # flower.min-clients decides
])
def test_the_nodes_a_run_goes_on_with(expected, accounted, min_clients, needed):
    assert needed_nodes(expected, accounted, min_clients) == needed


# ---------------------------------------------------------------------------- 2. metric records


def many_metrics(count: int):
    def forge(kind, header, reply, message):
        if kind == MessageType.TRAIN:
            content = RecordDict({**reply.content.array_records, **reply.content.config_records,
                                  records.METRICS: MetricRecord({f"metric-{i}": float(i) for i in range(count)})})
            return Message(content, reply_to=message)
        return reply

    return forge


def test_a_reply_naming_200000_metrics_is_refused_and_the_rows_stay_small(sites, tmp_path):
    out = own_run(sites, tmp_path, {HOSTILE: many_metrics(200_000)})
    for row in rows(out):
        assert {"client": 2, "reason": "invalid update: the reply holds 200000 training metrics, more than "
                                       "256"} in row["dropped"], row["dropped"]
        assert not any(name.startswith("metric-") for name in row.get("train", {})), sorted(row["train"])[:5]
    assert (out / "metrics.jsonl").stat().st_size < 20_000


def test_metric_records_are_bounded_in_count_and_name_length():
    def content(metrics):
        return RecordDict({records.METRICS: MetricRecord(metrics)})

    assert records.decode_metrics(content({"loss": 0.5, "accuracy": 1})) == {"loss": 0.5, "accuracy": 1.0}
    assert len(records.decode_metrics(content({f"m{i}": 0.0 for i in range(records.MAX_METRICS)}))) == 256
    for metrics, words in [({f"m{i}": 0.0 for i in range(records.MAX_METRICS + 1)}, "257 training metrics"),
                           ({"x" * (records.MAX_METRIC_NAME + 1): 0.0}, "at most 128 characters"),
                           ({f"{i:03d}" + "y" * 120: 0.0 for i in range(70)}, "8192 together")]:
        with pytest.raises(records.UpdateError, match=words) as caught:
            records.decode_metrics(content(metrics))
        assert "\n" not in str(caught.value)


# ---------------------------------------------------------------------------- 3. the round timeout


@pytest.mark.parametrize(("epochs", "batch", "largest", "participants", "seconds"), [
    (5, 64, 2000, 10, 3200.0),  # 2 s x 5 epochs x ceil(2000 / 64) = 32 batches x 10 clients
    (1, 8, 24, 3, ROUND_TIMEOUT_FLOOR),  # 2 x 1 x 3 x 3 = 18 s: the floor, 300 s
    (2, 32, 1000, 3, 384.0),  # 2 x 2 x ceil(1000 / 32) = 32 x 3 = 384 s
    (10, 16, 10_000, 10, ROUND_TIMEOUT_CEILING),  # 125,000 s: the ceiling, 3600 s
])
def test_the_auto_round_timeout_follows_its_rule(epochs, batch, largest, participants, seconds):
    assert auto_round_timeout(epochs, batch, largest, participants) == seconds


def test_an_unset_round_timeout_is_auto_and_an_explicit_one_wins(sites, tmp_path):
    for given in ({}, {"flower.round-timeout": ""}, {"flower.round-timeout": "auto"}):
        assert split_run_config(given)[1].round_timeout is None, given  # auto
    explicit = split_run_config({"flower.round-timeout": 90})[1].round_timeout
    assert explicit == 90.0
    # the run's rounds wait what the rule gives: 3 clients of 24 samples, batches of 8, 1 epoch -> 300 s
    grids: list[LocalGrid] = []
    own_run(sites, tmp_path / "auto", grid=grids, rounds=1)
    assert {timeout for kind, timeout in grids[0].timeouts if kind in (MessageType.TRAIN, MessageType.EVALUATE)} \
        == {300.0}
    own_run(sites, tmp_path / "explicit", grid=grids, rounds=1, **{"flower.round-timeout": 45})
    assert {timeout for kind, timeout in grids[1].timeouts if kind in (MessageType.TRAIN, MessageType.EVALUATE)} \
        == {45.0}


# ---------------------------------------------------------------------------- 4. replayed replies


def test_a_node_replaying_another_node_s_reply_is_refused_and_the_honest_reply_counts_once(sites, tmp_path):
    honest: dict[int, dict[str, torch.Tensor]] = {}
    kept: dict[str, RecordDict] = {}

    def keep(node):
        def forge(kind, header, reply, message):
            if kind == MessageType.TRAIN:
                honest[node] = records.decode_payload(copy.deepcopy(reply.content))["weights"]
                if node == 100:
                    kept["content"] = copy.deepcopy(reply.content)
            return reply
        return forge

    def replay(kind, header, reply, message):
        if kind == MessageType.TRAIN:  # clinic-0's reply, byte for byte, sent as its own
            return Message(copy.deepcopy(kept["content"]), reply_to=message)
        return reply

    out = own_run(sites, tmp_path, {101: keep(101), 100: keep(100), HOSTILE: replay}, rounds=1)
    (row,) = rows(out)
    assert row["dropped"] == [{"client": 2, "reason": "refused reply: its reply is a byte-for-byte copy of client "
                                                      "0's reply this round (node 102 replayed another node's "
                                                      "reply)"}]
    model = torch.load(out / "model.pt", weights_only=True)
    weights = model.get("weights", model)
    for key, value in weights.items():
        if value.is_floating_point():  # FedAvg of clinic-0 and clinic-1 (24 samples each), clinic-0 once
            expected = (24 * honest[100][key].double() + 24 * honest[101][key].double()) / 48
            assert torch.allclose(value.double(), expected, rtol=1e-6, atol=1e-7), key


def test_a_reply_from_another_node_than_asked_is_refused():
    sent = []
    for node in (7, 8):
        message = Message(RecordDict({HEADER: ConfigRecord({"query": "partition"})}), node, MessageType.QUERY)
        message.metadata.__dict__["_message_id"] = f"message-{node}"  # as a grid sets it when pushing
        sent.append((node, message))
    honest = Message(RecordDict(), reply_to=sent[0][1])
    forged = Message(RecordDict(), reply_to=sent[1][1])
    forged.metadata.__dict__["_src_node_id"] = 7  # node 7 answering the message sent to node 8
    stale = Message(RecordDict(), reply_to=sent[1][1])
    stale.metadata.__dict__["_reply_to_message_id"] = "an-earlier-round"
    refused: dict[int, str] = {}
    assert match_replies(sent, [honest, forged, stale], refused) == {7: honest}
    assert refused == {8: "its reply came from node 7, not from node 8 that was asked"}
