"""The round's chain is a list a user extends (a step of their own, where they want it; a fold around the round's),
and the round's privacy is objects the protocol holds: the sampling and the accountant, chosen once."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedhpro.config import PrivacyOptions
from fedhpro.engines.chain import Fold, Incoming, ReplyStep, RoundState
from fedhpro.engines.private import Accountant, ClientLevel, NoAccountant, RoundPrivacy
from fedhpro.engines.protocol import RoundProtocol
from fedhpro.engines.replies import TrainingMetrics, WeightCap
from fedhpro.engines.sampling import FixedSampling, PoissonSampling, SecretSampling
from fedhpro.seeds import derive_seed

#: three clients' replies: (value of every weight, num_examples, training loss)
REPLIES = {0: (1.0, 2, 0.5), 1: (10.0, 3, 7.0), 2: (4.0, 5, 1.5)}


def mean_server():
    """A server whose aggregate is the n_k-weighted mean of the replies' ``w`` (what the test checks)."""
    def aggregate(round, replies):
        total = sum(int(reply["num_examples"]) for reply in replies)
        return {"mean": sum(float(reply["weights"]["w"][0]) * int(reply["num_examples"]) for reply in replies) / total}
    return SimpleNamespace(new_replies=list, broadcast=lambda round: {"weights": {"w": torch.zeros(2)}},
                           validate_reply=lambda reply: None, aggregate=aggregate)


class RefuseClient(ReplyStep):
    """A user's step: refuses one client's reply, whatever it holds."""

    def __init__(self, client: int) -> None:
        self.client = client

    def receive(self, incoming: Incoming, round: RoundState) -> str | None:
        return "refused by the user's step" if incoming.client == self.client else None


def run_round(protocol: RoundProtocol):
    current = protocol.open(0)
    receptions = {k: current.receive(k, {"weights": {"w": torch.full((2,), value)}, "num_examples": n},
                                     {"loss": loss}, n)
                  for k, (value, n, loss) in REPLIES.items()}
    return current, receptions, current.close()


def test_a_users_step_appended_refuses_what_it_refuses_and_the_mean_is_the_others():
    protocol = RoundProtocol(mean_server(), 3, rounds=1, steps=[RefuseClient(1)])
    assert isinstance(protocol.round_chain.links[-1], RefuseClient)
    current, receptions, metrics = run_round(protocol)
    assert [bool(r) for r in receptions.values()] == [True, False, True]
    assert current.dropped == [{"client": 1, "reason": "refused by the user's step"}]
    assert metrics["mean"] == pytest.approx((1.0 * 2 + 4.0 * 5) / (2 + 5))  # by hand: clients 0 and 2
    # appended after the training metrics, it refuses a reply whose metrics were already counted
    assert [weight for weight, _ in current.train_metrics] == [2, 3, 5]


def test_a_users_step_inserted_before_a_built_in_one_runs_before_it():
    protocol = RoundProtocol(mean_server(), 3, rounds=1)
    links = protocol.round_chain.links
    links.insert(next(i for i, link in enumerate(links) if isinstance(link, TrainingMetrics)), RefuseClient(1))
    current, _, metrics = run_round(protocol)
    assert [weight for weight, _ in current.train_metrics] == [2, 5]  # refused before its metrics are counted
    assert metrics["mean"] == pytest.approx(22.0 / 7.0)
    assert any(isinstance(link, WeightCap) for link in links)


class Recording(Fold):
    """A user's fold around the round's fold (a strategy wrapper): records who was folded, then hands it on."""

    def __init__(self, round: RoundState, inner: Fold) -> None:
        self.inner, self.seen = inner, []
        self.replies, self.held = inner.replies, inner.held

    def add(self, incoming: Incoming, round: RoundState) -> None:
        self.seen.append(incoming.client)
        self.inner.add(incoming, round)

    @property
    def count(self) -> int:
        return self.inner.count

    def aggregate(self, round: RoundState) -> dict[str, float]:
        return {**self.inner.aggregate(round), "folded": float(len(self.seen))}


def test_a_users_fold_wraps_the_rounds_fold():
    protocol = RoundProtocol(mean_server(), 3, rounds=1, steps=[RefuseClient(2)])
    protocol.round_chain.wrappers.append(Recording)
    current, _, metrics = run_round(protocol)
    assert isinstance(current.fold, Recording) and current.fold.seen == [0, 1]
    assert metrics == {"mean": pytest.approx((2.0 + 30.0) / 5), "folded": 2.0}


def test_the_sampling_and_the_accountant_are_chosen_once_from_the_privacy_options():
    server = mean_server()
    server.reply_layout = lambda: {"weights": {"w": torch.zeros(2)}, "num_examples": int}
    off = RoundProtocol(server, 10, rounds=2, participation=0.3, seed=5)
    assert type(off.round_privacy) is RoundPrivacy and type(off.sampling) is FixedSampling
    assert isinstance(off.accountant, NoAccountant) and off.epsilon_after(0) is None and off.ledger is None
    rng = np.random.default_rng(derive_seed(5, 2, 1))  # by hand: 3 of 10 without replacement, SAMPLE = 2
    assert off.sample_clients(1) == sorted(int(k) for k in rng.choice(10, size=3, replace=False))

    private = PrivacyOptions(mode="client", noise_multiplier=1.0, secure_noise=False)
    poisson = RoundProtocol(server, 10, rounds=2, participation=0.3, seed=5, privacy=private)
    assert type(poisson.round_privacy) is ClientLevel and type(poisson.sampling) is PoissonSampling
    uniforms = np.random.default_rng(derive_seed(5, 2, 1)).random(10)  # by hand: each client below 0.3
    assert poisson.sample_clients(1) == [k for k in range(10) if uniforms[k] < 0.3]
    assert type(poisson.accountant) is Accountant and poisson.client_privacy is poisson.round_privacy.settings
    assert poisson.weight_cap() == float("inf") and not poisson.publishes_participants

    secret = RoundProtocol(server, 10, rounds=2, participation=0.3, seed=5,
                           privacy=PrivacyOptions(mode="client", noise_multiplier=1.0, secure_noise=True))
    assert type(secret.sampling) is SecretSampling
