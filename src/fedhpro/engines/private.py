"""The round's privacy as objects the round protocol holds: who takes part (:mod:`fedhpro.engines.sampling`), the
accountant (:class:`Accountant`: epsilon after each round, the budget stop) and what privacy does to the
replies (:class:`RoundPrivacy`: nothing for ``privacy=none`` and ``privacy=sample``, whose clients privatize their
own training; :class:`ClientLevel` for ``privacy=client``, which also holds adaptive clipping's clip), all chosen
once by :func:`round_privacy` from the run's ``privacy.*`` options.

Client-level differential privacy (``privacy=client``, :mod:`fedhpro.privacy`) as steps of the reply chain.

Each reply arrives privatized (the engine ran :func:`~fedhpro.privacy.client.privatize_upload` on the client's
side: its ``weights`` are the clipped update, its counts public constants). The chain a privatized upload goes
through (:meth:`ClientLevel.chain`): the method's declared layout as privatized (exactly its keys and the privacy's,
:func:`~fedhpro.privacy.client.privatized_layout`), the injected faults (hostility scales the update around zero,
since the upload is the update itself), the method's checks of the upload as the method sees it
(:func:`method_view`), the privacy checks (:class:`PrivateChecks`: finite, the right shapes, the holder vector),
the bytes measured; then
:class:`PrivateFold` adds it to a :class:`~fedhpro.privacy.client.PrivateSum` instead of the method's replies.
At close the fold releases the noised sum with public denominators and hands the method ONE reply carrying the
privatized values (:func:`~fedhpro.privacy.client.private_reply`), so every method's mean is the privatized
value and its other server steps get privatized inputs.

The clients' training metrics are not collected (computed from the clients' data, they would leave unprotected),
no size bound applies (the denominators are public constants, not the clients' counts), and a round is never
skipped for too few replies (that count is not released).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from fedhpro.engines.chain import Fold, Incoming, ReplyStep, RoundChain, RoundState
from fedhpro.engines.class_rows import declared_class_keys
from fedhpro.engines.faults import InjectedFaults
from fedhpro.engines.replies import LayoutChecks, Measured, MethodChecks
from fedhpro.engines.sampling import FixedSampling, PoissonSampling, Sampling, SecretSampling
from fedhpro.errors import FedHProError
from fedhpro.privacy import client_level, is_private, privacy_mode
from fedhpro.privacy.accounting import ClientLedger
from fedhpro.privacy.client import (
    HOLDERS_KEY,
    PRIVATIZED_KEY,
    ClientPrivacy,
    PrivateSum,
    client_privacy,
    next_clip,
    private_reply,
    privatized_layout,
    upload_noise_generator,
)
from fedhpro.privacy.options import PrivacyOptions


def method_view(reply: Mapping[str, Any]) -> dict[str, Any]:
    """A privatized upload as the method's checks see it: without the privacy's own keys."""
    return {key: value for key, value in reply.items() if key not in (HOLDERS_KEY, PRIVATIZED_KEY)}


class PrivateChecks(ReplyStep):
    """The privacy's own checks of an upload (:meth:`~fedhpro.privacy.client.PrivateSum.problem`) against the
    round's private sum (``total``; as a link of the chain, the round's :class:`PrivateFold`'s)."""

    def __init__(self, total: PrivateSum | None = None) -> None:
        self.total = total

    def for_round(self, round: RoundState, fold: Fold) -> ReplyStep:
        if self.total is not None:
            return self
        if not isinstance(fold, PrivateFold):
            raise TypeError(f"PrivateChecks checks a PrivateFold's uploads, not a {type(fold).__name__}'s")
        return PrivateChecks(fold.total)

    def receive(self, incoming: Incoming, round: RoundState) -> str | None:
        problem = self.total.problem(incoming.reply) if self.total is not None else "no private sum to check it"
        return None if problem is None else f"invalid privatized update: {problem}"


class PrivatizedLayout(ReplyStep):
    """The layout checks of a privatized upload: the method's declared layout now, as privatized."""

    def __init__(self, adaptive: bool) -> None:
        self.adaptive = adaptive

    def for_round(self, round: RoundState, fold: Fold) -> ReplyStep:
        return LayoutChecks(privatized_layout(round.protocol.server.reply_layout(),
                                              round.num_classes if round.num_classes is not None else 0,
                                              self.adaptive))


class PrivateFold(Fold):
    """The accepted uploads' running sum (:class:`~fedhpro.privacy.client.PrivateSum`); at close its release,
    noised centrally from the server's noise stream, as the one reply the method aggregates. Every round is
    released, even one with no upload (noise only). ``privacy``: the run's :class:`ClientLevel`, whose settings
    (the clip of this round) it privatizes with and whose clip the release adapts."""

    skips: ClassVar[bool] = False

    def __init__(self, round: RoundState, privacy: ClientLevel) -> None:
        super().__init__(round)
        protocol = round.protocol
        self.privacy = privacy
        self.settings = privacy.settings
        self.total = PrivateSum(self.settings, round.global_weights, protocol.server.reply_layout(),
                                round.num_classes if round.num_classes is not None else 0,
                                protocol.participation * protocol.num_clients)

    def add(self, incoming: Incoming, round: RoundState) -> None:
        self.total.add(incoming.reply)

    @property
    def count(self) -> int:
        return len(self.replies) + self.total.count

    def aggregate(self, round: RoundState) -> dict[str, float]:
        protocol = round.protocol
        release = self.total.release(upload_noise_generator(self.settings, protocol.seed, round.round))
        self.replies.append(private_reply(release, round.global_weights, protocol.server.reply_layout()))
        if release.below_clip is not None:  # adaptive clipping: the next round's clip follows this release
            round.below_clip = release.below_clip
            self.privacy.adapt(release.below_clip)
        return protocol.server.aggregate(round.round, self.replies)


