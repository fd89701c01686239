"""The round protocol as a chain of steps (the shape of pfl-research's postprocessors and Flower's strategy
wrappers): what a reply goes through on its way in, and what the round makes of the accepted replies at close.

* :class:`ReplyStep`: one step every reply goes through, in order (:meth:`ReplyStep.receive`). A step may
  change the reply (a hostile fault, a row bound, a weight cap), record what it did in the round, or refuse the
  reply by returning the reason; the round then drops the client with that reason and the chain stops.
* :class:`Fold`: where an accepted reply goes (:meth:`Fold.add`) and what the round hands the method at close
  (:meth:`Fold.aggregate`): the method's running sum as replies arrive (:class:`PlainFold`), the replies kept
  whole for a robust rule (:class:`fedhpro.engines.robust.RobustFold`), or a private sum released with noise
  (:class:`fedhpro.engines.private.PrivateFold`); :class:`fedhpro.engines.content.BoundedFold` holds the
  replies until close and hands another fold each one bounded (``aggregation.update_bound``).

:class:`RoundState` is what steps read and write of the round in progress (the round protocol's
:class:`~fedhpro.engines.protocol.OpenRound` is one); :class:`Incoming` is one reply on its way in.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor


class Reception(enum.Enum):
    """What became of a reply: accepted, or refused because the client's own update was invalid, or
    because a transmission fault (``faults.corrupt``) spoiled a good one, or because the injected
    hostility (``faults.scale`` / ``faults.sign_flip``) made a good one fail the method's checks (the
    client's own state stands, as for a transmission fault). True only when accepted."""

    ACCEPTED = "accepted"
    INVALID = "invalid"
    CORRUPTED = "corrupted"
    HOSTILE = "hostile"

    def __bool__(self) -> bool:
        return self is Reception.ACCEPTED


@dataclass
class Incoming:
    """One client's reply on its way through the chain."""

    client: int
    reply: Any
    #: the client's training metrics (n_k-weighted into the round's ``train``)
    metrics: dict[str, float]
    #: the training samples the client holds (as the engine knows it)
    num_samples: int
    #: its aggregation weight: ``num_samples`` until a cap lowers it
    weight: int
    #: the reply's weights when they are the client's working model's own tensors (an engine's
    #: ``borrowed=True``), valid only until :meth:`~fedhpro.engines.protocol.OpenRound.receive` returns
    views: Mapping[str, Tensor] | None = None
    #: whose fault a refusal from here on is: the client's own (ACCEPTED so far), or the injected fault's
    fault: Reception = Reception.ACCEPTED

    def refused(self) -> Reception:
        """What a refusal now says: INVALID (the client's own update) unless an injected fault changed it."""
        return Reception.INVALID if self.fault is Reception.ACCEPTED else self.fault

    def kept_whole(self) -> dict[str, Any]:
        """The reply, its weights copied if they are still the client's working model's tensors: for a fold
        that keeps the reply past this call."""
        if self.views is not None and self.reply.get("weights") is self.views:
            return {**self.reply, "weights": {key: value.clone() for key, value in self.views.items()}}
        return self.reply


@dataclass
class RoundState:
    """What the steps of a round read and write: the round, its broadcast and what it measured so far."""

    protocol: Any
    round: int
    payload: Mapping[str, Any]
    #: the method's number of classes (the length of class_counts), None if its server does not say
    num_classes: int | None
    dropped: list[dict[str, Any]] = field(default_factory=list)
    #: whether each answering client's reply arrives corrupted (faults.corrupt), by client
    corrupt: dict[int, bool] = field(default_factory=dict)
    #: the factor each hostile answering client multiplies its update by (faults.scale / sign_flip)
    hostile: dict[int, float] = field(default_factory=dict)
    #: the replies a weight cap lowered, and the class rows aggregation.max_row_norm scaled down
    capped: list[dict[str, Any]] = field(default_factory=list)
    rows_bounded: list[dict[str, int]] = field(default_factory=list)
    #: the replies aggregation.update_bound scaled down at close: ``{"client", "factor"}`` (the update) and/or
    #: ``"rows"`` (how many class rows)
    bounded: list[dict[str, Any]] = field(default_factory=list)
    train_metrics: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    bytes_up: int = 0
    params_up: int = 0
    #: adaptive clipping (privacy.clip_quantile): the round's released fraction of clients below the clip
    below_clip: float | None = None

    @property
    def global_weights(self) -> Mapping[str, Tensor]:
        """The weights the round broadcast (the reference of every update ``w_k - w_global``)."""
        return self.payload.get("weights") or {}


