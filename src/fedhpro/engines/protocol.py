"""The round protocol, written once for every engine.

Which clients take part in a round (a seeded draw), which injected faults
they suffer, which replies count (the method's validation), whether the round
counts (``min_clients``), what is measured (bytes and parameters sent, n_k-
weighted training metrics) and how evaluation results pool into per-domain
accuracy and AVG. An engine only moves messages: the in-process simulator
calls the method's ``fit`` directly, the Flower ServerApp sends a message to a
node and hands the reply back here. Both therefore compute the same numbers.

One round, as an engine drives it::

    current = protocol.open(round)          # participants, payload, fault draws
    for k in current.to_ask:                # clients the fault model lets answer
        ... run or ask client k ...
        current.receive(k, reply, metrics, n_k)   # or current.fail(k, reason)
    server_metrics = current.close()        # drops reported, aggregate or skip
    record = current.record(accuracy, seconds, extra)

Every random draw comes from a generator derived from ``(seed, stream, round,
client)`` (:func:`derive_seed`), so the same seed and config give the same
numbers whatever ran before and on whichever engine.

Hostile clients and robust aggregation live here too, so one code path serves
every method on both engines. A hostile client (``faults.scale``,
``faults.sign_flip``) sends a finite but harmful reply: ``receive`` turns the
client's update ``Delta = w_k - w_global`` into ``factor * Delta`` and
multiplies its class tensors by the factor (:func:`hostile`). With a robust
rule (:class:`Aggregation`, ``aggregation=median|trimmed-mean|norm-clip``) the
round keeps the accepted replies whole until ``close``; there
:func:`robust_replies` replaces every reply's weights by the coordinate-wise
median or trimmed mean of all of them (or clips each update's norm), and each
holder's row of every class tensor likewise over the holders of that class,
before the replies go to the method's own ``aggregate``, unchanged. The
method's mean of identical robust values is that value (to float rounding), so
FedAvg, the prototype means, FedGMKD's DAT weighting and FedHPro's class
gradients all aggregate robustly without any method knowing; a server step
that is not a mean (FedTGP's trained prototypes, FedHPro's gradient matching)
gets robust inputs instead of robust outputs.

Client-level differential privacy (``privacy=client``, :mod:`fedhpro.privacy`) lives here too, for the
same reason. The participants are then a Poisson draw (each client with probability ``participation``,
from the SAMPLE stream: the accountant's sampling rate is the real one; with ``privacy.secure_noise``
from the operating system's randomness, since amplification by sampling assumes nobody who sees the model
knows who took part, and ``metrics.jsonl`` then holds only how many did unless
``privacy.publish_participants`` asks for their ids); each reply arrives privatized
(the engine ran :func:`~fedhpro.privacy.client.privatize_upload` on the client's side) and is folded into
a :class:`~fedhpro.privacy.client.PrivateSum` instead of the method's replies; ``close`` releases the
noised sum with public denominators and hands the method ONE reply carrying the privatized values
(:func:`~fedhpro.privacy.client.private_reply`), so every method's mean is the privatized value and
its other server steps get privatized inputs. The clients' training metrics are not collected then
(they are computed from the clients' data), a round is never skipped for too few replies (that count is
not released), and every round's row carries ``privacy: {epsilon, delta}`` from the run's ledger.
"""

from __future__ import annotations

import contextlib
import enum
import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedhpro.aggregation import (
    AGGREGATION_RULES,
    claim_cap,
    clip_factor,
    coordinate_median,
    trimmed_mean,
    update_norm,
)
from fedhpro.errors import FedHProError, UpdateError
from fedhpro.methods.base import ClassRows
from fedhpro.metrics import payload_bytes, payload_parameters
from fedhpro.privacy.accounting import ClientLedger
from fedhpro.privacy.client import (
    HOLDERS_KEY,
    PRIVATIZED_KEY,
    ClientPrivacy,
    PrivateSum,
    client_privacy,
    poisson_participants,
    private_reply,
    privatize_upload,
    upload_noise_generator,
)
from fedhpro.seeds import derive_seed

# stream tags: each kind of randomness gets its own stream
INIT, SAMPLE, TRAIN, SERVER, FAULT = 1, 2, 3, 4, 5
# (6 and 7, the privacy noise's streams, are fedhpro.privacy.client's PRIVACY and CENTRAL_NOISE)


def train_generator(seed: int, round: int, client: int) -> torch.Generator:
    """Client ``client``'s batch-order generator in ``round`` (the same on every engine)."""
    return torch.Generator().manual_seed(derive_seed(seed, TRAIN, round, client))


def client_step(server: Any, client: Any, model: torch.nn.Module, payload: Mapping[str, Any], data: Any,
                state: dict[str, Any], seed: int, round: int, k: int,
                privacy: ClientPrivacy | None, reply_views: bool = False) -> tuple[dict[str, Any], dict[str, float]]:
    """Client ``k``'s step in ``round`` on every engine: the method's ``fit`` (the shared training loop, batches
    in the ``(seed, round, k)`` order of :func:`train_generator`), then, under ``privacy=client``, its upload
    privatized on the client's side (:func:`~fedhpro.privacy.client.privatize_upload`: clipped, and noised
    from the client's own stream under ``privacy.noise=local``). Returns ``(reply, training metrics)``; the
    metrics of a privatized step stay with the client (computed from its data, they would leave unprotected).
    ``reply_views``: the reply's weights are the model's own tensors, not copies (``fit``'s ``reply_views``; only
    for a client whose ``fit`` is the library's own, :func:`~fedhpro.methods.base.lends_weights`), for an engine
    that hands the reply to :meth:`OpenRound.receive` with ``borrowed=True`` before the model changes again."""
    generator = train_generator(seed, round, k)
    if reply_views:
        reply, metrics = client.fit(model, payload, data, state, generator, reply_views=True)
    else:
        reply, metrics = client.fit(model, payload, data, state, generator)
    if privacy is None:
        return reply, metrics
    return privatize_upload(reply, payload.get("weights") or {}, declared_class_keys(server), privacy,
                            upload_noise_generator(privacy, seed, round, k), int(server.num_classes)), {}