class Accountant:
    """The run's privacy ledger (:func:`fedhpro.privacy.ledger_for`) over its ``sampling``: epsilon after each
    round and the stop before a round that would take it above ``max_epsilon`` (``privacy.max_epsilon``; 0: no
    limit). :class:`NoAccountant` stands for it without privacy."""

    def __init__(self, ledger: Any, sampling: Sampling, rounds: int, max_epsilon: float) -> None:
        self.ledger = ledger
        self.sampling = sampling
        self.rounds = rounds
        self.max_epsilon = max_epsilon

    def epsilon_after(self, round: int) -> float | None:
        """Epsilon once ``round`` (from 0) is complete, from how often each client took part so far."""
        return float(self.ledger.epsilon(self.sampling.participations(round + 1), round + 1))

    def budget_stop(self, round: int) -> str | None:
        """The line that stops the run before ``round`` when completing it would take epsilon above
        ``max_epsilon``; None when it may run (or there is no limit)."""
        if self.max_epsilon <= 0:
            return None
        epsilon = self.epsilon_after(round)
        if epsilon is None or epsilon <= self.max_epsilon:
            return None
        spent = self.epsilon_after(round - 1) if round > 0 else 0.0
        return (f"privacy budget: stopped before round {round} of {self.rounds}: it would take epsilon to "
                f"{epsilon:.4g} > privacy.max_epsilon={self.max_epsilon:g} (delta={self.ledger.delta:.3g}); the "
                f"{round} rounds run (epsilon {spent:.4g}) are kept")

    def row(self, round: int) -> dict[str, float] | None:
        """What a round's row says of privacy: ``{epsilon, delta}`` after it."""
        epsilon = self.epsilon_after(round)
        return None if epsilon is None else {"epsilon": epsilon, "delta": float(self.ledger.delta)}

    def summary(self) -> dict[str, Any] | None:
        """The ledger's settings for ``summary.json``."""
        return dict(self.ledger.describe())


class NoAccountant(Accountant):
    """No privacy: no epsilon, no budget, nothing in the rows or the summary."""

    def __init__(self) -> None:
        self.ledger = None

    def epsilon_after(self, round: int) -> float | None:
        return None

    def budget_stop(self, round: int) -> str | None:
        return None

    def row(self, round: int) -> dict[str, float] | None:
        return None

    def summary(self) -> dict[str, Any] | None:
        return None


