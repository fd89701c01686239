"""The accountant of ``privacy=client``: (epsilon, delta) after every round, from Google's dp-accounting.

One round of client-level DP releases two Gaussian mechanisms on the participants' privatized uploads
(:mod:`fedhpro.privacy.client`): the sum of the clipped vectors ``u_k`` (L2 norm at most ``C``, noise
std ``sigma C``) and, for a method with per-class tensors, the holder counts (0/1 vectors of L2 norm at
most ``sqrt(classes)``, noise std ``sigma sqrt(classes)``); both have noise multiplier ``sigma`` relative to
their sensitivity, so the round is their composition (one Gaussian of multiplier ``sigma / sqrt(2)``).

* ``noise=central``: the guarantee of the released global state (the models, prototypes and whatever is
  computed from them) against anyone who sees it, for **adding or removing one client** (its whole
  data): each round is a Poisson-sampled event with the real sampling rate ``q`` (the protocol samples
  each client with probability ``q = participation``), composed over the rounds run
  (``PoissonSampledDpEvent(q, ComposedDpEvent([Gaussian(sigma), Gaussian(sigma)]))``, self-composed).
* ``noise=local``: each client's guarantee **against the server itself**, which knows who sent what, so
  there is no amplification by sampling; for **replacing that client's data** (the server knows the
  client exists), the update's sensitivity is ``2C`` (multiplier ``sigma / 2``) and the holders'
  ``sqrt(classes)`` (entries in {0, 1}); composed over the rounds the client took part in; the run's
  epsilon is the largest over the clients.

``delta`` defaults to ``1 / N^1.1`` (``N`` clients). ``privacy.target_epsilon`` calibrates sigma by
bisection so that the planned ``rounds`` end at the target (within 1 %, from below): for central noise
after ``rounds`` rounds, for local noise after ``rounds`` participations (a client sampled in every
round; with ``participation < 1`` the clients' real epsilons are then lower).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from fedhpro.errors import ConfigError

if TYPE_CHECKING:
    import dp_accounting

#: the name summary.json gives the accountant
ACCOUNTANT = "dp-accounting RdpAccountant (Renyi DP, Mironov 2017; Poisson subsampling, Mironov et al. 2019)"

#: the relative tolerance of the calibration: the planned rounds end within [target * (1 - 1e-2), target]
CALIBRATION_TOLERANCE = 0.005


def _dp_accounting() -> Any:
    """The ``dp_accounting`` package (the optional extra ``fedhpro[privacy]``), imported when first needed, so
    runs without privacy never load it; a one-line ConfigError naming the fix when it is not installed."""
    try:
        import dp_accounting
        import dp_accounting.rdp  # noqa: F401 - RdpAccountant
    except ImportError:
        raise ConfigError("privacy=client accounts with Google's dp-accounting, which is not installed; "
                          "pip install 'fedhpro[privacy]'") from None
    return dp_accounting


@contextmanager
def _quiet_absl() -> Iterator[None]:
    """dp-accounting logs a warning for each fractional RDP order whose series does not converge (it then
    leaves that order out, which can only make epsilon larger): keep them off the run's output."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def round_event(noise_multiplier: float, sampling_rate: float, class_tensors: bool, local: bool
                ) -> dp_accounting.DpEvent:
    """One round's DP event for one client (module doc): central, Poisson-sampled at ``sampling_rate``;
    local, the client's own participation (``sigma / 2`` for the replace-one sensitivity ``2C``)."""
    dpa = _dp_accounting()
    update = dpa.GaussianDpEvent(noise_multiplier / 2.0 if local else noise_multiplier)
    events: list[dp_accounting.DpEvent] = [update]
    if class_tensors:
        events.append(dpa.GaussianDpEvent(noise_multiplier))
    event: dp_accounting.DpEvent = dpa.ComposedDpEvent(events) if len(events) > 1 else update
    if local:
        return event
    return dpa.PoissonSampledDpEvent(sampling_rate, event)


def event_epsilon(event: dp_accounting.DpEvent, count: int, delta: float, local: bool,
                  orders: Sequence[float] | None = None) -> float:
    """Epsilon at ``delta`` of ``event`` composed ``count`` times (0 for none; inf without noise), over the RDP
    ``orders`` (default: dp-accounting's)."""
    if count <= 0:
        return 0.0
    dpa = _dp_accounting()
    relation = dpa.NeighboringRelation.REPLACE_ONE if local else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    accountant = dpa.rdp.RdpAccountant(orders=orders, neighboring_relation=relation)
    with _quiet_absl():
        accountant.compose(event, count)
        return float(accountant.get_epsilon(delta))