@dataclass(frozen=True)
class Faults:
    """Injected client faults, for tests and robustness studies (seeded per round and client).

    ``scale`` and ``sign_flip`` make an answering client hostile: it sends
    ``w_global + scale_factor * Delta`` (resp. ``w_global - Delta``) for its
    update ``Delta = w_k - w_global``, and its class tensors times the same
    factor (:func:`hostile`). One uniform draw decides: below ``scale`` it
    scales, in ``[scale, scale + sign_flip)`` it flips, so the two never meet.
    """

    dropout: float = 0.0  # probability that a sampled client does not answer
    corrupt: float = 0.0  # probability that an answering client sends NaN weights
    scale: float = 0.0  # probability that an answering client sends its update times scale_factor
    scale_factor: float = 100.0
    sign_flip: float = 0.0  # probability that an answering client sends its update negated

    def hostile_factor(self, draw: float) -> float | None:
        """The factor a client with uniform ``draw`` multiplies its update by (None: it is honest)."""
        if draw < self.scale:
            return self.scale_factor
        if draw < self.scale + self.sign_flip:
            return -1.0
        return None




@dataclass(frozen=True)
class Aggregation:
    """How the server combines a round's replies before the method aggregates them (``aggregation.*``).

    ``mean`` (the default) hands the replies to the method as they came, so its
    numbers are those of the method alone. ``median`` and ``trimmed-mean``
    (``trim`` dropped at each end) replace every reply's weights, and each
    holder's class-tensor rows, by the coordinate-wise robust aggregate;
    ``norm-clip`` scales each update ``Delta = w_k - w_global`` down to a norm
    of at most ``max_norm``, or, with ``max_norm = 0``, ``norm_multiple`` times
    the round's median update norm (:func:`robust_replies`).
    """

    rule: str = "mean"
    trim: float = 0.2
    max_norm: float = 0.0
    norm_multiple: float = 1.0
    #: the largest share of a round's total weight one client may hold (:func:`capped_reply`; 1: no cap)
    max_share: float = 0.75
    #: where sizes are claims (:attr:`RoundProtocol.sizes_claimed`), the largest weight one client may hold as a
    #: multiple of the median claim (:func:`~fedhpro.aggregation.claim_cap`; 0: no such bound)
    max_ratio: float = 2.0
    #: the largest L2 norm of one class-tensor row of a reply (:func:`bounded_rows`; 0: no bound)
    max_row_norm: float = 0.0

    def __post_init__(self) -> None:
        if self.rule not in AGGREGATION_RULES:
            raise ValueError(f"aggregation rule must be one of {tuple(AGGREGATION_RULES)}, got {self.rule!r}")
        if not 0.0 < self.max_share <= 1.0:
            raise ValueError(f"aggregation max_share must be in (0, 1], got {self.max_share!r}")
        if not self.max_row_norm >= 0.0:
            raise ValueError(f"aggregation max_row_norm must be >= 0, got {self.max_row_norm!r}")
        if not (self.max_ratio == 0.0 or self.max_ratio >= 1.0):
            raise ValueError(f"aggregation max_ratio must be 0 or >= 1, got {self.max_ratio!r}")

    def cap(self, sizes: Sequence[float], claimed: bool) -> float:
        """The most weight one of the clients of ``sizes`` may hold: the share cap, and where the sizes are
        ``claimed`` (nobody vouches for them) ``max_ratio`` times the median claim too."""
        return claim_cap(sizes, self.max_share, self.max_ratio if claimed else 0.0)

    def bound_text(self, claimed: bool) -> str:
        """The bound in words, for the lines that say a size was capped."""
        share = f"aggregation.max_share={self.max_share:g} of the federation's total"
        if claimed and self.max_ratio > 0:
            return f"{share} or aggregation.max_ratio={self.max_ratio:g} x the median client's size"
        return share

    @property
    def robust(self) -> bool:
        """Whether the replies are changed before the method aggregates them (any rule but ``mean``)."""
        return bool(AGGREGATION_RULES[self.rule])

    @property
    def needs_each_reply(self) -> str:
        """What the rule needs of each client's own update ("" for ``mean``): what a server that sees only
        the replies' noised or masked sum (``privacy=client``, SecAgg+) cannot give it."""
        return AGGREGATION_RULES[self.rule]


@dataclass
class RoundRecord:
    """Everything measured in one round (one line of ``metrics.jsonl``)."""

    round: int
    #: who took part, in client order; None where the row must not say (privacy=client without
    #: privacy.publish_participants: the row then holds ``num_participants``)
    participants: list[int] | None
    train: dict[str, float]
    server: dict[str, float]
    accuracy: dict[str, float] | None
    bytes_up: int
    bytes_down: int
    seconds: dict[str, float]
    dropped: list[dict[str, Any]] = field(default_factory=list)
    skipped: bool = False
    #: further deterministic measurements (parameters sent, per-client accuracy and fairness,
    #: FLOPs, prototype distances), written as top-level keys of the ``metrics.jsonl`` row
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The deterministic part (same seed, same numbers): a line of ``metrics.jsonl``."""
        out: dict[str, Any] = {"round": self.round}
        if self.participants is not None:
            out["participants"] = self.participants
        out.update({"train": self.train, "server": self.server, "bytes_up": self.bytes_up,
                    "bytes_down": self.bytes_down})
        out.update(self.extra)
        if self.dropped:
            out["dropped"] = self.dropped
        if self.skipped:
            out["skipped"] = True
        if self.accuracy is not None:
            out["accuracy"] = self.accuracy
        return out


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


def round_half_up(value: float) -> int:
    return int(np.floor(value + 0.5))


def corrupted(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply with every floating-point weight replaced by NaN (``faults.corrupt``: a transmission fault)."""
    weights = {key: torch.full_like(v, float("nan")) if v.is_floating_point() else v
               for key, v in reply.get("weights", {}).items()}
    return {**reply, "weights": weights}


def class_tensor_keys(reply: Mapping[str, Any], num_classes: int | None,
                      declared: Sequence[str] | None = None) -> list[str]:
    """The reply's class tensors: floating-point tensors whose rows are per class (prototypes, class
    gradients, soft predictions). ``declared``: the keys the method's reply layout declares per class
    (:func:`declared_class_keys`), the engines' source; without it (a direct call on bare replies) the
    floating-point tensors other than the weights whose first dimension is ``num_classes`` (none when
    ``num_classes`` is unknown)."""
    if declared is not None:
        return [key for key in declared if isinstance(reply.get(key), Tensor) and reply[key].is_floating_point()
                and reply[key].dim() >= 1]
    if num_classes is None:
        return []
    return [key for key, value in reply.items()
            if key != "weights" and isinstance(value, Tensor) and value.is_floating_point() and value.dim() >= 1
            and value.shape[0] == num_classes]


