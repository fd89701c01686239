"""A class row is a claim: ``aggregation.max_row_norm`` bounds what one client's prototype can do.

The attack found: under FedProto one node among ten sends a prototype row of +1000 for a class; counts buy
nothing there (its weight was exactly 1/K), but the row's size alone drags the class's mean prototype so far
that every site's nearest-prototype answer goes wrong. With ``aggregation.max_row_norm`` every class-tensor
row of every reply is scaled down to that L2 norm before any rule aggregates, so the hostile row moves the
mean no further than an honest row of that norm could.

References: the scaled row written out by hand (``row * m / ||row||``), and a run in which the hostile client
itself sends that scaled row with no bound.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import FEATURE_DIM, TinyNet, make_federation

from fedhpro.config import AggregationOptions, ConfigError, load_config
from fedhpro.engines.replies import bounded_rows
from fedhpro.engines.simulator import Simulator
from fedhpro.methods import METHODS, TrainSettings

TRAIN = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=0.0)
#: above every honest row: TinyNet's features are tanh, so a class mean has norm < sqrt(d)
BOUND = math.sqrt(FEATURE_DIM) + 1.0


def test_rows_longer_than_the_bound_are_scaled_to_it_by_hand():
    rows = torch.tensor([[3.0, 4.0], [0.6, 0.8], [0.0, 0.0]])  # norms 5, 1, 0
    reply = {"prototypes": rows, "num_examples": 3}
    out, scaled = bounded_rows(reply, ["prototypes"], 2.0)
    assert scaled == 1
    assert torch.equal(out["prototypes"], torch.tensor([[1.2, 1.6], [0.6, 0.8], [0.0, 0.0]]))  # 5 -> 2
    assert torch.equal(reply["prototypes"], rows)  # the reply itself is not changed
    same, none = bounded_rows(reply, ["prototypes"], 5.0)  # nothing longer than 5: the very reply
    assert same is reply and none == 0
    cube = torch.full((2, 2, 2), 10.0)  # rows of any shape: the norm of each flattened row, sqrt(8) * 10
    out, scaled = bounded_rows({"g": cube}, ["g"], 1.0)
    assert scaled == 2 and torch.allclose(out["g"].reshape(2, -1).norm(dim=1), torch.ones(2))


def hostile_prototypes(sim: Simulator, hostile: int, change) -> None:
    """Client ``hostile`` trains as usual, then ``change``s its prototypes before they are sent."""
    original = sim.client.fit

    def fit(model, payload, data, state, generator):
        reply, metrics = original(model, payload, data, state, generator)
        if data is sim.federation.clients[hostile]:
            reply = {**reply, "prototypes": change(reply["prototypes"].clone())}
        return reply, metrics

    sim.client.fit = fit


def fedproto_round(change, max_row_norm: float) -> tuple[torch.Tensor, dict]:
    federation = make_federation([16] * 10, seed=2)
    sim = Simulator(METHODS["fedproto"], METHODS["fedproto"].options(), federation, TinyNet, TRAIN, rounds=1,
                    seed=0, aggregation=AggregationOptions(max_row_norm=max_row_norm))
    hostile_prototypes(sim, 9, change)
    row = sim.run_round(0).to_json()
    return sim.server.prototypes.clone(), row


def plus_1000(rows: torch.Tensor) -> torch.Tensor:
    rows[0] += 1000.0
    return rows


def scaled_by_hand(rows: torch.Tensor) -> torch.Tensor:
    """What the bound makes of the hostile reply: each row longer than BOUND times BOUND / its norm."""
    rows = plus_1000(rows)
    norms = rows.double().norm(dim=1)
    factor = torch.where(norms > BOUND, BOUND / norms, torch.ones_like(norms))
    return (rows.double() * factor[:, None]).to(rows.dtype)


def test_a_prototype_row_of_1000_moves_the_mean_as_far_as_a_row_of_the_bound():
    bounded, row = fedproto_round(plus_1000, BOUND)
    reference, _ = fedproto_round(scaled_by_hand, 0.0)  # the hostile client sends the bounded rows itself
    unbounded, _ = fedproto_round(plus_1000, 0.0)
    assert torch.equal(bounded, reference)
    assert row["rows_bounded"][0]["client"] == 9 and row["rows_bounded"][0]["rows"] >= 1
    assert float(unbounded[0].norm()) > 90.0  # the attack: 1000 / 10 clients, and more by the class counts
    assert float(bounded[0].norm()) <= BOUND  # a mean of rows no longer than the bound


def test_no_bound_binds_an_honest_round_to_the_bit():
    bounded, row = fedproto_round(lambda rows: rows, 1e6)
    plain, plain_row = fedproto_round(lambda rows: rows, 0.0)
    assert torch.equal(bounded, plain) and "rows_bounded" not in row
    assert row["train"] == plain_row["train"]


def test_the_setting_is_refused_in_one_line_when_negative():
    with pytest.raises(ConfigError, match="max_row_norm") as error:
        load_config(None, ["aggregation.max_row_norm=-1"])
    assert "\n" not in str(error.value)
    assert load_config(None, ["aggregation.max_row_norm=3"]).aggregation.max_row_norm == 3.0
