"""Differential privacy of a run (``privacy=none|client|sample``) and its privacy ledger.

* ``privacy=client`` (:mod:`fedhpro.privacy.client`, :mod:`fedhpro.privacy.accounting`): client-level DP
  for every method, on both engines: each participating client's whole upload is clipped, Gaussian noise
  is added to the sum (central) or by each client (local), and the server aggregates with public
  denominators. The round protocol (:mod:`fedhpro.engines.protocol`) runs the server side, an engine
  calls :func:`~fedhpro.privacy.client.privatize_upload` on each client's reply before it leaves.
* ``privacy=sample`` (``fedhpro.privacy.sample``, optional): sample-level DP-SGD in every client's local
  training.

Either way a :class:`Ledger` tracks (epsilon, delta): after every round in ``metrics.jsonl``, on the
progress bar and in ``summary.json``; :func:`ledger_for` builds the one of a config (``privacy.accountant``:
``rdp`` or ``pld``), :func:`privacy_warnings` the lines a run says before its first round (a delta too large for
its population), :func:`private_train_settings` the local training settings of ``privacy=sample``.

The options (:class:`~fedhpro.privacy.options.PrivacyOptions`) are declared beside this code in
:mod:`fedhpro.privacy.options`, torch-free; so is this package's ``__init__``: the client-side mechanism
(:mod:`fedhpro.privacy.client`) and the DP-SGD ledger (:mod:`fedhpro.privacy.sample`), which import torch, are
loaded on first use of their names, so that reading a config's ``privacy.*`` keys never loads torch.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from fedhpro.aggregation import AGGREGATION_RULES
from fedhpro.errors import ConfigError
from fedhpro.privacy.accounting import ClientLedger, noise_cohort_line
from fedhpro.privacy.options import (
    CLIENT_LEVEL,
    OFF,
    PRIVACY_MODES,
    SAMPLE_LEVEL,
    PrivacyOptions,
    client_level,
    is_private,
    privacy_mode,
    sample_level,
)

if TYPE_CHECKING:
    from fedhpro.privacy.client import (
        HOLDERS_KEY,
        PRIVATIZED_KEY,
        ClientPrivacy,
        PrivacyError,
        PrivateSum,
        client_privacy,
        privatize_upload,
        privatized_layout,
        upload_noise_generator,
    )
    from fedhpro.privacy.sample import SampleLedger

#: names of the modules that import torch, loaded on their first use (:func:`__getattr__`)
_LAZY = {name: "fedhpro.privacy.client" for name in (
    "HOLDERS_KEY", "PRIVATIZED_KEY", "ClientPrivacy", "PrivacyError", "PrivateSum", "client_privacy",
    "privatize_upload", "privatized_layout", "upload_noise_generator")}
_LAZY["SampleLedger"] = "fedhpro.privacy.sample"


def __getattr__(name: str) -> Any:
    # the mechanism's modules import torch: loaded when a run uses them, never to read a config
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fedhpro.privacy' has no attribute {name!r}")


#: a delta at or above this is warned about whatever the population: the guarantee may fail outright with
#: that probability (the default ``1 / N^1.1`` reaches it with 8 clients or samples or fewer)
VACUOUS_DELTA = 0.1


@runtime_checkable
class Ledger(Protocol):
    """What the run asks of a privacy ledger (``privacy=client`` or ``sample``).

    ``noise_multiplier``: sigma, as given or calibrated to ``privacy.target_epsilon``; ``delta``: the DP
    delta (``privacy.delta``, or the mode's default); :meth:`epsilon`: the guarantee after ``rounds_done``
    rounds in which client ``k`` took part ``participations[k]`` times (clients that never did may be
    missing); :meth:`describe`: the ledger's settings for ``summary.json`` (mode, clip, sigma, sampling
    rate, delta, accountant). An implementation need not inherit from this class (and must not import
    this package's ``__init__`` if this package imports it: no import circle).
    """

    noise_multiplier: float
    delta: float

    def epsilon(self, participations: Mapping[int, int], rounds_done: int) -> float: ...

    def describe(self) -> dict[str, Any]: ...


class RunSettings(Protocol):
    """What the privacy of a run reads of its run keys (the fields of :class:`fedhpro.config.RunOptions` of these
    names): this package sits below the config and may not import it."""

    rounds: int
    participation: float
    min_clients: int


class RuleSetting(Protocol):
    """What the privacy of a run reads of its ``aggregation.*`` section: the robust rule's name."""

    rule: str


class PrivateConfig(Protocol):
    """What the privacy of a run reads of its config (a :class:`fedhpro.config.Config` is one): the run keys, the
    ``privacy.*`` section and the aggregation rule."""

    @property
    def run(self) -> RunSettings: ...

    @property
    def privacy(self) -> PrivacyOptions: ...

    @property
    def aggregation(self) -> RuleSetting: ...


def ledger_for(config: PrivateConfig, client_sizes: Sequence[int], train_settings: Any, *,
               class_tensors: bool = True) -> Ledger | None:
    """The privacy ledger of ``config`` (a :class:`~fedhpro.config.Config`) for clients holding
    ``client_sizes`` training samples: None with ``privacy=none``; ``privacy=client``: a
    :class:`~fedhpro.privacy.accounting.ClientLedger` (``class_tensors``: whether the method uploads
    per-class tensors, whose holder counts are then privatized too: ``bool(declared_class_keys(server))``);
    ``privacy=sample``: ``fedhpro.privacy.sample.SampleLedger`` (needs ``pip install fedhpro[privacy]``)."""
    options = config.privacy
    run = config.run
    if not is_private(options):
        return None
    if client_level(options):
        return ClientLedger(options, len(client_sizes), run.rounds, run.participation, class_tensors)
    if sample_level(options):
        # DP-SGD's ledger imports the training settings (torch): loaded for a privacy=sample run only
        from fedhpro.privacy.sample import SampleLedger

        return SampleLedger(options, client_sizes, train_settings, run.rounds, run.participation)
    raise ConfigError(f"privacy={options.mode!r} is not a privacy mode; use none, client or sample")


def privacy_warnings(options: PrivacyOptions, num_clients: int, client_sizes: Sequence[int]) -> list[str]:
    """The run's warning lines about its delta (one line each, naming the fix; ``[]`` when there is none):
    ``privacy.delta`` (or the mode's default ``1 / N^1.1``) at least ``1 / N`` or at least :data:`VACUOUS_DELTA`,
    a near-vacuous guarantee (a mechanism that publishes one of the ``N`` records outright with probability
    delta meets it). ``N``: ``num_clients`` under ``privacy=client``; each client's ``client_sizes[k]`` (its
    training samples) under ``privacy=sample``, where one line names the clients concerned (the default delta
    ``1 / n^1.1`` of the smallest client can be above ``1 / n`` of a larger one). ``options``:
    ``config.privacy``. A delta the ledger refuses (not in (0, 1)) is left to its one-line error."""
    if client_level(options):
        populations = {"the federation": int(num_clients)}
        unit, fix = "clients", "use more clients"
    elif sample_level(options):
        populations = {f"client {k}": int(n) for k, n in enumerate(client_sizes)}
        unit, fix = "samples", "give the clients more samples"
    else:
        return []
    if not populations or min(populations.values()) < 1:
        return []
    smallest = min(populations.values())
    given = float(options.delta) > 0
    delta = float(options.delta) if given else 1.0 / smallest ** 1.1
    if not 0.0 < delta < 1.0:
        return []
    weak = [name for name, n in populations.items() if delta >= min(1.0 / n, VACUOUS_DELTA)]
    if not weak:
        return []
    n = max(populations[name] for name in weak)  # the population delta falls shortest for
    suggested = 10.0 ** (math.floor(math.log10(min(1.0 / max(populations.values()), VACUOUS_DELTA))) - 1)
    where = (f"{n} {unit}" if client_level(options)
             else f"{len(weak)} of {len(populations)} client(s), the largest with {n} {unit}")
    why = f"at least 1/N = {1.0 / n:.4g}" if delta >= 1.0 / n else f"at least {VACUOUS_DELTA:g}"
    return [f"privacy.delta={delta:.4g} ({'as set' if given else 'the default 1/N^1.1'}) is {why} for {where}: "
            f"a near-vacuous guarantee (publishing one of the N records outright with probability delta meets it); "
            f"{fix} or set privacy.delta={suggested:g}"]


def noise_cohort_warnings(config: PrivateConfig, num_clients: int) -> list[str]:
    """With ``privacy.noise_cohort`` (``privacy=client``), the line that says the run's epsilon is a larger
    cohort's, not its own (:func:`~fedhpro.privacy.accounting.noise_cohort_line`); else ``[]``."""
    cohort = int(getattr(config.privacy, "noise_cohort", 0) or 0)
    if not cohort or not client_level(config.privacy):
        return []
    return [noise_cohort_line(cohort, float(config.run.participation) * int(num_clients))]


def private_train_settings(config: PrivateConfig, train: Any, ledger: Ledger) -> Any:
    """``privacy=sample``: the local training settings ``train`` (a :class:`~fedhpro.methods.training.TrainSettings`)
    with DP-SGD on: ``dp_clip`` (``privacy.clip``), ``dp_noise_multiplier`` (the ledger's sigma, as given or
    calibrated) and ``dp_secure_noise`` (``privacy.secure_noise``; unset counts as false: seeded noise)."""
    return dataclasses.replace(train, dp_clip=float(config.privacy.clip),
                               dp_noise_multiplier=float(ledger.noise_multiplier),
                               dp_secure_noise=bool(config.privacy.secure_noise))


def check_combinations(config: PrivateConfig) -> None:
    """One-line ConfigError for settings that cannot go with ``privacy=client``: robust aggregation rules and
    ``min_clients > 1`` read or count individual replies, which client-level DP hides from the server;
    ``privacy.noise_cohort`` without client-level DP's central noise has no noise to calibrate."""
    cohort = int(getattr(config.privacy, "noise_cohort", 0) or 0)
    if cohort and not client_level(config.privacy):
        raise ConfigError(f"privacy.noise_cohort={cohort} calibrates client-level DP's central noise, but "
                          f"privacy={privacy_mode(config.privacy)}; set privacy=client or privacy.noise_cohort=0")
    if not client_level(config.privacy):
        return
    rule = config.aggregation.rule
    if AGGREGATION_RULES.get(rule):
        raise ConfigError(f"privacy=client cannot go with aggregation={rule}: {rule} needs "
                          f"{AGGREGATION_RULES[rule]} of each client's own update, "
                          "but under client-level DP the server only releases their noised sum (clipping already "
                          "bounds any one client's influence); use aggregation=mean")
    if config.run.min_clients > 1:
        raise ConfigError(f"privacy=client cannot go with min_clients={config.run.min_clients}: skipping a round "
                          "on the number of valid replies would release that count without noise; the server "
                          "releases the noised sum of every round instead; use min_clients=1")


__all__ = ["CLIENT_LEVEL", "HOLDERS_KEY", "OFF", "PRIVACY_MODES", "PRIVATIZED_KEY", "PrivacyOptions", "SAMPLE_LEVEL",
           "SampleLedger", "VACUOUS_DELTA", "ClientLedger", "ClientPrivacy", "client_level", "is_private",
           "privacy_mode", "sample_level",
           "Ledger", "PrivacyError", "PrivateSum", "check_combinations", "client_privacy", "ledger_for",
           "noise_cohort_warnings",
           "privacy_warnings", "private_train_settings", "privatize_upload", "privatized_layout",
           "upload_noise_generator"]