def declared_class_keys(server: Any) -> list[str]:
    """The per-class keys of ``server.reply_layout()`` (:class:`~fedhpro.methods.base.ClassRows` entries,
    floating point: the integer class counts are never scaled or averaged), in the layout's order; none
    for a server without a layout."""
    layout = getattr(server, "reply_layout", None)
    if layout is None:
        return []
    return [key for key, entry in layout().items() if isinstance(entry, ClassRows) and entry.dtype.is_floating_point]


def hostile(reply: dict[str, Any], global_weights: Mapping[str, Tensor], factor: float,
            num_classes: int | None, class_keys: Sequence[str] | None = None) -> dict[str, Any]:
    """The reply a hostile client sends (``faults.scale`` / ``faults.sign_flip``): its update
    ``Delta = w_k - w_global`` times ``factor`` on top of the global weights, i.e.
    ``w_global + factor * Delta`` for every floating-point weight the server broadcast, and its class
    tensors (:func:`class_tensor_keys`) times ``factor``. Finite, so it passes the checks a NaN fails."""
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


def examples_problem(reply: Any, client: int, num_samples: int) -> str | None:
    """Why the reply's ``num_examples`` cannot be client ``client``'s (it holds ``num_samples`` training
    samples), or None when it is a whole number in ``[1, num_samples]``. A client's FedAvg weight is
    what it says it trained on, so an unbounded count would let one reply outweigh all others."""
    if not isinstance(reply, Mapping):
        return None  # the method's checks name what the reply is
    count = reply.get("num_examples")
    holds = f"client {client} holds {num_samples} training samples"
    if isinstance(count, bool) or not isinstance(count, (int, float, np.integer, np.floating)):
        return f"num_examples={count!r} is not a number; {holds}"
    if not math.isfinite(count) or count != math.floor(count):
        return f"num_examples={count!r} is not a whole number; {holds}"
    if count < 1:
        return f"num_examples={count!r} is below 1; {holds}"
    if count > num_samples:
        return f"num_examples={count!r} but {holds}"
    return None


def bounded_rows(reply: dict[str, Any], class_keys: Sequence[str], max_norm: float) -> tuple[dict[str, Any], int]:
    """``(reply, rows scaled)``: every row of the reply's class tensors ``class_keys`` (one a class, any shape
    after the first dimension) longer than ``max_norm`` in L2 norm scaled down to it (``aggregation.max_row_norm``;
    a row of norm ``n`` times ``max_norm / n``), so that no client can drag a class's mean further than a row
    of that norm could. A new dict, the reply's tensors not changed; the reply itself when no row is longer."""
    out, scaled = reply, 0
    for key in class_keys:
        rows = reply.get(key)
        if not isinstance(rows, Tensor) or rows.dim() == 0 or not rows.is_floating_point():
            continue
        norms = rows.detach().double().reshape(rows.shape[0], -1).norm(dim=1)
        longer = norms > max_norm
        if bool(longer.any()):
            factor = torch.where(longer, max_norm / norms.clamp(min=1e-300), torch.ones_like(norms))
            shape = (rows.shape[0],) + (1,) * (rows.dim() - 1)
            out = {**out, key: (rows.detach().double() * factor.reshape(shape)).to(rows.dtype)}
            scaled += int(longer.sum())
    return out, scaled


def capped_reply(reply: dict[str, Any], weight: int) -> dict[str, Any]:
    """The reply with its aggregation weight lowered to ``weight`` (:func:`~fedhpro.aggregation.share_cap`):
    ``num_examples = weight`` and its ``class_counts`` (the weights of its class statistics) scaled by the
    same factor, rounded down but kept at least 1 for a class it holds (which classes it holds is not
    changed). A new dict; the tensors of the reply are not changed."""
    out = dict(reply)
    factor = weight / float(reply["num_examples"])
    out["num_examples"] = int(weight)
    counts = reply.get("class_counts")
    if isinstance(counts, Tensor) and counts.numel():
        held = counts > 0
        scaled = torch.floor(counts.detach().to(torch.float64) * factor)
        scaled = torch.where(held, scaled.clamp(min=1.0), torch.zeros_like(scaled))
        out["class_counts"] = scaled.to(counts.dtype)
    return out


def counts_problem(reply: Any, num_classes: int | None) -> str | None:
    """Why the reply's ``class_counts`` cannot be what its client holds, or None when they are ``C`` (the
    method's number of classes, when known) whole numbers >= 0 summing to its ``num_examples`` (checked
    first by :func:`examples_problem`), or the reply has none. Methods weight a client's class statistics
    (prototypes, class gradients, soft predictions) by these counts, so unbounded counts would let one
    reply outweigh all others, as an unbounded ``num_examples`` would in FedAvg."""
    if not isinstance(reply, Mapping) or "class_counts" not in reply:
        return None
    counts, total = reply["class_counts"], reply.get("num_examples")
    if isinstance(total, bool) or not isinstance(total, (int, float, np.integer, np.floating)):
        return f"num_examples={total!r} is not a number"  # examples_problem says more
    if not isinstance(counts, Tensor):
        return f"class_counts is a {type(counts).__name__}, not a tensor of counts"
    if counts.dim() != 1 or (num_classes is not None and counts.shape[0] != num_classes):
        return f"class_counts has shape {tuple(counts.shape)}, not ({num_classes if num_classes is not None else 'C'},)"
    if counts.dtype == torch.bool or counts.is_complex():
        return f"class_counts is {counts.dtype}, not whole numbers"
    values = counts.detach().cpu()
    if values.is_floating_point():
        if not bool(torch.isfinite(values).all()) or not bool((values == values.floor()).all()):
            return "class_counts holds values that are not whole numbers (NaN, Inf or fractions)"
    if bool((values < 0).any()):
        return f"class_counts holds a negative count ({values.min().item():g})"
    if values.numel() and float(values.max()) > float(total):  # each count <= num_examples: the sum cannot overflow
        return f"class_counts holds a count of {values.max().item():g} but num_examples={total}"
    held = int(values.to(torch.float64).sum().item()) if values.is_floating_point() else int(values.sum().item())
    if held != int(total):
        return f"class_counts sum to {held} but num_examples={total}"
    return None


