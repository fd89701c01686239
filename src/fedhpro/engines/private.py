"""Client-level differential privacy (``privacy=client``, :mod:`fedhpro.privacy`) as steps of the reply chain.

Each reply arrives privatized (the engine ran :func:`~fedhpro.privacy.client.privatize_upload` on the client's
side: its ``weights`` are the clipped update, its counts public constants). The chain a privatized upload goes
through (:func:`private_chain`): the method's declared layout as privatized (exactly its keys and the privacy's,
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

from collections.abc import Mapping
from typing import Any, ClassVar

from fedhpro.engines.chain import Fold, Incoming, ReplyStep, RoundState
from fedhpro.engines.faults import InjectedFaults
from fedhpro.engines.replies import LayoutChecks, Measured, MethodChecks
from fedhpro.privacy.client import (
    HOLDERS_KEY,
    PRIVATIZED_KEY,
    ClientPrivacy,
    PrivateSum,
    private_reply,
    privatized_layout,
    upload_noise_generator,
)


def method_view(reply: Mapping[str, Any]) -> dict[str, Any]:
    """A privatized upload as the method's checks see it: without the privacy's own keys."""
    return {key: value for key, value in reply.items() if key not in (HOLDERS_KEY, PRIVATIZED_KEY)}


class PrivateChecks(ReplyStep):
    """The privacy's own checks of an upload (:meth:`~fedhpro.privacy.client.PrivateSum.problem`)."""

    def __init__(self, total: PrivateSum) -> None:
        self.total = total

    def receive(self, incoming: Incoming, round: RoundState) -> str | None:
        problem = self.total.problem(incoming.reply)
        return None if problem is None else f"invalid privatized update: {problem}"


class PrivateFold(Fold):
    """The accepted uploads' running sum (:class:`~fedhpro.privacy.client.PrivateSum`); at close its release,
    noised centrally from the server's noise stream, as the one reply the method aggregates. Every round is
    released, even one with no upload (noise only)."""

    skips: ClassVar[bool] = False

    def __init__(self, round: RoundState, settings: ClientPrivacy) -> None:
        super().__init__(round)
        protocol = round.protocol
        self.settings = settings
        self.total = PrivateSum(settings, round.global_weights, protocol.server.reply_layout(),
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
            protocol.adapt_clip(release.below_clip)
        return protocol.server.aggregate(round.round, self.replies)


def private_chain(round: RoundState, settings: ClientPrivacy) -> tuple[list[ReplyStep], PrivateFold]:
    """The steps a privatized upload goes through, and the fold that releases the round's private sum."""
    fold = PrivateFold(round, settings)
    layout = privatized_layout(round.protocol.server.reply_layout(),
                               round.num_classes if round.num_classes is not None else 0, settings.adaptive)
    return [LayoutChecks(layout), InjectedFaults(view=method_view, deltas=True), MethodChecks(view=method_view),
            PrivateChecks(fold.total), Measured()], fold


__all__ = ["PrivateChecks", "PrivateFold", "method_view", "private_chain"]
