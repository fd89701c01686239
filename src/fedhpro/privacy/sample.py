"""The accountant of ``privacy=sample``: (epsilon, delta) of each client's training data, from Google's dp-accounting.

In a round it takes part in, client ``k`` (``n_k`` training samples) runs two Gaussian mechanisms on its data
(:mod:`fedhpro.methods.sample_dp`), both with noise multiplier ``sigma`` relative to their sensitivity ``C``
(``privacy.clip``), for **adding or removing one of its samples**:

* DP-SGD: ``local_epochs x ceil(n_k / B)`` steps, each on a Poisson batch of rate ``q_k = 1 / ceil(n_k / B)``
  (``PoissonSampledDpEvent(q_k, GaussianDpEvent(sigma))``, self-composed);
* the statistics release: once (``GaussianDpEvent(sigma)``, no sampling): the noisy class counts behind
  ``num_examples`` and ``class_counts`` and, for the methods that send them, the noisy class means (prototypes,
  FedHPro's class gradients, FedGMKD's soft predictions).

Everything else the client sends (the trained weights, what is derived from the released statistics) is
post-processing. A client's epsilon composes its rounds; the run's epsilon is the largest over the clients (the
smallest clients, with the highest sampling rate, spend the most). The server learns who took part, so client
sampling amplifies nothing here.

``delta`` defaults to ``1 / n^1.1`` with ``n`` the smallest client's sample count. ``privacy.target_epsilon``
calibrates sigma by bisection so that a client taking part in every planned round ends within 1 % below the
target (with ``participation < 1`` the clients' real epsilons are then lower), by the one sigma search of both
modes (:func:`fedhpro.privacy.accounting.calibrate`). ``privacy.accountant=pld`` composes the same events with
privacy loss distributions instead of Renyi DP.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fedhpro.errors import ConfigError
from fedhpro.methods.sample_dp import INSTALL_HINT, poisson_plan
from fedhpro.methods.training import TrainSettings
from fedhpro.privacy import accounting
from fedhpro.privacy.accounting import PLD_ACCOUNTANT, calibrate, check_accountant
from fedhpro.privacy.options import PrivacyOptions

#: the name summary.json gives the accountant (``privacy.accountant=rdp``; pld: :data:`PLD_ACCOUNTANT`)
ACCOUNTANT = "dp-accounting RdpAccountant (Renyi DP; Poisson-subsampled Gaussian, Mironov et al. 2019)"


def round_event(noise_multiplier: float, sampling_rate: float, steps: int) -> Any:
    """One client's DP event of one round: ``steps`` DP-SGD steps at Poisson rate ``sampling_rate``, then the
    statistics release."""
    dpa = accounting._dp_accounting(INSTALL_HINT)
    sgd = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(sampling_rate, dpa.GaussianDpEvent(noise_multiplier)),
                                  steps)
    return dpa.ComposedDpEvent([sgd, dpa.GaussianDpEvent(noise_multiplier)])


def event_epsilon(event: Any, count: int, delta: float, accountant: str = "rdp") -> float:
    """Epsilon at ``delta`` of ``event`` composed ``count`` times (0 for none), adding or removing one sample, by
    the ``accountant`` (rdp or pld; :func:`fedhpro.privacy.accounting.event_epsilon`)."""
    return accounting.event_epsilon(event, count, delta, False, accountant=accountant, hint=INSTALL_HINT)


class SampleLedger:
    """The privacy ledger of ``privacy=sample`` (the :class:`fedhpro.privacy.Ledger` interface).

    Args:
        options: the ``privacy.*`` options (``config.privacy``: clip, noise_multiplier, target_epsilon, delta).
        client_sizes: ``n_k``, each client's number of training samples, by client index.
        train: the local training settings (``epochs``, ``batch_size``: the DP-SGD steps and sampling rates).
        rounds: the planned rounds (what ``target_epsilon`` is calibrated for: every one of them taken part in).
        participation: the fraction of clients sampled per round (reported; it amplifies nothing here).
    """

    def __init__(self, options: PrivacyOptions, client_sizes: Sequence[int], train: TrainSettings, rounds: int,
                 participation: float):
        self.options = options
        self.client_sizes = [int(n) for n in client_sizes]
        if not self.client_sizes or min(self.client_sizes) < 1:
            raise ConfigError("privacy=sample needs every client to hold at least one training sample")
        self.epochs = int(train.epochs)
        self.batch_size = int(train.batch_size)
        self.rounds = int(rounds)
        self.participation = float(participation)
        self.clip = float(options.clip)
        self.kind = check_accountant(getattr(options, "accountant", "rdp"))
        self.accountant = PLD_ACCOUNTANT if self.kind == "pld" else ACCOUNTANT
        smallest = min(self.client_sizes)
        self.delta = float(options.delta) if options.delta > 0 else 1.0 / smallest ** 1.1
        if not 0.0 < self.delta < 1.0:
            raise ConfigError(f"privacy.delta={self.delta:g} must be in (0, 1); with a client of {smallest} sample(s) "
                              "the default 1/n^1.1 is not: set privacy.delta (e.g. 1e-5)")
        # a client's plan depends on n_k through ceil(n_k / B) only: one accountant per distinct plan
        self._plans = {k: poisson_plan(n, self.batch_size) for k, n in enumerate(self.client_sizes)}
        self._cache: dict[tuple[float, int, int], float] = {}
        if options.target_epsilon > 0:
            self.noise_multiplier = calibrate(lambda sigma: self._worst(sigma, self.rounds),
                                              float(options.target_epsilon),
                                              f"{self.rounds} rounds of {self.epochs} local epoch(s)",
                                              "lower rounds or local_epochs")
        else:
            self.noise_multiplier = float(options.noise_multiplier)
        if not self.noise_multiplier > 0:
            raise ConfigError("privacy=sample with privacy.noise_multiplier=0 adds no noise (epsilon would be "
                              "infinite); set privacy.noise_multiplier > 0 or privacy.target_epsilon")

    def client_epsilon(self, client: int, participations: int, sigma: float | None = None) -> float:
        """Client ``client``'s epsilon after taking part ``participations`` times (at sigma, default the ledger's)."""
        sigma = self.noise_multiplier if sigma is None else sigma
        steps_per_epoch = self._plans[client].steps_per_epoch
        key = (sigma, steps_per_epoch, int(participations))
        if key not in self._cache:
            event = round_event(sigma, 1.0 / steps_per_epoch, self.epochs * steps_per_epoch)
            self._cache[key] = event_epsilon(event, int(participations), self.delta, self.kind)
        return self._cache[key]

    def _worst(self, sigma: float, participations: int) -> float:
        clients = {plan.steps_per_epoch: k for k, plan in self._plans.items()}  # one client per distinct plan
        return max(self.client_epsilon(k, participations, sigma) for k in clients.values())

    def epsilon(self, participations: Mapping[int, int], rounds_done: int) -> float:
        """Epsilon at :attr:`delta` after ``rounds_done`` rounds in which client ``k`` took part
        ``participations[k]`` times: the largest over the clients (0 before any took part)."""
        for client, count in participations.items():
            if client not in self._plans:
                raise ValueError(f"client {client} is not one of the ledger's {len(self.client_sizes)} clients")
            if count > rounds_done:
                raise ValueError(f"client {client} took part {count} times in {rounds_done} rounds")
        return max((self.client_epsilon(k, count) for k, count in participations.items() if count > 0),
                   default=0.0)

    def describe(self) -> dict[str, Any]:
        """The ledger's settings for ``summary.json`` (the caller adds the final epsilon)."""
        rates = [plan.rate for plan in self._plans.values()]
        steps = [self.epochs * plan.steps_per_epoch for plan in self._plans.values()]
        return {
            "mode": "sample",
            "clip": self.clip,
            "noise_multiplier": self.noise_multiplier,
            **({"target_epsilon": float(self.options.target_epsilon)} if self.options.target_epsilon > 0 else {}),
            "delta": self.delta,
            "accountant": self.accountant,
            "adjacency": "add or remove one training sample of a client (each client's own guarantee)",
            "sampling_rate": {"min": min(rates), "max": max(rates)},
            "steps_per_round": {"min": min(steps), "max": max(steps)},
            "participation": self.participation,
            "mechanisms": ["DP-SGD (per-sample clipped gradients, Poisson batches)",
                           "one release per round of noisy class counts and class means (num_examples, "
                           "class_counts, prototypes, class gradients, soft predictions)"],
        }