def _median_value(values: Sequence[float]) -> float:
    """The median of a few numbers (mean of the two middle ones for an even count), as
    :func:`~fedhpro.aggregation.coordinate_median` takes it."""
    return float(coordinate_median([torch.tensor(float(v), dtype=torch.float64) for v in values]))


def _holders(replies: Sequence[Mapping[str, Any]], num_classes: int) -> Tensor:
    """``K x C`` bool: which classes each reply holds (``class_counts > 0``; every class without counts)."""
    rows = []
    for reply in replies:
        counts = reply.get("class_counts")
        if isinstance(counts, Tensor) and tuple(counts.shape) == (num_classes,):
            rows.append(counts.detach().cpu() > 0)
        else:
            rows.append(torch.ones(num_classes, dtype=torch.bool))
    return torch.stack(rows)


def _robust_weights(replies: list[dict[str, Any]], global_weights: Mapping[str, Tensor],
                    rule: Aggregation) -> dict[str, float]:
    """The weights part of :func:`robust_replies` (in place on the replies' dicts); its metrics."""
    first = replies[0].get("weights")
    if not isinstance(first, Mapping) or not first:
        return {}
    if rule.rule in ("median", "trimmed-mean"):
        combined = {}
        for key, value in first.items():
            if value.is_floating_point():
                tensors = [reply["weights"][key] for reply in replies]
                combined[key] = (coordinate_median(tensors) if rule.rule == "median"
                                 else trimmed_mean(tensors, rule.trim))
        for reply in replies:
            reply["weights"] = {key: combined.get(key, value) for key, value in reply["weights"].items()}
        return {}
    norms = [update_norm(reply["weights"], global_weights) for reply in replies]
    limit = rule.max_norm if rule.max_norm > 0 else rule.norm_multiple * _median_value(norms)
    clipped = 0
    for reply, norm in zip(replies, norms):
        factor = clip_factor(norm, limit)
        if factor < 1.0:
            clipped += 1
            weights = {}
            for key, value in reply["weights"].items():
                if value.is_floating_point():
                    base = global_weights[key].detach().to(device=value.device, dtype=value.dtype)
                    weights[key] = base + factor * (value.detach() - base)
                else:
                    weights[key] = value
            reply["weights"] = weights
    return {"robust_clipped": float(clipped), "robust_clip_norm": float(limit)}


def _robust_rows(rows: Tensor, rule: Aggregation) -> tuple[Tensor, int]:
    """One class's rows over its holders (``H x ...``) made robust: ``(new rows, how many were clipped)``."""
    if rule.rule == "median":
        return coordinate_median(list(rows)).expand_as(rows), 0
    if rule.rule == "trimmed-mean":
        return trimmed_mean(list(rows), rule.trim).expand_as(rows), 0
    centre = coordinate_median(list(rows))
    offsets = rows - centre
    distances = [float(d) for d in offsets.reshape(rows.shape[0], -1).double().norm(dim=1)]
    limit = rule.norm_multiple * _median_value(distances)
    factors = [clip_factor(d, limit) for d in distances]
    scale = torch.tensor(factors, dtype=rows.dtype, device=rows.device).reshape(-1, *([1] * (rows.dim() - 1)))
    return centre + scale * offsets, sum(f < 1.0 for f in factors)


