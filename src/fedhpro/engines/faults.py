"""Injected client faults (``faults.*``, :class:`~fedhpro.engines.fault_options.FaultOptions`), for tests and
robustness studies: the seeded draws of a round (:func:`draw_faults`), what a hostile or corrupted reply is
(:func:`hostile`, :func:`corrupted`), and the step of the reply chain that applies them (:class:`InjectedFaults`).

Every draw comes from ``derive_seed(seed, FAULT, round, client)``: three uniforms per client, in this order,
dropout, corruption, hostility (the third after the first two, so adding hostile faults leaves the dropout and
corruption draws as they were). ``faults.scale`` and ``faults.sign_flip`` make an answering client hostile: it
sends ``w_global + scale_factor * Delta`` (resp. ``w_global - Delta``) for its update
``Delta = w_k - w_global``, and its class tensors times the same factor. One uniform draw decides: below
``scale`` it scales, in ``[scale, scale + sign_flip)`` it flips, so the two never meet.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedhpro.engines.chain import Incoming, Reception, ReplyStep, RoundState, zeros_like_weights
from fedhpro.engines.class_rows import class_tensor_keys, declared_class_keys
from fedhpro.errors import UpdateError
from fedhpro.seeds import derive_seed

#: the fault stream's tag in ``derive_seed(seed, FAULT, round, client)``
FAULT = 5


def hostile_factor(faults: Any, draw: float) -> float | None:
    """The factor a client with uniform ``draw`` multiplies its update by under ``faults``
    (:class:`~fedhpro.engines.fault_options.FaultOptions`); None: it is honest."""
    if draw < faults.scale:
        return float(faults.scale_factor)
    if draw < faults.scale + faults.sign_flip:
        return -1.0
    return None


@dataclass
class FaultDraws:
    """A round's fault draws: the participants that do not answer, and of those that do, whose reply arrives
    corrupted and who is hostile (with the factor)."""

    dropped: list[dict[str, Any]] = field(default_factory=list)
    corrupt: dict[int, bool] = field(default_factory=dict)
    hostile: dict[int, float] = field(default_factory=dict)


def draw_faults(faults: Any, seed: int, round: int, participants: Sequence[int]) -> FaultDraws:
    """The fault draws of ``round`` for ``participants`` (the same on every engine and whatever ran before)."""
    draws = FaultDraws()
    for k in participants:
        rng = np.random.default_rng(derive_seed(seed, FAULT, round, k))
        draw_dropout, draw_corrupt = rng.random(2)
        draw_hostile = float(rng.random())  # after the first two: they stay what they were
        if draw_dropout < faults.dropout:
            draws.dropped.append({"client": k, "reason": "did not answer (faults.dropout)"})
        else:
            draws.corrupt[k] = bool(draw_corrupt < faults.corrupt)
            factor = hostile_factor(faults, draw_hostile)
            if factor is not None:
                draws.hostile[k] = factor
    return draws


def corrupted(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply with every floating-point weight replaced by NaN (``faults.corrupt``: a transmission fault)."""
    weights = {key: torch.full_like(v, float("nan")) if v.is_floating_point() else v
               for key, v in reply.get("weights", {}).items()}
    return {**reply, "weights": weights}


def hostile(reply: dict[str, Any], global_weights: Mapping[str, Tensor], factor: float,
            num_classes: int | None, class_keys: Sequence[str] | None = None) -> dict[str, Any]:
    """The reply a hostile client sends (``faults.scale`` / ``faults.sign_flip``): its update
    ``Delta = w_k - w_global`` times ``factor`` on top of the global weights, i.e.
    ``w_global + factor * Delta`` for every floating-point weight the server broadcast, and its class
    tensors (:func:`~fedhpro.engines.class_rows.class_tensor_keys`) times ``factor``. Finite, so it passes the
    checks a NaN fails."""
    out = dict(reply)
    weights = reply.get("weights")
    if isinstance(weights, Mapping):
        scaled = {}
        for key, value in weights.items():
            base = global_weights.get(key)
            if (isinstance(value, Tensor) and value.is_floating_point() and isinstance(base, Tensor)
                    and base.shape == value.shape):
                base = base.detach().to(device=value.device, dtype=value.dtype)
                scaled[key] = base + factor * (value.detach() - base)
            else:
                scaled[key] = value
        out["weights"] = scaled
    for key in class_tensor_keys(reply, num_classes, class_keys):
        out[key] = reply[key] * factor
    return out


def method_problem(round: RoundState, reply: Any) -> str | None:
    """The method's own checks of ``reply`` (its server's ``validate_reply``) as a dropped reason, or None."""
    try:
        round.protocol.server.validate_reply(reply)
    except UpdateError as error:
        return f"invalid update: {error}"
    return None


def same(reply: Any) -> Any:
    return reply


class InjectedFaults(ReplyStep):
    """The round's drawn faults applied to a reply: a hostile client's update scaled by its factor, a corrupted
    reply's weights made NaN. The client's own reply is checked first (by the method, as ``view`` shows it), so
    that a refusal it earns is its own (INVALID, the client's state rolled back) and one the fault causes is the
    fault's (HOSTILE or CORRUPTED: the client's state stands).

    ``deltas``: the upload's weights are the update itself (a privatized upload), so hostility scales them
    around zero rather than around the global weights."""

    def __init__(self, view: Callable[[Any], Any] = same, deltas: bool = False) -> None:
        self.view = view
        self.deltas = deltas

    def receive(self, incoming: Incoming, round: RoundState) -> str | None:
        factor = round.hostile.get(incoming.client)
        corrupt = round.corrupt[incoming.client]
        if not corrupt and factor is None:
            return None
        problem = method_problem(round, self.view(incoming.reply))  # before it is changed: its faults are its own
        if problem is not None:
            return problem
        if factor is not None:
            weights = incoming.reply.get("weights") or {}
            reference = zeros_like_weights(weights) if self.deltas else round.global_weights
            incoming.reply = hostile(incoming.reply, reference, factor, round.num_classes,
                                     declared_class_keys(round.protocol.server))
            incoming.fault = Reception.HOSTILE
        if corrupt:
            incoming.reply, incoming.fault = corrupted(incoming.reply), Reception.CORRUPTED
        return None


__all__ = ["FAULT", "FaultDraws", "InjectedFaults", "corrupted", "draw_faults", "hostile", "hostile_factor",
           "method_problem"]
