"""Who takes part in each round: the round protocol's participant sampling, one object a run holds.

* :class:`FixedSampling`: ``round_half_up(participation x K)`` clients drawn without replacement from the
  round's SAMPLE stream (every run without client-level privacy);
* :class:`PoissonSampling`: each client independently with probability ``participation``
  (:func:`~fedhpro.privacy.client.poisson_participants`), from the same stream: ``privacy=client``, whose
  accountant amplifies by exactly this sampling rate;
* :class:`SecretSampling`: the same Poisson draw from the operating system's randomness (``privacy=client`` with
  ``privacy.secure_noise``): amplification by sampling assumes that nobody who sees the released model knows who
  took part, which a draw from the config's seed would not keep.

Each draw is a function of ``(seed, SAMPLE, round)`` alone (:func:`~fedhpro.seeds.derive_seed`), so a round's
participants are the same whatever ran before, on every engine and after a resume; a secret draw is kept in
memory so that a round asked for twice answers once.
"""

from __future__ import annotations

import abc
import secrets

import numpy as np

from fedhpro.privacy.client import poisson_participants
from fedhpro.seeds import derive_seed

#: the participants' stream tag (the round protocol's other streams: fedhpro.engines.protocol)
SAMPLE = 2


def round_half_up(value: float) -> int:
    return int(np.floor(value + 0.5))


class Sampling(abc.ABC):
    """The participants of each round of a federation of ``num_clients`` clients, each taking part with rate
    ``participation``; drawn from the run's ``seed``."""

    def __init__(self, seed: int, num_clients: int, participation: float) -> None:
        self.seed = seed
        self.num_clients = num_clients
        self.participation = participation

    @abc.abstractmethod
    def draw(self, round: int) -> list[int]:
        """The participants of ``round``, sorted."""

    def participations(self, rounds_done: int) -> dict[int, int]:
        """How many of the first ``rounds_done`` rounds each client takes part in (the accountant's count)."""
        counts: dict[int, int] = {}
        for round in range(rounds_done):
            for k in self.draw(round):
                counts[k] = counts.get(k, 0) + 1
        return counts


class FixedSampling(Sampling):
    """``round_half_up(participation x K)`` clients (at least one), drawn without replacement, sorted."""

    def draw(self, round: int) -> list[int]:
        total = self.num_clients
        count = max(1, int(round_half_up(self.participation * total)))
        if count >= total:
            return list(range(total))
        rng = np.random.default_rng(derive_seed(self.seed, SAMPLE, round))
        return sorted(int(k) for k in rng.choice(total, size=count, replace=False))


class PoissonSampling(Sampling):
    """Each client independently with probability ``participation``, from the round's SAMPLE stream."""

    def draw(self, round: int) -> list[int]:
        return poisson_participants(derive_seed(self.seed, SAMPLE, round), self.num_clients, self.participation)


class SecretSampling(Sampling):
    """The Poisson draw from the operating system's randomness, kept in memory only (one answer a round)."""

    def __init__(self, seed: int, num_clients: int, participation: float) -> None:
        super().__init__(seed, num_clients, participation)
        self.drawn: dict[int, list[int]] = {}

    def draw(self, round: int) -> list[int]:
        if round not in self.drawn:
            self.drawn[round] = poisson_participants(secrets.randbits(63), self.num_clients, self.participation)
        return list(self.drawn[round])

    def participations(self, rounds_done: int) -> dict[int, int]:
        """A round not drawn in this process (one still to come, or one before a resume) counts as taken part in
        by every client: the draws are kept nowhere, and the worst case bounds them."""
        counts: dict[int, int] = {}
        for round in range(rounds_done):
            for k in self.drawn.get(round, range(self.num_clients)):
                counts[k] = counts.get(k, 0) + 1
        return counts


__all__ = ["SAMPLE", "FixedSampling", "PoissonSampling", "Sampling", "SecretSampling", "round_half_up"]
