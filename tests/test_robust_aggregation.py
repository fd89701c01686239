"""Robust aggregation (``aggregation=``), hostile clients (``faults.scale`` / ``faults.sign_flip``) and the
bound on ``num_examples``, against hand-computed values and closed forms on tiny federations.

References: coordinate medians and trimmed means written out by hand; the engine's documented fault
stream read independently (three uniforms per (seed, FAULT, round, client)); the clients' own replies
(captured from ``fit``) combined in float64 by the formula each rule states.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import TinyNet, make_federation

from fedhpro.aggregation import clip_factor, clip_update, coordinate_median, trimmed_mean, update_norm
from fedhpro.config import AggregationOptions, FaultOptions, load_config
from fedhpro.engines.chain import Reception
from fedhpro.engines.simulator import Simulator, derive_seed
from fedhpro.errors import ConfigError
from fedhpro.experiment import protocol_settings
from fedhpro.functional import weighted_average
from fedhpro.methods import METHODS, TrainSettings
from fedhpro.methods.fedhpro import FedHProOptions

TRAIN = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=0.0)
FAULT_STREAM = 5  # derive_seed(seed, 5, round, client): the engine's fault stream
SIZES = [24, 32, 40, 28, 36]


def simulator(method="fedavg", *, faults=None, aggregation=None, seed=0, sizes=SIZES, classes=None, options=None):
    spec = METHODS[method]
    if options is None:
        options = FedHProOptions(match_steps=2) if method == "fedhpro" else spec.options()
    federation = make_federation(sizes, classes=classes, seed=1)
    return Simulator(spec, options, federation, TinyNet, TRAIN, rounds=2, seed=seed, faults=faults,
                     aggregation=aggregation)


def spy_on_fit(sim: Simulator) -> dict[int, dict]:
    """The reply each client computed (before any injected fault), by client."""
    computed: dict[int, dict] = {}
    original = sim.client.fit

    def fit(model, payload, data, state, generator):
        reply, metrics = original(model, payload, data, state, generator)
        client = next(k for k, d in enumerate(sim.federation.clients) if d is data)
        computed[client] = {key: (value.clone() if isinstance(value, torch.Tensor) else
                                  {n: t.clone() for n, t in value.items()} if isinstance(value, dict) else value)
                            for key, value in reply.items()}
        return reply, metrics

    sim.client.fit = fit
    return computed


def fault_draws(seed: int, round: int, client: int) -> np.ndarray:
    """An independent reading of the fault stream: (dropout, corrupt, hostile) uniforms."""
    return np.random.default_rng(derive_seed(seed, FAULT_STREAM, round, client)).random(3)


def seed_with_one_hostile(scale: float, clients: int = len(SIZES)) -> tuple[int, int]:
    """A seed whose round 0 has exactly one client with a hostile draw below ``scale``: (seed, that client)."""
    for seed in range(500):
        hostile = [k for k in range(clients) if fault_draws(seed, 0, k)[2] < scale]
        if len(hostile) == 1:
            return seed, hostile[0]
    raise AssertionError("no seed found")


def float_weights(weights: dict) -> dict:
    return {k: v.double() for k, v in weights.items() if v.is_floating_point()}


# ----------------------------------------------------------------------------- the pure functions


def test_median_of_three_and_of_four_tensors_by_hand():
    a, b, c = torch.tensor([1.0, 5.0, 3.0]), torch.tensor([2.0, 0.0, 9.0]), torch.tensor([7.0, 4.0, 6.0])
    assert torch.equal(coordinate_median([a, b, c]), torch.tensor([2.0, 4.0, 6.0]))
    d = torch.tensor([10.0, -1.0, 3.0])
    # sorted columns: (1,2,7,10) (-1,0,4,5) (3,3,6,9): the mean of the two middle values
    assert torch.equal(coordinate_median([a, b, c, d]), torch.tensor([4.5, 2.0, 4.5]))
    assert torch.equal(coordinate_median([a]), a)
    two = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert torch.equal(coordinate_median([two, -two]), torch.zeros(2, 2))


def test_trimmed_mean_drops_floor_beta_k_at_each_end():
    values = [torch.tensor([v, -v]) for v in (1.0, 2.0, 3.0, 4.0, 100.0)]
    # beta = 0.2, K = 5: one dropped at each end -> mean(2, 3, 4) = 3
    assert torch.equal(trimmed_mean(values, 0.2), torch.tensor([3.0, -3.0]))
    # beta = 0.1: floor(0.5) = 0 dropped -> the plain mean 22
    assert torch.equal(trimmed_mean(values, 0.1), torch.tensor([22.0, -22.0]))
    # beta = 0.45, K = 5: floor(2.25) = 2 -> only the middle value
    assert torch.equal(trimmed_mean(values, 0.45), torch.tensor([3.0, -3.0]))
    with pytest.raises(ValueError, match="0.5"):
        trimmed_mean(values, 0.5)


def test_clip_factor_and_clip_update_over_all_float_tensors_together():
    reference = {"a": torch.zeros(2), "b": torch.zeros(1, 2), "steps": torch.tensor(7)}
    weights = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[0.0, 4.0]]), "steps": torch.tensor(9)}
    assert update_norm(weights, reference) == 5.0  # sqrt(3^2 + 4^2), both tensors together
    assert clip_factor(5.0, 2.5) == 0.5
    assert clip_factor(5.0, 10.0) == 1.0
    assert clip_factor(0.0, 0.0) == 1.0
    clipped, factor = clip_update(weights, reference, 2.5)
    assert factor == 0.5
    assert torch.equal(clipped["a"], torch.tensor([1.5, 0.0]))
    assert torch.equal(clipped["b"], torch.tensor([[0.0, 2.0]]))
    assert torch.equal(clipped["steps"], torch.tensor(9))  # a counter, not a parameter
    kept, factor = clip_update(weights, reference, 10.0)
    assert factor == 1.0 and all(torch.equal(kept[k], weights[k]) for k in weights)
    # around a non-zero reference: w_ref + f * (w - w_ref)
    shifted, _ = clip_update({"a": torch.tensor([4.0, 1.0])}, {"a": torch.tensor([1.0, 1.0])}, 1.5)
    assert torch.equal(shifted["a"], torch.tensor([2.5, 1.0]))


# ----------------------------------------------------------------------------- config and wiring


def test_aggregation_config_shorthand_defaults_and_one_line_errors():
    config = load_config(None, ["aggregation=trimmed-mean", "aggregation.trim=0.1", "faults.scale=0.2"])
    assert (config.aggregation.rule, config.aggregation.trim) == ("trimmed-mean", 0.1)
    assert config.to_dict()["aggregation"]["rule"] == "trimmed-mean"
    assert load_config({"aggregation": "median"}).aggregation.rule == "median"
    defaults = load_config(None)
    assert (defaults.aggregation.rule, defaults.aggregation.trim, defaults.aggregation.max_norm,
            defaults.aggregation.norm_multiple) == ("mean", 0.2, 0.0, 1.0)
    assert (defaults.faults.scale, defaults.faults.scale_factor, defaults.faults.sign_flip) == (0.0, 100.0, 0.0)
    settings = protocol_settings(config)
    assert settings["aggregation"] == AggregationOptions(rule="trimmed-mean", trim=0.1)
    assert settings["faults"] == FaultOptions(scale=0.2)
    for bad, words in [(["aggregation=mode"], "choose one of: mean, median, trimmed-mean, norm-clip"),
                       (["aggregation.trim=0.5"], "aggregation.trim=0.5"),
                       (["aggregation.max_norm=-1"], "aggregation.max_norm=-1"),
                       (["aggregation.norm_multiple=0"], "aggregation.norm_multiple=0"),
                       (["faults.scale=0.7", "faults.sign_flip=0.5"], "faults.sign_flip"),
                       (["faults.scale=2"], "faults.scale=2")]:
        with pytest.raises(ConfigError) as caught:
            load_config(None, bad)
        assert words in str(caught.value) and "\n" not in str(caught.value)


def test_both_engines_build_their_protocol_from_the_same_settings():
    from fedhpro.flower.engine import protocol_for

    config = load_config(None, ["aggregation=norm-clip", "aggregation.max_norm=3", "faults.sign_flip=0.4",
                                "faults.dropout=0.1", "rounds=4", "min_clients=2"])
    server = METHODS["fedavg"].server(_context())
    protocol = protocol_for(config, server, [10, 20, 30, 40, 50])
    settings = protocol_settings(config)
    assert protocol.aggregation == settings["aggregation"] == AggregationOptions(rule="norm-clip", max_norm=3.0)
    assert protocol.faults == settings["faults"] == FaultOptions(dropout=0.1, sign_flip=0.4)
    assert (protocol.rounds, protocol.min_clients, protocol.num_clients) == (4, 2, 5)
    assert protocol.client_sizes == [10, 20, 30, 40, 50]  # the sizes that cap a round's weights


def test_a_resumed_run_refuses_another_aggregation_or_hostile_fault():
    from fedhpro.resume import _changed_on_resume

    saved = load_config(None, ["aggregation=median"])
    stored = saved.to_dict()
    assert _changed_on_resume(stored, load_config(None, {"aggregation": "trimmed-mean", "faults.sign_flip": 0.1}).given,
                              saved) == ["aggregation.rule", "faults.sign_flip"]
    assert _changed_on_resume(stored, load_config(None, {"aggregation.rule": "median"}).given, saved) == []


def _context():
    from fedhpro.methods import MethodContext

    return MethodContext(model=TinyNet(), num_classes=4, options=METHODS["fedavg"].options(), train=TRAIN)


# ----------------------------------------------------------------------------- fault draws


def test_hostile_draws_are_seeded_and_leave_dropout_and_corrupt_draws_unchanged():
    faults = FaultOptions(dropout=0.25, corrupt=0.25, scale=0.3, sign_flip=0.2, scale_factor=7.0)
    seen_hostile = set()
    for seed in range(6):
        sim = simulator(faults=faults, seed=seed)
        plain = simulator(faults=FaultOptions(dropout=0.25, corrupt=0.25), seed=seed)
        for round in range(3):
            current, before = sim.protocol.open(round), plain.protocol.open(round)
            assert current.dropped == before.dropped and current.to_ask == before.to_ask
            assert current.corrupt == before.corrupt
            expected = {}
            for k in range(len(SIZES)):
                draw_dropout, _, draw_hostile = fault_draws(seed, round, k)
                if draw_dropout < 0.25:
                    continue
                if draw_hostile < 0.3:
                    expected[k] = 7.0
                elif draw_hostile < 0.5:
                    expected[k] = -1.0
            assert current.hostile == expected
            seen_hostile |= set(expected.values())
            assert sim.protocol.open(round).hostile == expected  # the same draw again
    assert seen_hostile == {7.0, -1.0}


# ----------------------------------------------------------------------------- the default is the method's mean


def test_default_mean_is_the_methods_own_fedavg_bit_for_bit():
    """aggregation=mean hands the replies to the method as they came: the global model is
    weighted_average of the replies the clients computed, to the last bit, and no robust metric appears."""
    sim = simulator(aggregation=AggregationOptions("mean"), seed=3)
    computed = spy_on_fit(sim)
    record = sim.run_round(0)
    expected = weighted_average([computed[k]["weights"] for k in range(5)], SIZES)
    for name, value in expected.items():
        assert torch.equal(sim.server.global_weights()[name], value), name
    assert record.server == {}
    # and it is the hand-computed n_k-weighted mean (float64 loop)
    total = sum(SIZES)
    for name, value in float_weights(expected).items():
        hand = sum(computed[k]["weights"][name].double() * (n / total) for k, n in enumerate(SIZES))
        torch.testing.assert_close(value, hand, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- one hostile client of five


def _hostile_round(rule: AggregationOptions, factor: float = 100.0):
    """Round 0 of FedAvg with exactly one of five clients scaling its update by ``factor``: (global weights
    before, after, the computed replies, the hostile client, the record)."""
    seed, bad = seed_with_one_hostile(0.2)
    sim = simulator(faults=FaultOptions(scale=0.2, scale_factor=factor), aggregation=rule, seed=seed)
    initial = {k: v.clone() for k, v in sim.server.global_weights().items()}
    computed = spy_on_fit(sim)
    record = sim.run_round(0)
    assert record.dropped == [] and sorted(computed) == list(range(5))
    return initial, sim.server.global_weights(), computed, bad, record


def test_one_scaled_client_drags_the_mean_by_its_closed_form():
    initial, result, computed, bad, record = _hostile_round(AggregationOptions("mean"))
    total = sum(SIZES)
    for name, w0 in float_weights(initial).items():
        honest_mean = sum(computed[k]["weights"][name].double() * (n / total) for k, n in enumerate(SIZES))
        delta = computed[bad]["weights"][name].double() - w0
        # the hostile reply is w0 + 100 * delta: the mean moves by 99 * n_bad / N * delta more
        expected = honest_mean + 99.0 * SIZES[bad] / total * delta
        torch.testing.assert_close(result[name].double(), expected, rtol=0, atol=1e-4)
    honest = [computed[k]["weights"] for k in range(5) if k != bad]
    assert not _within_range(result, honest)  # far outside what any honest client sent


def _within_range(weights: dict, replies: list[dict], slack: float = 1e-6) -> bool:
    for name, value in float_weights(weights).items():
        stacked = torch.stack([r[name].double() for r in replies])
        if bool((value < stacked.min(0).values - slack).any() or (value > stacked.max(0).values + slack).any()):
            return False
    return True


@pytest.mark.parametrize("rule", [AggregationOptions("median"), AggregationOptions("trimmed-mean", trim=0.2)],
                         ids=["median", "trimmed-mean"])
def test_median_and_trimmed_mean_stay_within_the_honest_clients_range(rule):
    initial, result, computed, bad, record = _hostile_round(rule)
    honest = [computed[k]["weights"] for k in range(5) if k != bad]
    assert _within_range(result, honest)
    assert record.server["robust_updates"] == 5.0
    # and they are the rule's value over the five replies as sent (the hostile one: w0 + 100 * delta)
    for name, w0 in float_weights(initial).items():
        column = [computed[k]["weights"][name].double() for k in range(5)]
        column[bad] = w0 + 100.0 * (column[bad] - w0)
        ordered = torch.stack(column).sort(0).values
        expected = ordered[2] if rule.rule == "median" else ordered[1:4].mean(0)
        torch.testing.assert_close(result[name].double(), expected, rtol=0, atol=1e-5)


def test_norm_clip_clips_exactly_the_hostile_update():
    initial, result, computed, bad, record = _hostile_round(AggregationOptions("norm-clip", norm_multiple=3.0))
    assert record.server["robust_clipped"] == 1.0
    w0 = float_weights(initial)
    norms = []
    for k in range(5):
        delta = {n: computed[k]["weights"][n].double() - w0[n] for n in w0}
        norms.append(math.sqrt(sum(float(d.pow(2).sum()) for d in delta.values())) * (100.0 if k == bad else 1.0))
    limit = 3.0 * float(np.median(norms))
    assert record.server["robust_clip_norm"] == pytest.approx(limit, rel=1e-9)
    assert all(norms[k] < limit for k in range(5) if k != bad) and norms[bad] > limit
    # the hostile update, clipped to the limit, then the method's n_k-weighted mean
    total = sum(SIZES)
    for name in w0:
        parts = []
        for k, n in enumerate(SIZES):
            delta = computed[k]["weights"][name].double() - w0[name]
            if k == bad:
                delta = 100.0 * delta * (limit / norms[bad])
            parts.append((w0[name] + delta) * (n / total))
        torch.testing.assert_close(result[name].double(), sum(parts), rtol=0, atol=1e-5)
    # a generous absolute limit clips nothing: the plain mean of the replies as sent
    _, loose, _, _, loose_record = _hostile_round(AggregationOptions("norm-clip", max_norm=1e9))
    mean_result = _hostile_round(AggregationOptions("mean"))[1]
    assert loose_record.server["robust_clipped"] == 0.0
    for name in w0:
        torch.testing.assert_close(loose[name], mean_result[name], rtol=0, atol=1e-6)


def test_a_sign_flipped_client_sends_the_negated_update():
    seed, bad = seed_with_one_hostile(0.2)
    sim = simulator(faults=FaultOptions(sign_flip=0.2), seed=seed)
    initial = {k: v.clone() for k, v in sim.server.global_weights().items()}
    computed = spy_on_fit(sim)
    sim.run_round(0)
    total = sum(SIZES)
    for name, w0 in float_weights(initial).items():
        expected = sum((w0 - (computed[k]["weights"][name].double() - w0) if k == bad
                        else computed[k]["weights"][name].double()) * (n / total) for k, n in enumerate(SIZES))
        torch.testing.assert_close(sim.server.global_weights()[name].double(), expected, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- class tensors


def test_fedhpro_class_gradients_are_the_median_over_each_classs_holders():
    classes = [[0, 1], [0, 1, 2], [1, 2, 3], [0, 3], [0, 1, 2, 3]]
    seed, bad = seed_with_one_hostile(0.2)
    sim = simulator("fedhpro", faults=FaultOptions(scale=0.2), aggregation=AggregationOptions("median"), seed=seed,
                    classes=classes)
    computed = spy_on_fit(sim)
    handed: list[dict] = []
    original = sim.server.aggregate

    def aggregate(round, replies):
        handed.extend(dict(r) for r in replies)
        return original(round, replies)

    sim.server.aggregate = aggregate
    sim.run_round(0)
    assert len(handed) == 5
    assert "prototypes" not in handed[0]  # fedhpro.prototypes=hyper: not read, not sent
    for key in ("class_gradients",):
        for c in range(4):
            holders = [k for k in range(5) if c in classes[k]]
            sent = [computed[k][key][c] * (100.0 if k == bad else 1.0) for k in holders]
            ordered = torch.stack(sent).double().sort(0).values
            middle = len(sent) // 2
            expected = ordered[middle] if len(sent) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
            for k in holders:
                torch.testing.assert_close(handed[k][key][c].double(), expected, rtol=0, atol=1e-6)
            for k in set(range(5)) - set(holders):  # a class the client does not hold: its row as it was
                assert torch.equal(handed[k][key][c], computed[k][key][c] * (100.0 if k == bad else 1.0))
    # the hostile client's scaled gradients do not reach the bank: the median is an honest client's row or
    # between two honest rows
    for c in range(4):
        honest = torch.stack([computed[k]["class_gradients"][c] for k in range(5) if c in classes[k] and k != bad])
        value = handed[0]["class_gradients"][c] if c in classes[0] else handed[4]["class_gradients"][c]
        assert bool((value >= honest.min(0).values - 1e-6).all() and (value <= honest.max(0).values + 1e-6).all())


def test_norm_clip_of_class_rows_pulls_the_far_holder_to_the_median_distance():
    from fedhpro.engines.robust import robust_replies

    centre_rows = [torch.tensor([[0.0, 0.0], [1.0, 1.0]]), torch.tensor([[1.0, 0.0], [1.0, 2.0]]),
                   torch.tensor([[0.0, 1.0], [9.0, 9.0]]), torch.tensor([[30.0, 40.0], [5.0, 5.0]])]
    counts = [torch.tensor([1, 1]), torch.tensor([1, 1]), torch.tensor([1, 0]), torch.tensor([1, 1])]
    replies = [{"weights": {}, "num_examples": 1, "prototypes": p, "class_counts": n}
               for p, n in zip(centre_rows, counts)]
    out, metrics = robust_replies(replies, {}, AggregationOptions("norm-clip", norm_multiple=1.0), num_classes=2)
    # class 0, four holders: median row (0.5, 0.5); distances 0.707, 0.707, 0.707, 49.3 -> limit 0.707
    far = torch.tensor([30.0, 40.0]) - torch.tensor([0.5, 0.5])
    limit = math.sqrt(0.5)
    torch.testing.assert_close(out[3]["prototypes"][0], torch.tensor([0.5, 0.5]) + far * (limit / float(far.norm())))
    for k in range(3):
        assert torch.equal(out[k]["prototypes"][0], centre_rows[k][0])
    # class 1, holders 0, 1, 3 (client 2 does not hold it: its row 9, 9 is left as it was and not counted):
    # median (1, 2); distances 1, 0, 5 -> limit 1: client 3 is pulled to distance 1
    assert torch.equal(out[2]["prototypes"][1], torch.tensor([9.0, 9.0]))
    torch.testing.assert_close(out[3]["prototypes"][1], torch.tensor([1.0, 2.0]) + torch.tensor([4.0, 3.0]) / 5.0)
    assert metrics["robust_rows_clipped"] == 2.0
    assert torch.equal(replies[3]["prototypes"], centre_rows[3])  # the inputs are not changed


# ----------------------------------------------------------------------------- num_examples bound


def test_an_impossible_num_examples_is_dropped_and_the_round_goes_on():
    sim = simulator(seed=2)
    computed = spy_on_fit(sim)
    original = sim.client.fit
    claims = {1: 1e30, 3: 2.5}

    def lying_fit(model, payload, data, state, generator):
        reply, metrics = original(model, payload, data, state, generator)
        client = next(k for k, d in enumerate(sim.federation.clients) if d is data)
        if client in claims:
            reply["num_examples"] = claims[client]
        return reply, metrics

    sim.client.fit = lying_fit
    record = sim.run_round(0)
    assert [d["client"] for d in record.dropped] == [1, 3]
    assert record.dropped[0]["reason"] == "invalid update: num_examples=1e+30 but client 1 holds 32 training samples"
    assert "num_examples=2.5 is not a whole number" in record.dropped[1]["reason"]
    assert not record.skipped
    kept = [0, 2, 4]
    expected = weighted_average([computed[k]["weights"] for k in kept], [SIZES[k] for k in kept])
    for name, value in expected.items():
        assert torch.equal(sim.server.global_weights()[name], value), name


@pytest.mark.parametrize("count, accepted", [(1, True), (32, True), (32.0, True), (33, False), (0, False),
                                             (-4, False), (float("nan"), False), ("32", False), (True, False)])
def test_num_examples_must_be_a_whole_number_between_one_and_the_clients_samples(count, accepted):
    sim = simulator()
    current = sim.protocol.open(0)
    reply = {"weights": {k: v.clone() for k, v in sim.server.global_weights().items()}, "num_examples": count}
    reception = current.receive(1, reply, {}, 32)
    assert reception is (Reception.ACCEPTED if accepted else Reception.INVALID)
    if not accepted:
        assert current.dropped[0]["reason"].startswith("invalid update: num_examples=")
        assert "client 1 holds 32 training samples" in current.dropped[0]["reason"]


def test_a_hostile_reply_that_fails_the_methods_checks_keeps_the_clients_state():
    """FedGMKD's soft predictions must be probabilities: negated by a sign flip, the reply is refused as
    HOSTILE (the client computed a good one), not INVALID."""
    sim = simulator("fedgmkd", faults=FaultOptions(sign_flip=1.0))
    current = sim.protocol.open(0)
    k = current.to_ask[0]
    reply, _ = sim.client.fit(sim.models.model_for(k), current.payload, sim.federation.clients[k], {},
                              torch.Generator().manual_seed(0))
    assert current.receive(k, reply, {}, SIZES[k]) is Reception.HOSTILE
    assert "soft_predictions" in current.dropped[0]["reason"]