class RoundPrivacy:
    """What the run's privacy does to its rounds, for a run whose replies are not privatized (``privacy=none``,
    ``privacy=sample``: its clients privatize their own training): the ``sampling`` of its participants and its
    ``accountant``; every reply through the plain chain, every participant named in the rows."""

    #: what each client privatizes its upload with before it leaves (None: nothing)
    settings: ClientPrivacy | None = None

    def __init__(self, sampling: Sampling, accountant: Accountant) -> None:
        self.sampling = sampling
        self.accountant = accountant

    @property
    def publishes_participants(self) -> bool:
        """Whether a round's row names its participants (and dropped clients)."""
        return True

    @property
    def clip(self) -> float | None:
        """The clip of the round about to open (None: no upload is clipped)."""
        return None

    def chain(self, plain: RoundChain) -> RoundChain:
        """The chain the round's replies go through (``plain``: the one the run's options compose)."""
        return plain

    def weight_cap(self, cap: float) -> float:
        """The most weight one reply may buy (``cap``: what the run's sizes allow)."""
        return cap

    def bounds_content(self, asked: bool) -> bool:
        """Whether the round bounds each reply's pull at close (``asked``: what the options ask)."""
        return asked

    def round_row(self, round: RoundState) -> dict[str, Any]:
        """What ``round``'s row says of privacy: ``{"privacy": the accountant's}`` (``{}``: nothing)."""
        row = self.accountant.row(round.round)
        return {} if row is None else {"privacy": row}

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs of the privacy besides the seeds (``{}``: nothing, so that a checkpoint keeps
        its bytes)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``state``."""


class ClientLevel(RoundPrivacy):
    """``privacy=client``: every upload privatized by its client (:attr:`settings`), folded into a private sum
    released with noise (:meth:`chain`); no size bound (its denominators are public constants, not the
    clients' counts) and no content bound (the clip bounds every upload already); who took part stays out of
    the rows unless ``privacy.publish_participants``; with ``privacy.clip_quantile``, adaptive clipping's clip
    (:meth:`adapt`, kept in checkpoints)."""

    def __init__(self, sampling: Sampling, accountant: Accountant, settings: ClientPrivacy,
                 options: PrivacyOptions) -> None:
        super().__init__(sampling, accountant)
        self.settings: ClientPrivacy = settings
        self.options = options

    @property
    def publishes_participants(self) -> bool:
        return bool(getattr(self.options, "publish_participants", False))

    @property
    def clip(self) -> float | None:
        return self.settings.clip

    def chain(self, plain: RoundChain) -> RoundChain:
        """The steps a privatized upload goes through (the method's layout as privatized, the injected faults
        around zero, the method's checks of its view, the privacy's checks, the bytes), into a
        :class:`PrivateFold`."""
        return RoundChain([PrivatizedLayout(self.settings.adaptive), InjectedFaults(view=method_view, deltas=True),
                           MethodChecks(view=method_view), PrivateChecks(), Measured()],
                          lambda round: PrivateFold(round, self))

    def weight_cap(self, cap: float) -> float:
        return math.inf

    def bounds_content(self, asked: bool) -> bool:
        return False

    def round_row(self, round: RoundState) -> dict[str, Any]:
        """The accountant's, and with adaptive clipping the round's clip and its released fraction below."""
        entries = super().round_row(round)
        clip = getattr(round, "clip", None)
        if entries and round.below_clip is not None and clip is not None:
            entries["privacy"].update(clip=clip, below_clip=round.below_clip)
        return entries

    def adapt(self, below: float) -> None:
        """Adaptive clipping (``privacy.clip_quantile``): the next round's clip from this round's released
        fraction of clients below the clip (:func:`~fedhpro.privacy.client.next_clip`); nothing otherwise."""
        if not self.settings.adaptive:
            return
        clip = next_clip(self.settings.clip, below, float(self.options.clip_quantile), float(self.options.clip_lr))
        self.settings = dataclasses.replace(self.settings, clip=clip)

    def state_dict(self) -> dict[str, Any]:
        """Adaptive clipping's current clip (``{}`` without it)."""
        return {"clip": float(self.settings.clip)} if self.settings.adaptive else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint's clip (a positive finite clip, else a ValueError the run's resume turns
        into one line)."""
        if not self.settings.adaptive:
            return
        clip = state.get("clip") if isinstance(state, Mapping) else None
        if not isinstance(clip, float) or not math.isfinite(clip) or not clip > 0:
            raise ValueError(f"the checkpoint's adaptive clip {clip!r} is not a positive number")
        self.settings = dataclasses.replace(self.settings, clip=clip)


def round_privacy(options: PrivacyOptions | None, ledger: Any, server: Any, *, seed: int, num_clients: int, rounds: int,
                  participation: float, robust_needs: bool, rule_name: str, dp_clipping: str) -> RoundPrivacy:
    """The run's privacy as the round protocol holds it, chosen once from its ``privacy.*`` options
    (``options``; None or ``mode=none``: off) and ``ledger`` (:func:`fedhpro.privacy.ledger_for`; built here
    for ``privacy=client`` when None, needed for ``privacy=sample``). ``privacy.clipping=auto`` means
    ``dp_clipping`` (the method's :attr:`~fedhpro.methods.base.MethodSpec.dp_clipping`). A robust rule that
    needs each client's update (``robust_needs``) cannot go with ``privacy=client``: one line naming it."""
    if options is None or not is_private(options):
        return RoundPrivacy(FixedSampling(seed, num_clients, participation), NoAccountant())
    if getattr(options, "clipping", None) == "auto":
        options = dataclasses.replace(options, clipping=dp_clipping)
    max_epsilon = float(getattr(options, "max_epsilon", 0.0) or 0.0)
    if not client_level(options):
        if ledger is None:
            raise FedHProError(f"privacy={privacy_mode(options)} needs the run's privacy ledger "
                               "(fedhpro.privacy.ledger_for) given to the round protocol as ledger=")
        sampling: Sampling = FixedSampling(seed, num_clients, participation)
        return RoundPrivacy(sampling, Accountant(ledger, sampling, rounds, max_epsilon))
    if robust_needs:
        raise FedHProError(f"privacy=client cannot go with aggregation={rule_name}: it needs each client's own "
                           "update; use aggregation=mean")
    if ledger is None:
        ledger = ClientLedger(options, num_clients, rounds, participation, bool(declared_class_keys(server)))
    settings = client_privacy(options, ledger.noise_multiplier, getattr(ledger, "noise_scale", 1.0),
                              getattr(ledger, "quantile_noise", None))
    # amplification by sampling assumes nobody who sees the model knows who took part: with secure noise the
    # draw comes from the operating system, not from the config's seed
    sampling = (SecretSampling if settings.secure_noise else PoissonSampling)(seed, num_clients, participation)
    return ClientLevel(sampling, Accountant(ledger, sampling, rounds, max_epsilon), settings, options)


__all__ = ["Accountant", "ClientLevel", "NoAccountant", "PrivateChecks", "PrivateFold", "PrivatizedLayout",
           "RoundPrivacy", "method_view", "round_privacy"]