class ReplyStep:
    """One step of the chain every reply goes through (the base class passes every reply unchanged)."""

    def for_round(self, round: RoundState, fold: Fold) -> ReplyStep | None:
        """The step this link of a :class:`RoundChain` is in ``round``, whose accepted replies go into ``fold``:
        itself (the default), a step made for the round (one that reads what only the round knows: the
        method's layout now, the weight cap, the round's private sum), or None to sit the round out."""
        return self

    def receive(self, incoming: Incoming, round: RoundState) -> str | None:
        """Look at (and possibly change) ``incoming.reply``; return the reason to refuse it (the ``reason`` of the
        round's ``dropped`` entry), or None to pass it on."""
        return None


class Fold:
    """Where the accepted replies go, and what the round hands the method at close."""

    #: whether a round with fewer than ``min_clients`` accepted replies is skipped (the global model kept)
    skips: ClassVar[bool] = True

    def __init__(self, round: RoundState) -> None:
        #: the method's container of the round's replies (``server.new_replies()``), which it aggregates
        self.replies = round.protocol.server.new_replies()
        #: replies kept whole until close (a robust rule's), none here
        self.held: list[dict[str, Any]] = []

    def add(self, incoming: Incoming, round: RoundState) -> None:
        """Take an accepted reply."""
        reply = incoming.reply if getattr(self.replies, "folds_weights", False) else incoming.kept_whole()
        self.replies.append(reply)

    @property
    def count(self) -> int:
        """How many replies it took."""
        return len(self.replies) + len(self.held)

    def aggregate(self, round: RoundState) -> dict[str, float]:
        """The server step (the method's ``aggregate``); its server metrics."""
        return round.protocol.server.aggregate(round.round, self.replies)


class PlainFold(Fold):
    """``aggregation=mean``: each reply into the method's container as it arrives (the server's running sum of
    weights, one model's memory), aggregated by the method's own rule."""


#: a fold around the round's fold, as Flower's strategy wrappers wrap a strategy: it takes the accepted replies
#: and hands the inner fold what it makes of them (:class:`fedhpro.engines.content.BoundedFold`)
FoldWrapper = Callable[[RoundState, Fold], Fold]


@dataclass
class RoundChain:
    """The chain every round is composed from, built once a run (the shape of pfl-research's postprocessor list):
    ``links``, the steps every reply goes through in order (each link made the round's step by
    :meth:`ReplyStep.for_round`); ``fold``, the round's fold of the accepted replies; ``wrappers``, folds around
    it, innermost first. A list a user extends::

        protocol.round_chain.links.append(MyStep())                      # after the built-in steps
        index = next(i for i, link in enumerate(protocol.round_chain.links) if isinstance(link, WeightCap))
        protocol.round_chain.links.insert(index, MyStep())               # or before one of them
        protocol.round_chain.wrappers.append(lambda round, fold: MyFold(round, fold))

    (the round protocol's ``steps=`` appends to ``links``); a round opened after the change goes through it."""

    links: list[ReplyStep]
    fold: Callable[[RoundState], Fold]
    wrappers: list[FoldWrapper] = field(default_factory=list)

    def open(self, round: RoundState) -> tuple[list[ReplyStep], Fold]:
        """``round``'s steps, in order, and the fold its accepted replies go into."""
        fold = self.fold(round)
        for wrap in self.wrappers:
            fold = wrap(round, fold)
        steps = [link.for_round(round, fold) for link in self.links]
        return [step for step in steps if step is not None], fold


def zeros_like_weights(weights: Mapping[str, Any]) -> dict[str, Tensor]:
    """Zeros of the shape of each tensor of ``weights`` (the reference of an upload that is its own update)."""
    return {key: torch.zeros_like(value) for key, value in weights.items() if isinstance(value, Tensor)}


__all__ = ["Fold", "FoldWrapper", "Incoming", "PlainFold", "Reception", "ReplyStep", "RoundChain", "RoundState",
           "zeros_like_weights"]