def calibrate(epsilon_of_sigma: Callable[[float], float], target: float, what: str) -> float:
    """The sigma whose ``epsilon_of_sigma(sigma)`` lies in ``[target (1 - 2 tol), target]`` (epsilon falls as
    sigma grows), by bisection on ``log sigma``; ConfigError when no sigma in ``[1e-3, 1e6]`` reaches it."""
    low, high = 1e-3, 1.0
    while epsilon_of_sigma(high) > target:
        low, high = high, high * 4.0
        if high > 1e6:
            raise ConfigError(f"privacy.target_epsilon={target} cannot be reached for {what} with any noise "
                              "multiplier up to 1e6; raise the target or lower rounds/participation")
    if epsilon_of_sigma(low) <= target:
        return low  # even a tiny sigma meets the target
    for _ in range(100):
        middle = math.sqrt(low * high)
        value = epsilon_of_sigma(middle)
        if value > target:
            low = middle
        else:
            high = middle
            if value >= target * (1.0 - 2 * CALIBRATION_TOLERANCE):
                break
    return high


class ClientLedger:
    """The privacy ledger of ``privacy=client`` (the :class:`fedhpro.privacy.Ledger` interface).

    Args:
        options: the ``privacy.*`` options (``config.privacy``: clip, clipping, noise, noise_multiplier,
            target_epsilon, delta).
        num_clients: ``N``, the federation's clients (the default delta is ``1 / N^1.1``).
        rounds: the planned rounds (what ``target_epsilon`` is calibrated for).
        participation: ``q``, the Poisson sampling rate of each client in each round.
        class_tensors: whether the method uploads per-class tensors (then the holder counts are a second
            Gaussian mechanism every round).
        orders: the RDP orders (default: dp-accounting's, fractional ones included).
    """

    accountant = ACCOUNTANT

    def __init__(self, options: Any, num_clients: int, rounds: int, participation: float, class_tensors: bool,
                 orders: Sequence[float] | None = None):
        self.options = options
        self.orders = list(orders) if orders is not None else None
        self.num_clients = int(num_clients)
        self.rounds = int(rounds)
        self.sampling_rate = float(min(max(participation, 0.0), 1.0))
        self.class_tensors = bool(class_tensors)
        self.local = options.noise == "local"
        self.delta = float(options.delta) if options.delta > 0 else 1.0 / self.num_clients ** 1.1
        if not 0.0 < self.delta < 1.0:
            raise ConfigError(f"privacy.delta={self.delta:g} must be in (0, 1); with {self.num_clients} client(s) the "
                              "default 1/N^1.1 is not: set privacy.delta (e.g. 1e-5)")
        self._cache: dict[tuple[float, int], float] = {}
        if options.target_epsilon > 0:
            what = (f"{self.rounds} rounds of local noise" if self.local
                    else f"{self.rounds} rounds at sampling rate {self.sampling_rate:g}")
            self.noise_multiplier = calibrate(lambda sigma: self._epsilon(sigma, self.rounds),
                                              float(options.target_epsilon), what)
        else:
            self.noise_multiplier = float(options.noise_multiplier)
        if not self.noise_multiplier > 0:
            raise ConfigError("privacy=client with privacy.noise_multiplier=0 adds no noise (epsilon would be "
                              "infinite); set privacy.noise_multiplier > 0 or privacy.target_epsilon")

    def _epsilon(self, sigma: float, count: int) -> float:
        key = (sigma, count)
        if key not in self._cache:
            event = round_event(sigma, self.sampling_rate, self.class_tensors, self.local)
            self._cache[key] = event_epsilon(event, count, self.delta, self.local, self.orders)
        return self._cache[key]

    def epsilon(self, participations: Mapping[int, int], rounds_done: int) -> float:
        """Epsilon at :attr:`delta` after ``rounds_done`` rounds in which client ``k`` took part
        ``participations[k]`` times: central noise counts the rounds, local noise the participations of the
        client that took part most."""
        count = max(participations.values(), default=0) if self.local else rounds_done
        return self._epsilon(self.noise_multiplier, int(count))

    def describe(self) -> dict[str, Any]:
        """The ledger's settings for ``summary.json`` (the caller adds the final epsilon)."""
        options = self.options
        return {
            "mode": "client",
            "noise": options.noise,
            "clip": float(options.clip),
            "clipping": options.clipping,
            "noise_multiplier": self.noise_multiplier,
            **({"target_epsilon": float(options.target_epsilon)} if options.target_epsilon > 0 else {}),
            "sampling_rate": self.sampling_rate,
            "delta": self.delta,
            "accountant": self.accountant,
            "adjacency": ("replace one client's data, against the server (local noise: no amplification by "
                          "sampling)" if self.local else "add or remove one client (central noise)"),
            "mechanisms": ["clipped upload (weights update and per-class tensors)"]
                          + (["holder counts of each class"] if self.class_tensors else []),
        }
