"""Streamed aggregation: the server folds each reply's weights as it arrives (Eq. 1 / Algorithm 1).

References: a hand-computed average in float64; :func:`weighted_average` on the
list of full replies (bit for bit: the list and the stream run the same code);
the simulator with folding switched off on the server instance.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TinyBNNet, make_federation

from fedhpro.averaging import WeightedSum
from fedhpro.engines.fault_options import FaultOptions
from fedhpro.engines.simulator import Simulator
from fedhpro.functional import weighted_average
from fedhpro.methods import METHODS, MethodContext, Replies, Server, TrainSettings
from fedhpro.methods.fedavg import FedAvgOptions
from fedhpro.methods.fedgmkd import FedGMKDOptions
from fedhpro.methods.fedhpro import FedHProOptions
from fedhpro.methods.fedproto import FedProtoOptions
from fedhpro.metrics import payload_bytes, payload_parameters

TRAIN = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-4)


def random_states(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"conv.weight": torch.randn(4, 3, 3, 3, generator=g),
             "bn.running_var": torch.rand(4, generator=g) + 0.5,
             "bn.num_batches_tracked": torch.randint(0, 50, (), generator=g),
             "fc.bias": torch.randn(7, generator=g)} for _ in range(count)]


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_weighted_average_three_states_by_hand_float64():
    states = [{"w": torch.tensor([1.0, 2.0], dtype=torch.float64), "n": torch.tensor(4)},
              {"w": torch.tensor([4.0, 8.0], dtype=torch.float64), "n": torch.tensor(9)},
              {"w": torch.tensor([-1.0, 0.5], dtype=torch.float64), "n": torch.tensor(2)}]
    out = weighted_average(states, [1, 2, 3])
    # (1*1 + 2*4 + 3*(-1)) / 6 = 1,  (1*2 + 2*8 + 3*0.5) / 6 = 3.25
    assert out["w"].dtype == torch.float64 and out["w"].tolist() == [1.0, 3.25]
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 9  # counters: the largest
    # a stream in the same order: the same numbers
    folded = WeightedSum()
    for state, n in zip(states, [1, 2, 3]):
        folded.add(state, n)
    assert_bit_equal(folded.result(), out)
    assert folded.count == 3 and folded.total == 6.0


def test_weighted_sum_rejects_nothing_and_a_zero_total_and_keeps_no_input():
    with pytest.raises(ValueError):
        WeightedSum().result()
    zero = WeightedSum()
    zero.add({"w": torch.ones(2)}, 0)
    with pytest.raises(ValueError):
        zero.result()
    with pytest.raises(ValueError):
        weighted_average([{"w": torch.ones(2)}], [1, 2])  # one weight per state
    state = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    original = {k: v.clone() for k, v in state.items()}
    folded = WeightedSum()
    folded.add(state, 1.0)  # a weight of 1: the product must still be a new tensor
    out = folded.result()
    for key in state:
        assert out[key].untyped_storage().data_ptr() != state[key].untyped_storage().data_ptr()
        out[key].add_(5)
        assert torch.equal(state[key], original[key])
    assert_bit_equal(folded.result(), original)  # result() leaves the running sums as they were


def test_list_and_streamed_replies_are_bit_identical():
    server = Server(MethodContext(model=torch.nn.Linear(1, 1), num_classes=2, options=None, train=TRAIN))
    for seed in range(3):
        states = random_states(7, seed)
        sizes = [int(n) for n in torch.randint(1, 500, (7,), generator=torch.Generator().manual_seed(seed))]
        expected = weighted_average(states, sizes)
        replies = Replies(fold_weights=True)
        for state, n in zip(states, sizes):
            replies.append({"weights": state, "num_examples": n})
        assert_bit_equal(server.average_weights(replies), expected)
        # the list of full replies through the server (validated, then folded by weighted_average): the same bits
        server.weights = {k: torch.zeros_like(v) for k, v in states[0].items()}
        assert_bit_equal(server.average_weights([{"weights": s, "num_examples": n} for s, n in zip(states, sizes)]),
                         expected)
        assert int(expected["bn.num_batches_tracked"]) == max(int(s["bn.num_batches_tracked"]) for s in states)
        reference = sum(s["conv.weight"].double() * n for s, n in zip(states, sizes)) / sum(sizes)
        torch.testing.assert_close(expected["conv.weight"].double(), reference, rtol=1e-6, atol=1e-6)


def test_folded_replies_store_no_weights_and_keep_the_rest():
    states = random_states(3, 5)
    extras = [{"class_counts": torch.tensor([k, 1]), "prototypes": torch.randn(2, 3)} for k in range(3)]
    full = [{"weights": s, "num_examples": 10 + k, **e} for k, (s, e) in enumerate(zip(states, extras))]
    replies = Replies(fold_weights=True)
    for reply in full:
        replies.append(reply)
    assert len(replies) == 3 and replies.folds_weights
    for stored, reply in zip(replies, full):
        assert "weights" not in stored
        assert set(stored) == {"num_examples", "class_counts", "prototypes"}
        assert stored["prototypes"] is reply["prototypes"] and stored["num_examples"] == reply["num_examples"]
        assert "weights" in reply  # the caller's reply is not changed
    assert "weights" not in replies[0] and [r["num_examples"] for r in replies[1:]] == [11, 12]
    kept = Replies(fold_weights=False)
    for reply in full:
        kept.append(reply)
    assert all(stored is reply for stored, reply in zip(kept, full))
    with pytest.raises(ValueError):
        kept.average_weights()


def test_servers_fold_by_default_and_fedgmkd_keeps_full_replies():
    assert Server.folds_weights
    folding = {name for name, spec in METHODS.items() if spec.server.folds_weights}
    assert folding == set(METHODS) - {"fedgmkd"}
    federation = make_federation([10, 12, 9], classes=[[0, 1], [1, 2, 3], [0, 3]])
    sim = Simulator(METHODS["fedgmkd"], FedGMKDOptions(max_components=1), federation, TinyBNNet, TRAIN, rounds=1)
    captured = []
    aggregate = sim.server.aggregate
    sim.server.aggregate = lambda round, replies: captured.append(replies) or aggregate(round, replies)
    sim.run_round(0)
    assert isinstance(captured[0], Replies) and not captured[0].folds_weights
    assert len(captured[0]) == 3 and all("weights" in reply for reply in captured[0])


def run(method: str, options, folds: bool, faults: FaultOptions | None = None, rounds: int = 2):
    federation = make_federation([10, 12, 9, 14], classes=[[0, 1], [1, 2, 3], [0, 3], [0, 1, 2, 3]])
    sim = Simulator(METHODS[method], options, federation, TinyBNNet, TRAIN, rounds=rounds, seed=3, faults=faults)
    sim.server.folds_weights = folds  # the instance overrides the class's choice
    uploads: list[dict] = []
    fit = sim.client.fit

    def spy(model, payload, data, state, generator):
        reply, metrics = fit(model, payload, data, state, generator)
        uploads.append(reply)
        return reply, metrics

    sim.client.fit = spy
    captured = []
    aggregate = sim.server.aggregate
    sim.server.aggregate = lambda round, replies: captured.append(replies) or aggregate(round, replies)
    records = [sim.run_round(r) for r in range(rounds)]
    return sim, records, uploads, captured


@pytest.mark.parametrize("method,options", [
    ("fedavg", FedAvgOptions()),
    ("fedhpro", FedHProOptions(match_steps=3)),
    ("fedproto", FedProtoOptions()),
])
def test_simulator_gives_the_same_model_whether_the_server_folds_or_not(method, options):
    folded, records, uploads, captured = run(method, options, True)
    listed, records_listed, _, captured_listed = run(method, options, False)
    assert all(isinstance(r, Replies) and r.folds_weights and "weights" not in r[0] for r in captured)
    assert all("weights" in r[0] for r in captured_listed)
    # both paths fold the same replies in the same order with the same code: equal to the last bit
    assert_bit_equal(folded.server.global_weights(), listed.server.global_weights())
    assert_bit_equal(folded.server.state_dict()["weights"], listed.server.state_dict()["weights"])
    if method == "fedhpro":
        assert torch.equal(folded.server.bank.hyper, listed.server.bank.hyper)
    assert [r.to_json() for r in records] == [r.to_json() for r in records_listed]
    # the uploads are measured before the weights are folded away: the full replies' bytes and parameters
    per_round = len(uploads) // 2
    assert records[0].bytes_up == sum(payload_bytes(u) for u in uploads[:per_round]) > 0
    assert records[0].extra["params_up"] == sum(payload_parameters(u) for u in uploads[:per_round])
    weights_bytes = sum(v.numel() * v.element_size() for v in uploads[0]["weights"].values())
    assert records[0].bytes_up >= per_round * weights_bytes


def test_invalid_replies_are_dropped_before_they_are_folded():
    faults = FaultOptions(corrupt=0.4)
    folded, records, uploads, _ = run("fedavg", FedAvgOptions(), True, faults=faults, rounds=2)
    listed, records_listed, _, _ = run("fedavg", FedAvgOptions(), False, faults=faults, rounds=2)
    dropped = [item for record in records for item in record.dropped]
    assert dropped and all("invalid update" in item["reason"] for item in dropped)
    weights = folded.server.global_weights()
    assert all(bool(torch.isfinite(v).all()) for v in weights.values() if v.is_floating_point())
    assert_bit_equal(weights, listed.server.global_weights())
    assert [r.to_json() for r in records] == [r.to_json() for r in records_listed]