def robust_replies(replies: Sequence[dict[str, Any]], global_weights: Mapping[str, Tensor], rule: Aggregation,
                   num_classes: int | None, class_keys: Sequence[str] | None = None
                   ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """A round's validated replies made robust by ``rule`` (new dicts; the inputs are not changed), and
    what was done (``robust_*`` server metrics).

    Weights: ``median`` / ``trimmed-mean`` give every reply the coordinate-wise aggregate of all
    replies' floating-point weights (integer counters stay each reply's own); ``norm-clip`` scales each
    update ``w_k - w_global`` to at most ``max_norm`` (or ``norm_multiple`` x the median update norm
    when ``max_norm`` is 0), ``robust_clipped`` counting the clipped replies.

    Class tensors (:func:`class_tensor_keys`), per class over the replies that hold it
    (``class_counts > 0``; every class for a reply without counts): the holders' rows become their
    coordinate-wise median or trimmed mean, or, with ``norm-clip``, each holder's row is pulled towards
    the holders' coordinate-wise median to a distance of at most ``norm_multiple`` x the median
    distance (``robust_rows_clipped``). Rows of classes a reply does not hold are left as they are.

    The method then aggregates these replies with its own rule: a mean of equal values is that value,
    so the method's aggregate is the robust one.
    """
    out = [dict(reply) for reply in replies]
    metrics = {"robust_updates": float(len(out))}
    if not out:
        return out, metrics
    metrics.update(_robust_weights(out, global_weights, rule))
    keys = [key for key in class_tensor_keys(out[0], num_classes, class_keys)
            if all(isinstance(r.get(key), Tensor) and r[key].shape == out[0][key].shape for r in out)]
    if keys:
        classes = num_classes if num_classes is not None else out[0][keys[0]].shape[0]
        holders = _holders(out, classes)
        clipped = 0
        for key in keys:
            stacked = torch.stack([reply[key].detach() for reply in out])
            robust = stacked.clone()
            for c in range(classes):
                held = holders[:, c].to(stacked.device)
                if bool(held.any()):
                    robust[held, c], count = _robust_rows(stacked[held, c], rule)
                    clipped += count
            for index, reply in enumerate(out):
                reply[key] = robust[index]
        if rule.rule == "norm-clip":
            metrics["robust_rows_clipped"] = float(clipped)
    return out, metrics


def _method_view(reply: Mapping[str, Any]) -> dict[str, Any]:
    """A privatized upload as the method's checks see it: without the privacy's own keys."""
    return {key: value for key, value in reply.items() if key not in (HOLDERS_KEY, PRIVATIZED_KEY)}


def weighted_mean(metrics: Sequence[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Mean of each client metric, weighted by the clients' sample counts."""
    total = sum(n for n, _ in metrics) or 1
    names = sorted({name for _, m in metrics for name in m})
    return {name: sum(n * m.get(name, 0.0) for n, m in metrics) / total for name in names}


@dataclass(frozen=True)
class TestCount:
    """One evaluation: ``correct`` of ``total`` test samples of test set ``name`` (a domain, or ``"all"``)."""

    name: str
    correct: int
    total: int

    @property
    def accuracy(self) -> float:
        return 100.0 * self.correct / max(self.total, 1)


def pool_accuracy(counts: Sequence[TestCount], order: Sequence[str] | None = None,
                  max_share: float = 1.0, max_ratio: float = 0.0) -> dict[str, float]:
    """Accuracy in percent per test set, pooling the counts of every client tested on it
    (``100 * sum correct / sum total``, i.e. weighted by test samples), plus ``AVG``: the
    unweighted mean over test sets (the paper's AVG over domains).

    ``order``: the test sets' order in the result (default: first appearance);
    test sets without any counted sample are left out. ``max_share`` (``aggregation.max_share``): a
    client's test count is a claim too, so within a test set no client weighs more than this share of
    the pooled count (:func:`~fedhpro.aggregation.share_cap` over the test set's counts, one a client): a
    client above the cap counts with its own accuracy at the cap's weight. ``max_ratio`` (where test sizes
    are claims: ``aggregation.max_ratio``): nor more than that many times the median count of the test set's
    clients (:func:`~fedhpro.aggregation.claim_cap`). Where no cap binds the result is the plain pooled
    ratio, to the bit.
    """
    correct: dict[str, float] = {}
    total: dict[str, float] = {}
    caps = {name: claim_cap([c.total for c in counts if c.name == name], max_share, max_ratio)
            for name in {c.name for c in counts}} if max_share < 1.0 or max_ratio > 0 else {}
    for count in counts:
        cap = caps.get(count.name, math.inf)
        if count.total > cap:  # the client's own accuracy, at the capped weight
            weight = float(math.floor(cap)) or 1.0
            hits, size = count.correct * weight / count.total, weight
        else:
            hits, size = int(count.correct), int(count.total)
        correct[count.name] = correct.get(count.name, 0) + hits
        total[count.name] = total.get(count.name, 0) + size
    names = [name for name in (order if order is not None else correct) if total.get(name, 0) > 0]
    accuracy = {name: 100.0 * correct[name] / total[name] for name in names}
    accuracy["AVG"] = float(np.mean([accuracy[name] for name in names])) if names else float("nan")
    return accuracy


class RoundProtocol:
    """Sampling, fault draws, reply validation, drops, skipped rounds and metrics of every round.

    ``server`` is the method's server part; the protocol calls its
    ``broadcast``, ``new_replies``, ``validate_reply`` and ``aggregate``.
    ``on_drop`` receives one line per dropped client or skipped round.
    ``aggregation`` (default: the method's own mean) makes the replies robust
    before the method aggregates them (:func:`robust_replies`).
    ``privacy``: the run's ``privacy.*`` options (:class:`~fedhpro.config.PrivacyOptions`; None or
    ``mode=none``: off); ``ledger``: its privacy ledger (:func:`fedhpro.privacy.ledger_for`; built here for
    ``privacy=client`` when not given, needed for ``privacy=sample``).
    """

    def __init__(self, server: Any, num_clients: int, *, rounds: int, participation: float = 1.0, seed: int = 0,
                 eval_every: int = 1, faults: Faults | None = None, min_clients: int = 1,
                 on_drop: Callable[[str], None] | None = None, aggregation: Aggregation | None = None,
                 privacy: Any = None, ledger: Any = None, client_sizes: Sequence[int] | None = None,
                 sizes_claimed: bool = False):
        self.server = server
        self.num_clients = num_clients
        #: each client's training-set size as the engine knows it (in own-data Flower: what its node
        #: declared), from which a round's weight cap is drawn (:meth:`weight_cap`); None: no cap
        self.client_sizes = list(client_sizes) if client_sizes is not None else None
        #: whether the clients' sizes (training and test) are claims nobody vouches for (a Flower deployment of
        #: nodes holding their own data, without a roster): they are then bounded by the median claim too
        #: (``aggregation.max_ratio``); the simulator and partition mode know every size
        self.sizes_claimed = sizes_claimed
        self.warned_caps: set[int] = set()  # clients whose capped weight was reported (once each)
        self.rounds = rounds
        self.participation = participation
        self.seed = seed
        self.eval_every = eval_every
        self.faults = faults or Faults()
        self.aggregation = aggregation or Aggregation()
        self.min_clients = min_clients
        self.on_drop = on_drop
        mode = getattr(privacy, "mode", "none") if privacy is not None else "none"
        #: the privacy.* options when privacy is on (None: off, every number as without privacy)
        self.privacy = privacy if mode != "none" else None
        #: the rounds' participants drawn from the operating system (privacy=client with privacy.secure_noise):
        #: kept in memory only, so that a round's draw is asked for more than once gives one answer
        self._secret_draws: dict[int, list[int]] = {}
        #: client-level DP's settings (privacy=client), else None
        self.client_privacy: ClientPrivacy | None = None
        #: the run's privacy ledger (None: privacy off)
        self.ledger = ledger
        if mode == "client":
            if self.aggregation.robust:
                raise FedHProError(f"privacy=client cannot go with aggregation={self.aggregation.rule}: it needs "
                                   "each client's own update; use aggregation=mean")
            if ledger is None:
                self.ledger = ClientLedger(privacy, num_clients, rounds, participation,
                                           bool(declared_class_keys(server)))
            self.client_privacy = client_privacy(privacy, self.ledger.noise_multiplier)
        elif mode != "none" and ledger is None:
            raise FedHProError(f"privacy={mode} needs the run's privacy ledger (fedhpro.privacy.ledger_for) given to "
                               "the round protocol as ledger=")

    @property
    def secret_sampling(self) -> bool:
        """Whether the participants are drawn from the operating system's randomness (``privacy=client`` with
        ``privacy.secure_noise``): the accountant's amplification by sampling assumes that nobody who sees
        the released model knows who took part, which a draw from the config's seed would not keep."""
        return self.client_privacy is not None and self.client_privacy.secure_noise

    @property
    def publishes_participants(self) -> bool:
        """Whether a round's row names its participants (and dropped clients): always, except under
        ``privacy=client`` unless ``privacy.publish_participants``."""
        return self.client_privacy is None or bool(getattr(self.privacy, "publish_participants", False))

    def sample_clients(self, round: int) -> list[int]:
        """The participants of ``round``: a seeded draw without replacement, sorted; under ``privacy=client`` a
        Poisson draw (each client with probability ``participation``: the accountant's sampling rate), from
        the operating system's randomness with ``privacy.secure_noise`` (:attr:`secret_sampling`)."""
        total = self.num_clients
        if self.secret_sampling:
            if round not in self._secret_draws:
                self._secret_draws[round] = poisson_participants(secrets.randbits(63), total, self.participation)
            return list(self._secret_draws[round])
        if self.client_privacy is not None:
            return poisson_participants(derive_seed(self.seed, SAMPLE, round), total, self.participation)
        count = max(1, int(round_half_up(self.participation * total)))
        if count >= total:
            return list(range(total))
        rng = np.random.default_rng(derive_seed(self.seed, SAMPLE, round))
        return sorted(int(k) for k in rng.choice(total, size=count, replace=False))

    def weight_cap(self) -> float:
        """The most aggregation weight one client may hold: the water-filling cap
        (:func:`~fedhpro.aggregation.share_cap`) of every client's declared size at
        ``aggregation.max_share``, so that no client stands for more than that share of the federation's
        total weight (of the federation's, not of a round's: a round of few participants would cap honest
        clients) and, where sizes are claims (:attr:`sizes_claimed`), at most ``aggregation.max_ratio``
        times the median claim. inf when nothing binds, the sizes are unknown, or under ``privacy=client``
        (its denominators are public constants, not the clients' counts)."""
        if self.client_sizes is None or self.client_privacy is not None:
            return math.inf
        return self.aggregation.cap(self.client_sizes, self.sizes_claimed)

    def pooled_accuracy(self, counts: Sequence[TestCount], order: Sequence[str] | None = None) -> dict[str, float]:
        """:func:`pool_accuracy` of ``counts`` under this run's bounds on test counts: ``aggregation.max_share``
        and, where sizes are claims, ``aggregation.max_ratio``."""
        return pool_accuracy(counts, order, self.aggregation.max_share,
                             self.aggregation.max_ratio if self.sizes_claimed else 0.0)

    def capped_sizes(self, sizes: Sequence[int]) -> list[int]:
        """``sizes`` (clients' training-set sizes) as the weights they can buy: each at most the
        :meth:`weight_cap` (what a client's update is weighted by when only a sum is seen, as in SecAgg+)."""
        cap = self.weight_cap()
        return [int(n) if n <= cap else max(1, math.floor(cap)) for n in sizes]

    def evaluates(self, round: int) -> bool:
        """Whether ``round`` ends with an evaluation (every ``eval_every`` rounds and the last, and the last
        one ``privacy.max_epsilon`` lets run)."""
        return ((round + 1) % self.eval_every == 0 or round + 1 == self.rounds
                or (round + 1 < self.rounds and self.budget_stop(round + 1) is not None))

    def participations(self, rounds_done: int) -> dict[int, int]:
        """How many of the first ``rounds_done`` rounds each client was sampled in (the seeded draws, so a
        resumed run counts the same). With :attr:`secret_sampling` a round not drawn in this process (one
        still to come, or one before a resume) counts as taken part in by every client: the draws are kept
        nowhere, and the worst case bounds them."""
        counts: dict[int, int] = {}
        for round in range(rounds_done):
            drawn = self._secret_draws.get(round) if self.secret_sampling else None
            if drawn is None and self.secret_sampling:
                drawn = list(range(self.num_clients))
            for k in drawn if drawn is not None else self.sample_clients(round):
                counts[k] = counts.get(k, 0) + 1
        return counts

    def epsilon_after(self, round: int) -> float | None:
        """The privacy ledger's epsilon once ``round`` (from 0) is complete; None without privacy."""
        if self.ledger is None:
            return None
        return float(self.ledger.epsilon(self.participations(round + 1), round + 1))

    def budget_stop(self, round: int) -> str | None:
        """The line that stops the run before ``round`` when completing it would take epsilon above
        ``privacy.max_epsilon``; None when it may run (or there is no limit)."""
        limit = float(getattr(self.privacy, "max_epsilon", 0.0) or 0.0) if self.privacy is not None else 0.0
        if limit <= 0:
            return None
        epsilon = self.epsilon_after(round)
        if epsilon is None or epsilon <= limit:
            return None
        spent = self.epsilon_after(round - 1) if round > 0 else 0.0
        return (f"privacy budget: stopped before round {round} of {self.rounds}: it would take epsilon to "
                f"{epsilon:.4g} > privacy.max_epsilon={limit:g} (delta={self.ledger.delta:.3g}); the {round} "
                f"rounds run (epsilon {spent:.4g}) are kept")

    def privacy_summary(self) -> dict[str, Any] | None:
        """The privacy ledger's settings for ``summary.json`` (None without privacy)."""
        return None if self.ledger is None else dict(self.ledger.describe())

    def open(self, round: int) -> OpenRound:
        return OpenRound(self, round)


class OpenRound:
    """One round in progress: what to send to whom, and the replies gathered so far."""

    def __init__(self, protocol: RoundProtocol, round: int):
        self.protocol = protocol
        self.round = round
        self.started = time.perf_counter()
        self.participants = protocol.sample_clients(round)
        self.payload = protocol.server.broadcast(round)
        value = getattr(protocol.server, "num_classes", None)
        self._num_classes = value if isinstance(value, int) else None  # read by every reply: once a round
        self.bytes_down = payload_bytes(self.payload) * len(self.participants)
        self.params_down = payload_parameters(self.payload) * len(self.participants)
        self.dropped: list[dict[str, Any]] = []
        self._corrupt: dict[int, bool] = {}
        #: the factor each hostile answering client multiplies its update by (faults.scale / sign_flip)
        self.hostile: dict[int, float] = {}
        for k in self.participants:
            rng = np.random.default_rng(derive_seed(protocol.seed, FAULT, round, k))
            draw_dropout, draw_corrupt = rng.random(2)
            draw_hostile = float(rng.random())  # after the first two: they stay what they were
            if draw_dropout < protocol.faults.dropout:
                self.dropped.append({"client": k, "reason": "did not answer (faults.dropout)"})
            else:
                self._corrupt[k] = bool(draw_corrupt < protocol.faults.corrupt)
                factor = protocol.faults.hostile_factor(draw_hostile)
                if factor is not None:
                    self.hostile[k] = factor
        #: the clients to run or ask, in client order
        self.to_ask = list(self._corrupt)
        #: the most weight one reply may carry this round (aggregation.max_share), and the replies it capped
        self.cap = protocol.weight_cap()
        self.capped: list[dict[str, Any]] = []
        #: aggregation.max_row_norm: the class tensors it bounds, and the rows it scaled down (client, count)
        self._row_keys = declared_class_keys(protocol.server) if protocol.aggregation.max_row_norm > 0 else []
        self.rows_bounded: list[dict[str, int]] = []
        # the server's container folds each reply's weights into a running sum as it arrives (one model's
        # memory, not one per client), so uploads are measured as replies arrive
        self.replies = protocol.server.new_replies()
        #: with a robust rule the accepted replies are kept whole here until close() (they need each other)
        self._held: list[dict[str, Any]] = []
        self.train_metrics: list[tuple[int, dict[str, float]]] = []
        self.failures: list[Exception | str] = []
        self.bytes_up = 0
        self.params_up = 0
        self.skipped = False
        #: privacy=client: the privatized uploads' running sum (what the server releases at close)
        self.private: PrivateSum | None = None
        if protocol.client_privacy is not None:
            num_classes = self.num_classes
            self.private = PrivateSum(protocol.client_privacy, self.payload.get("weights") or {},
                                      protocol.server.reply_layout(), num_classes if num_classes is not None else 0,
                                      protocol.participation * protocol.num_clients)

    def fail(self, client: int, reason: str, error: Exception | None = None) -> None:
        """Client ``client`` gave no usable reply (it raised, or none came in time): it is dropped."""
        self.dropped.append({"client": client, "reason": reason})
        self.failures.append(error if error is not None else f"client {client}: {reason}")

    def receive(self, client: int, reply: dict[str, Any], metrics: dict[str, float], num_samples: int,
                borrowed: bool = False) -> Reception:
        """Hand in client ``client``'s reply (it holds ``num_samples`` training samples): the bounds on its
        ``num_examples`` and ``class_counts`` (:func:`counts_problem`), injected hostility and corruption,
        the method's validation, then the fold into the round's replies (kept whole until :meth:`close`
        with a robust rule). Returns whether it counts (a :class:`Reception`, true only when accepted) and,
        when not, whose fault it was: the client's own update (``INVALID``: an engine rolls the client's
        state back), a transmission fault (``CORRUPTED``) or the injected hostility (``HOSTILE``): the
        client computed a good update, so its state stands. Under ``privacy=client`` the reply is the
        client's privatized upload (:meth:`receive_private`).

        ``borrowed``: the reply's weights are the client's working model's own tensors (the simulator's
        ``client_step(reply_views=True)``), valid only until this call returns: a folded reply is summed
        straight from them, a reply the round keeps whole (a robust rule, a method that does not fold) is
        kept as a copy."""
        if self.private is not None:
            return self.receive_private(client, reply)
        lent = reply.get("weights") if borrowed and isinstance(reply, Mapping) else None
        views: Mapping[str, Tensor] | None = lent if isinstance(lent, Mapping) else None
        problem = examples_problem(reply, client, num_samples)
        if problem is None:
            problem = counts_problem(reply, self.num_classes)
        if problem is not None:
            self.dropped.append({"client": client, "reason": f"invalid update: {problem}"})
            return Reception.INVALID
        reception = Reception.ACCEPTED
        factor = self.hostile.get(client)
        if self._corrupt[client] or factor is not None:
            try:  # the client's own update, before it is changed: its faults are the client's
                self.protocol.server.validate_reply(reply)
            except UpdateError as error:
                self.dropped.append({"client": client, "reason": f"invalid update: {error}"})
                return Reception.INVALID
            if factor is not None:
                reply = hostile(reply, self.payload.get("weights") or {}, factor, self.num_classes,
                                declared_class_keys(self.protocol.server))
                reception = Reception.HOSTILE
            if self._corrupt[client]:
                reply, reception = corrupted(reply), Reception.CORRUPTED
        try:
            self.protocol.server.validate_reply(reply)
        except UpdateError as error:
            self.dropped.append({"client": client, "reason": f"invalid update: {error}"})
            return Reception.INVALID if reception is Reception.ACCEPTED else reception
        self.bytes_up += payload_bytes(reply)
        self.params_up += payload_parameters(reply)
        if self._row_keys:  # a class row is a claim about a class: bounded like a size
            reply, scaled = bounded_rows(reply, self._row_keys, self.protocol.aggregation.max_row_norm)
            if scaled:
                self.rows_bounded.append({"client": client, "rows": scaled})
        weight = int(num_samples)
        if int(reply["num_examples"]) > self.cap:  # a size is a claim: it buys at most the round's cap
            weight = max(1, math.floor(self.cap))
            self.capped.append({"client": client, "claimed": int(reply["num_examples"]), "weight": weight})
            if client not in self.protocol.warned_caps and self.protocol.on_drop is not None:
                self.protocol.warned_caps.add(client)
                claimed = self.protocol.sizes_claimed
                self.protocol.on_drop(
                    f"round {self.round}: client {client}'s weight is capped at {weight} (it reports "
                    f"{int(reply['num_examples'])} training samples, more than "
                    f"{self.protocol.aggregation.bound_text(claimed)} of {sum(self.protocol.client_sizes or [])}); "
                    + ("if that size is right, vouch for it in flower.roster (or raise aggregation.max_ratio, 0: no "
                       "such bound)" if claimed and self.protocol.aggregation.max_ratio > 0 else
                       "if that size is right, raise aggregation.max_share (1: no cap)"))
            reply = capped_reply(reply, weight)
        keeps_weights = self.protocol.aggregation.robust or not getattr(self.replies, "folds_weights", False)
        if keeps_weights and reply.get("weights") is views and views is not None:  # still the model's tensors
            reply = {**reply, "weights": {key: value.clone() for key, value in views.items()}}
        if self.protocol.aggregation.robust:
            self._held.append(reply)
        else:
            self.replies.append(reply)
        self.train_metrics.append((min(int(num_samples), weight), metrics))
        return Reception.ACCEPTED

    def receive_private(self, client: int, reply: dict[str, Any]) -> Reception:
        """``privacy=client``: hand in client ``client``'s privatized upload
        (:func:`~fedhpro.privacy.client.privatize_upload`: its ``weights`` are the clipped update, its counts
        public constants). Injected hostility multiplies the update and the per-class rows by its factor,
        corruption makes the update NaN; the method's checks and the privacy checks (finite, the right
        shapes, the holder vector) decide; an accepted upload goes into the round's private sum. The
        clients' training metrics are not kept (computed from their data, they would leave unprotected)."""
        assert self.private is not None
        reception = Reception.ACCEPTED
        factor = self.hostile.get(client)
        if self._corrupt[client] or factor is not None:
            try:  # the client's own upload, before it is changed: its faults are the client's
                self.protocol.server.validate_reply(_method_view(reply))
            except UpdateError as error:
                self.dropped.append({"client": client, "reason": f"invalid update: {error}"})
                return Reception.INVALID
            if factor is not None:
                zero = {key: torch.zeros_like(value) for key, value in (reply.get("weights") or {}).items()
                        if isinstance(value, Tensor)}
                reply = hostile(reply, zero, factor, self.num_classes, declared_class_keys(self.protocol.server))
                reception = Reception.HOSTILE
            if self._corrupt[client]:
                reply, reception = corrupted(reply), Reception.CORRUPTED
        try:
            self.protocol.server.validate_reply(_method_view(reply))
        except UpdateError as error:
            self.dropped.append({"client": client, "reason": f"invalid update: {error}"})
            return Reception.INVALID if reception is Reception.ACCEPTED else reception
        problem = self.private.problem(reply)
        if problem is not None:
            self.dropped.append({"client": client, "reason": f"invalid privatized update: {problem}"})
            return Reception.INVALID if reception is Reception.ACCEPTED else reception
        self.bytes_up += payload_bytes(reply)
        self.params_up += payload_parameters(reply)
        self.private.add(reply)
        return Reception.ACCEPTED

    @property
    def num_classes(self) -> int | None:
        """The method's number of classes (the length of class_counts), None if its server does not say."""
        return self._num_classes

    @property
    def accepted(self) -> int:
        """How many replies count so far."""
        return len(self.replies) + len(self._held) + (self.private.count if self.private is not None else 0)

    def close(self, observe: contextlib.AbstractContextManager | None = None) -> dict[str, float]:
        """After the last reply: report the drops, then aggregate, or skip a round with fewer than
        ``min_clients`` valid replies (the global model is kept). ``observe`` wraps the server step
        (a FLOP counter). Raises when every participant failed: that is a bug or a setting, not a fault."""
        protocol = self.protocol
        position = {k: i for i, k in enumerate(self.participants)}
        self.dropped.sort(key=lambda item: position[item["client"]])
        if self.failures and len(self.failures) == len(self.participants):
            first = self.failures[0]
            if isinstance(first, Exception):
                raise first
            raise FedHProError(f"round {self.round}: every client failed; {first}")
        if protocol.on_drop is not None:
            for item in self.dropped:
                protocol.on_drop(f"round {self.round}: client {item['client']} dropped: {item['reason']}")
        if self.private is not None:
            return self._close_private(observe)
        self.skipped = self.accepted < protocol.min_clients
        if self.skipped:
            if protocol.on_drop is not None:
                protocol.on_drop(f"round {self.round}: only {self.accepted} valid updates "
                                 f"(min_clients={protocol.min_clients}); the round is skipped and the global "
                                 "model kept")
            return {}
        with observe if observe is not None else contextlib.nullcontext():
            if not protocol.aggregation.robust:
                return protocol.server.aggregate(self.round, self.replies)
            robust, robust_metrics = robust_replies(self._held, self.payload.get("weights") or {},
                                                    protocol.aggregation, self.num_classes,
                                                    declared_class_keys(protocol.server))
            self._held = []
            for reply in robust:
                self.replies.append(reply)
            return {**protocol.server.aggregate(self.round, self.replies), **robust_metrics}

    def _close_private(self, observe: contextlib.AbstractContextManager | None) -> dict[str, float]:
        """``privacy=client``: release the round's private sum (noised centrally, from the server's noise
        stream) and let the method aggregate the one reply that carries it. Every round is released, even
        one with no upload (noise only)."""
        assert self.private is not None
        protocol = self.protocol
        settings = protocol.client_privacy
        assert settings is not None
        with observe if observe is not None else contextlib.nullcontext():
            release = self.private.release(upload_noise_generator(settings, protocol.seed, self.round))
            self.replies.append(private_reply(release, self.payload.get("weights") or {},
                                              protocol.server.reply_layout()))
            return protocol.server.aggregate(self.round, self.replies)

    def record(self, server_metrics: dict[str, float], accuracy: dict[str, float] | None,
               seconds: dict[str, float], extra: dict[str, Any] | None = None) -> RoundRecord:
        """The round's row: what the protocol measured plus the engine's accuracy, times and extras (and,
        with privacy on, ``privacy: {epsilon, delta}`` after this round)."""
        epsilon = self.protocol.epsilon_after(self.round)
        if epsilon is not None:
            extra = {**(extra or {}), "privacy": {"epsilon": epsilon, "delta": float(self.protocol.ledger.delta)}}
        if self.capped:  # the weights a cap changed (every other reply weighed its num_examples)
            extra = {**(extra or {}), "capped": self.capped}
        if self.rows_bounded:  # the class rows aggregation.max_row_norm scaled down
            extra = {**(extra or {}), "rows_bounded": self.rows_bounded}
        participants: list[int] | None = self.participants
        dropped = self.dropped
        if not self.protocol.publishes_participants:  # who took part stays out of the run folder (DP's sampling)
            extra = {**(extra or {}), "num_participants": len(self.participants)}
            participants, dropped = None, [{"reason": item["reason"]} for item in self.dropped]
        return RoundRecord(round=self.round, participants=participants, train=weighted_mean(self.train_metrics),
                           server=server_metrics, accuracy=accuracy, bytes_up=self.bytes_up,
                           bytes_down=self.bytes_down, seconds=seconds, dropped=dropped, skipped=self.skipped,
                           extra={"params_up": self.params_up, "params_down": self.params_down, **(extra or {})})
