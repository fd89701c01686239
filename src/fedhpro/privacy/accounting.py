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

``privacy.accountant`` picks how the events compose: ``rdp`` (Renyi DP, the default) or ``pld`` (privacy loss
distributions, dp-accounting's ``PLDAccountant`` with its pessimistic discretisation: an upper bound, typically
5-20 % below RDP's). The helpers here (:func:`event_epsilon`, :func:`calibrate`) are also
``privacy=sample``'s (:mod:`fedhpro.privacy.sample`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from fedhpro.errors import ConfigError
from fedhpro.privacy.options import PrivacyOptions

if TYPE_CHECKING:
    import dp_accounting

#: the name summary.json gives the accountant
ACCOUNTANT = "dp-accounting RdpAccountant (Renyi DP, Mironov 2017; Poisson subsampling, Mironov et al. 2019)"
#: the name summary.json gives the PLD accountant (``privacy.accountant=pld``)
PLD_ACCOUNTANT = ("dp-accounting PLDAccountant (privacy loss distributions, pessimistic estimate at a "
                  "discretisation of 1e-3; Poisson subsampling)")
#: the PLD accountant's grid of privacy-loss values: its pessimistic estimate bounds epsilon from above at any
#: grid, and 1e-3 (dp-accounting's default is 1e-4) measured 1e-6 relative above the finer grid at a tenth of its
#: time (a ledger composes afresh every round)
PLD_DISCRETIZATION = 1e-3
#: the values of ``privacy.accountant``
ACCOUNTANTS = ("rdp", "pld")
#: the sigma search of the target_epsilon calibration (both modes): no sigma outside it is tried
SIGMA_RANGE = (1e-3, 1e6)
#: the bisection steps at most (far more than a 1 % tolerance needs over SIGMA_RANGE)
CALIBRATION_STEPS = 100

#: the relative tolerance of the calibration: the planned rounds end within [target * (1 - 1e-2), target]
CALIBRATION_TOLERANCE = 0.005


#: the one line shown when dp-accounting is missing (privacy=client; privacy=sample names Opacus too)
INSTALL_HINT = ("privacy=client accounts with Google's dp-accounting, which is not installed; "
                "pip install 'fedhpro[privacy]'")


def _dp_accounting(hint: str = INSTALL_HINT) -> Any:
    """The ``dp_accounting`` package (the optional extra ``fedhpro[privacy]``), imported when first needed, so
    runs without privacy never load it; a one-line ConfigError (``hint``) naming the fix when it is not installed."""
    try:
        import dp_accounting
        import dp_accounting.pld  # noqa: F401 - PLDAccountant
        import dp_accounting.rdp  # noqa: F401 - RdpAccountant
    except ImportError:
        raise ConfigError(hint) from None
    return dp_accounting


def check_accountant(name: str) -> str:
    """``name`` if it is one of :data:`ACCOUNTANTS`, else a one-line ConfigError naming the choices."""
    if name not in ACCOUNTANTS:
        raise ConfigError(f"privacy.accountant={name!r} is not an accountant; use rdp or pld")
    return name


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


def round_event(noise_multiplier: float, sampling_rate: float, class_tensors: bool, local: bool,
                quantile_noise: float | None = None) -> dp_accounting.DpEvent:
    """One round's DP event for one client (module doc): central, Poisson-sampled at ``sampling_rate``;
    local, the client's own participation (``sigma / 2`` for the replace-one sensitivity ``2C``).
    ``quantile_noise``: adaptive clipping's indicator, released with this noise std (None: off): one more
    Gaussian, of multiplier ``2 quantile_noise`` (central: adding or removing a client moves the centred
    indicators' sum by 1/2) or ``quantile_noise`` (local: replacing the client's data moves its by 1)."""
    dpa = _dp_accounting()
    update = dpa.GaussianDpEvent(noise_multiplier / 2.0 if local else noise_multiplier)
    events: list[dp_accounting.DpEvent] = [update]
    if class_tensors:
        events.append(dpa.GaussianDpEvent(noise_multiplier))
    if quantile_noise is not None:
        events.append(dpa.GaussianDpEvent(quantile_noise if local else 2.0 * quantile_noise))
    event: dp_accounting.DpEvent = dpa.ComposedDpEvent(events) if len(events) > 1 else update
    if local:
        return event
    return dpa.PoissonSampledDpEvent(sampling_rate, event)


def _pld_event(event: Any) -> Any:
    """``event`` in the form dp-accounting's PLD accountant composes: a Poisson-sampled composition of Gaussians
    (one round of privacy=client with per-class tensors) becomes the Poisson-sampled single Gaussian of multiplier
    ``(sum sigma_i^-2)^-1/2``, the same mechanism (Gaussians released together compose exactly into one; the RDP
    accountant makes the same reduction)."""
    dpa = _dp_accounting()
    if isinstance(event, dpa.PoissonSampledDpEvent) and isinstance(event.event, dpa.ComposedDpEvent):
        inner = event.event.events
        if inner and all(isinstance(part, dpa.GaussianDpEvent) for part in inner):
            if any(part.noise_multiplier == 0 for part in inner):
                return dpa.PoissonSampledDpEvent(event.sampling_probability, dpa.GaussianDpEvent(0.0))
            sigma = sum(part.noise_multiplier ** -2 for part in inner) ** -0.5
            return dpa.PoissonSampledDpEvent(event.sampling_probability, dpa.GaussianDpEvent(sigma))
    if isinstance(event, dpa.ComposedDpEvent):
        return dpa.ComposedDpEvent([_pld_event(part) for part in event.events])
    if isinstance(event, dpa.SelfComposedDpEvent):
        return dpa.SelfComposedDpEvent(_pld_event(event.event), event.count)
    return event


def event_epsilon(event: dp_accounting.DpEvent, count: int, delta: float, local: bool,
                  orders: Sequence[float] | None = None, accountant: str = "rdp", hint: str = INSTALL_HINT) -> float:
    """Epsilon at ``delta`` of ``event`` composed ``count`` times (0 for none; inf without noise), by the
    ``accountant`` (``rdp``: over the RDP ``orders``, default dp-accounting's; ``pld``: privacy loss
    distributions), for replacing one element (``local``) or adding/removing one."""
    if count <= 0:
        return 0.0
    dpa = _dp_accounting(hint)
    relation = dpa.NeighboringRelation.REPLACE_ONE if local else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    if check_accountant(accountant) == "pld":
        # the local events (never sampled) already carry the replace-one sensitivity in their multipliers
        # (sigma / 2 for the update's 2C), as the RDP accountant reads an unsampled Gaussian under either
        # relation; the PLD accountant's REPLACE_ONE would double that sensitivity again, so add/remove here
        book: Any = dpa.pld.PLDAccountant(neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                          value_discretization_interval=PLD_DISCRETIZATION)
        event = _pld_event(event)
    else:
        book = dpa.rdp.RdpAccountant(orders=orders, neighboring_relation=relation)
    with _quiet_absl():
        book.compose(event, count)
        return float(book.get_epsilon(delta))


def calibrate(epsilon_of_sigma: Callable[[float], float], target: float, what: str,
              fix: str = "lower rounds/participation") -> float:
    """The sigma whose ``epsilon_of_sigma(sigma)`` lies in ``[target (1 - 2 tol), target]`` (epsilon falls as
    sigma grows), by bisection on ``log sigma`` over :data:`SIGMA_RANGE`; the one search of both privacy modes.
    ConfigError when no sigma in the range reaches the target (``fix``: what else the user can lower)."""
    low, high = SIGMA_RANGE[0], 1.0
    while epsilon_of_sigma(high) > target:
        low, high = high, high * 4.0
        if high > SIGMA_RANGE[1]:
            raise ConfigError(f"privacy.target_epsilon={target:g} cannot be reached for {what} with any noise "
                              f"multiplier up to {SIGMA_RANGE[1]:g}; raise the target or {fix}")
    if epsilon_of_sigma(low) <= target:
        return low  # even a tiny sigma meets the target
    for _ in range(CALIBRATION_STEPS):
        middle = math.sqrt(low * high)
        value = epsilon_of_sigma(middle)
        if value > target:
            low = middle
        else:
            high = middle
            if value >= target * (1.0 - 2 * CALIBRATION_TOLERANCE):
                break
    return high


def check_noise_cohort(noise_cohort: int, trained_cohort: float, num_clients: int, local: bool) -> float:
    """``privacy.noise_cohort``'s scale of the central noise, ``trained_cohort / noise_cohort`` (the noise on the
    mean update is then ``sigma C / noise_cohort``, as in a round where ``noise_cohort`` clipped uploads were
    summed and noised with ``sigma C``; pfl-research's ``noise_cohort_size``), after its one-line checks: central
    noise only (local noise is each client's own), at least the trained cohort ``q N`` (it simulates a larger
    one) and at most the ``N`` clients (the accountant's sampling rate ``noise_cohort / N``)."""
    if local:
        raise ConfigError("privacy.noise_cohort needs privacy.noise=central: under local noise each client noises "
                          "its own upload, whatever the cohort; set privacy.noise=central or privacy.noise_cohort=0")
    if noise_cohort > num_clients:
        raise ConfigError(f"privacy.noise_cohort={noise_cohort} is more than the federation's {num_clients} "
                          f"clients (the accountant samples noise_cohort / clients of them a round); give at most "
                          f"{num_clients}, or more clients")
    if noise_cohort < trained_cohort:
        raise ConfigError(f"privacy.noise_cohort={noise_cohort} is below the {trained_cohort:g} clients that train "
                          f"a round (participation x clients): it simulates a larger cohort; give at least "
                          f"{math.ceil(trained_cohort)}, or 0 for the run's own")
    return float(trained_cohort) / float(noise_cohort)


def quantile_noise_of(options: PrivacyOptions, expected_clients: float) -> float | None:
    """Adaptive clipping's indicator noise std (``privacy.quantile_noise``, or ``expected_clients / 20``, Andrew et
    al.'s choice, ``expected_clients`` the cohort the noise is calibrated for); None when adaptive clipping is off
    (``privacy.clip_quantile=0``)."""
    if not float(getattr(options, "clip_quantile", 0.0) or 0.0) > 0:
        return None
    given = float(getattr(options, "quantile_noise", 0.0) or 0.0)
    value = given if given > 0 else float(expected_clients) / 20.0
    if not value > 0:
        raise ConfigError("privacy.clip_quantile needs noise on the count of clients below the clip; set "
                          "privacy.quantile_noise > 0")
    return value


def noise_cohort_line(noise_cohort: int, trained_cohort: float) -> str:
    """What a run with ``privacy.noise_cohort`` says of its guarantee (its printout, summary.json)."""
    return (f"privacy.noise_cohort={noise_cohort}: the noise and the epsilon are those of {noise_cohort} clients a "
            f"round while {trained_cohort:g} train: a simulation of a larger cohort, not this run's own guarantee")


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
        orders: the RDP orders (default: dp-accounting's, fractional ones included; unused by pld).
    """

    def __init__(self, options: PrivacyOptions, num_clients: int, rounds: int, participation: float,
                 class_tensors: bool,
                 orders: Sequence[float] | None = None):
        self.options = options
        self.orders = list(orders) if orders is not None else None
        self.num_clients = int(num_clients)
        self.rounds = int(rounds)
        self.sampling_rate = float(min(max(participation, 0.0), 1.0))
        self.class_tensors = bool(class_tensors)
        self.local = options.noise == "local"
        #: privacy.noise_cohort (0: off): the clients a round the noise and the accountant assume
        self.noise_cohort = int(getattr(options, "noise_cohort", 0) or 0)
        #: what the central noise's std is multiplied by: the trained cohort over the noise cohort (1: off)
        self.noise_scale = 1.0
        if self.noise_cohort:
            self.trained_cohort = self.sampling_rate * self.num_clients
            self.noise_scale = check_noise_cohort(self.noise_cohort, self.trained_cohort, self.num_clients,
                                                  self.local)
            self.sampling_rate = self.noise_cohort / self.num_clients
        #: adaptive clipping's indicator noise (None: off), for the cohort the noise is calibrated for
        self.quantile_noise = quantile_noise_of(options, self.noise_cohort or self.sampling_rate * self.num_clients)
        self.kind = check_accountant(getattr(options, "accountant", "rdp"))
        self.accountant = PLD_ACCOUNTANT if self.kind == "pld" else ACCOUNTANT
        self.delta = float(options.delta) if options.delta > 0 else 1.0 / self.num_clients ** 1.1
        if not 0.0 < self.delta < 1.0:
            raise ConfigError(f"privacy.delta={self.delta:g} must be in (0, 1); with {self.num_clients} client(s) the "
                              "default 1/N^1.1 is not: set privacy.delta (e.g. 1e-5)")
        self._cache: dict[tuple[float, int], float] = {}
        if options.target_epsilon > 0:
            what = (f"{self.rounds} rounds of local noise" if self.local
                    else f"{self.rounds} rounds at sampling rate {self.sampling_rate:g}")
            fix = "lower rounds/participation" + (" or raise privacy.quantile_noise"
                                                  if self.quantile_noise is not None else "")
            self.noise_multiplier = calibrate(lambda sigma: self._epsilon(sigma, self.rounds),
                                              float(options.target_epsilon), what, fix)
        else:
            self.noise_multiplier = float(options.noise_multiplier)
        if not self.noise_multiplier > 0:
            raise ConfigError("privacy=client with privacy.noise_multiplier=0 adds no noise (epsilon would be "
                              "infinite); set privacy.noise_multiplier > 0 or privacy.target_epsilon")

    def _epsilon(self, sigma: float, count: int) -> float:
        key = (sigma, count)
        if key not in self._cache:
            event = round_event(sigma, self.sampling_rate, self.class_tensors, self.local, self.quantile_noise)
            self._cache[key] = event_epsilon(event, count, self.delta, self.local, self.orders, self.kind)
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
                          + (["holder counts of each class"] if self.class_tensors else [])
                          + (["count of clients below the clip (adaptive clipping)"]
                             if self.quantile_noise is not None else []),
            **({"clip_quantile": float(options.clip_quantile), "clip_lr": float(options.clip_lr),
                "quantile_noise": self.quantile_noise} if self.quantile_noise is not None else {}),
            **({"noise_cohort": self.noise_cohort, "trained_cohort": self.trained_cohort,
                "simulated": noise_cohort_line(self.noise_cohort, self.trained_cohort)}
               if self.noise_cohort else {}),
        }
