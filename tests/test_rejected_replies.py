"""A rejected reply (a non-finite or refused update) restores the client's state, and the client recovers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import TinyNet, make_federation

from fedhpro.engines.fault_options import FaultOptions
from fedhpro.engines.simulator import Simulator, derive_seed
from fedhpro.methods import METHODS, TrainSettings

#: one step per round (batches larger than any client): a step that goes non-finite is the last one, so
#: fit returns a NaN update (training itself stops at a non-finite loss, which is the raising path)
TRAIN = TrainSettings(epochs=1, batch_size=64, lr=0.05, momentum=0.9, weight_decay=0.0)


# ---------------------------------------------------------------------------- 1. rejected replies


def small_simulator(method: str, faults: FaultOptions | None = None, seed: int = 3) -> Simulator:
    spec = METHODS[method]
    options = spec.options()
    factory = TinyNet
    if spec.model_wrapper is not None:
        factory = lambda: spec.model_wrapper(TinyNet(), options, 4)  # noqa: E731
    return Simulator(spec, options, make_federation([24, 32, 28]), factory, TRAIN, rounds=4, seed=seed,
                     faults=faults)


def diverge_once(sim: Simulator, client: int) -> dict[str, bool]:
    """Make ``client``'s local training non-finite (SGD with lr=nan) while the returned switch is on."""
    switch = {"on": False}
    fit, data = sim.client.fit, sim.federation.clients[client]

    def diverging_fit(model, payload, client_data, state, generator):
        if not (switch["on"] and client_data is data):
            return fit(model, payload, client_data, state, generator)
        sim.client.train = dataclasses.replace(TRAIN, lr=float("nan"))
        try:
            return fit(model, payload, client_data, state, generator)
        finally:
            sim.client.train = TRAIN

    sim.client.fit = diverging_fit
    return switch


def all_finite(state: dict) -> bool:
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    tensors += [t for v in state.values() if isinstance(v, dict) for t in v.values() if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(torch.isfinite(t.float()).all() for t in tensors)


@pytest.mark.parametrize("method,key", [("moon", "previous_weights"), ("fedsa", "last_prototypes")])
def test_a_rejected_update_restores_the_client_state_and_the_client_recovers(method, key):
    sim = small_simulator(method)
    switch = diverge_once(sim, client=0)
    sim.run_round(0)
    before = {k: v.clone() for k, v in sim.client_states[0][key].items()} if isinstance(
        sim.client_states[0][key], dict) else sim.client_states[0][key].clone()
    switch["on"] = True
    record = sim.run_round(1)
    switch["on"] = False
    assert [d["client"] for d in record.dropped] == [0] and "non-finite" in record.dropped[0]["reason"]
    # the state is the one from before the rejected round, not the NaN one fit wrote
    assert all_finite(sim.client_states[0])
    after = sim.client_states[0][key]
    if isinstance(before, dict):
        assert all(torch.equal(after[k], before[k]) for k in before)
    else:
        assert torch.equal(after, before)
    for r in (2, 3):
        assert sim.run_round(r).dropped == []  # before the fix: dropped every later round
    assert all_finite(sim.client_states[0])


def first_seed_with_corruption(rate: float) -> int:
    """A seed whose fault draws (read independently of the protocol) corrupt client 0, and only it, in
    round 1, and nobody in round 0 (so round 1's payload is the clean run's)."""
    def corrupt(seed, r, k):
        return np.random.default_rng(derive_seed(seed, 5, r, k)).random(2)[1] < rate

    for seed in range(200):
        if (not any(corrupt(seed, 0, k) for k in range(3)) and corrupt(seed, 1, 0)
                and not any(corrupt(seed, 1, k) for k in (1, 2))):
            return seed
    raise AssertionError("no seed found")


def test_a_transmission_fault_keeps_the_state_the_client_computed():
    seed = first_seed_with_corruption(0.3)
    faulty = small_simulator("moon", FaultOptions(corrupt=0.3), seed=seed)
    clean = small_simulator("moon", seed=seed)
    for r in (0, 1):
        record = faulty.run_round(r)
        clean.run_round(r)
    assert [d["client"] for d in record.dropped] == [0]
    # the client's good update was spoiled on the way: on the client it happened, so its state moves on
    computed, kept = clean.client_states[0]["previous_weights"], faulty.client_states[0]["previous_weights"]
    assert all(torch.equal(kept[k], computed[k]) for k in computed)


def test_receive_says_why_a_reply_is_refused():
    from fedhpro.engines.chain import Reception

    sim = small_simulator("fedavg", FaultOptions(corrupt=1.0))
    current = sim.protocol.open(0)
    good = {"weights": {k: v.clone() for k, v in sim.server.global_weights().items()}, "num_examples": 5}
    bad = {"weights": {k: torch.full_like(v, float("nan")) for k, v in good["weights"].items()}, "num_examples": 5}
    assert current.receive(0, good, {}, 5) is Reception.CORRUPTED  # a good update, spoiled in transit
    assert current.receive(1, bad, {}, 5) is Reception.INVALID  # the client's own update was bad already
    clean = small_simulator("fedavg").protocol.open(0)
    assert clean.receive(0, good, {}, 5) is Reception.ACCEPTED
    assert clean.receive(1, bad, {}, 5) is Reception.INVALID
    # the Flower server only tests the truth of what receive returns
    assert [bool(r) for r in Reception] == [r is Reception.ACCEPTED for r in Reception]
