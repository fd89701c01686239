"""The steps of the reply chain that check and bound a reply (:mod:`fedhpro.engines.chain`): what a client
says it holds (:func:`examples_problem`, :func:`counts_problem`), the method's own checks, the bytes measured,
the bound on class-tensor rows (``aggregation.max_row_norm``, :func:`bounded_rows`) and the cap on one client's
weight (``aggregation.max_share`` / ``max_ratio``, :func:`weight_cap` and :func:`capped_reply`).

A client's size is a claim: its FedAvg weight is the ``num_examples`` it reports, its class statistics weigh by
its ``class_counts``, and a class row is its own; each bound here limits what a claim can buy, for every
method and rule and on both engines.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedhpro.aggregation import claim_cap
from fedhpro.engines.chain import Fold, Incoming, ReplyStep, RoundState
from fedhpro.engines.class_rows import declared_class_keys
from fedhpro.engines.faults import method_problem, same
from fedhpro.errors import ConfigError
from fedhpro.methods.layout import layout_problem
from fedhpro.metrics import payload_bytes, payload_parameters


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


#: the largest magnitude a training metric may have: n_k-weighted sums of such values (n_k up to 10^9 samples,
#: any realistic number of clients) stay far below float64's 1.8e308, so a round's weighted mean cannot
#: overflow; an honest loss or accuracy is many orders below
MAX_METRIC_VALUE = 1e30
#: the largest L2 norm a class row a client holds may have: its square (1e30) stays eight orders below float32's
#: largest value (3.4e38), so squared distances to it, summed over a batch and the classes, cannot overflow to
#: inf (a FedProto row of 1e30 made every client's loss non-finite); honest rows (features, gradients,
#: probabilities) are many orders below. Rows large against the other clients' rows are another bound's matter.
MAX_ROW_NORM = 1e15


def metrics_problem(metrics: Any) -> str | None:
    """Why a reply's training metrics cannot be folded into the round's n_k-weighted mean, or None when each is
    a finite number of magnitude at most :data:`MAX_METRIC_VALUE` (an inf or a NaN made the round's train row
    null; a 1e308 overflows the weighted sum)."""
    if not isinstance(metrics, Mapping):
        return f"its training metrics are a {type(metrics).__name__}, not named numbers"
    for name, value in metrics.items():
        problem = metric_problem(str(name), value)
        if problem is not None:
            return problem
    return None


def metric_problem(name: str, value: Any) -> str | None:
    """Why one training metric ``name = value`` is not a finite number within :data:`MAX_METRIC_VALUE`, or None."""
    shown = name[:40]
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating, Tensor)):
        return f"training metric '{shown}' is a {type(value).__name__}, not a number"
    if isinstance(value, Tensor) and (value.numel() != 1 or value.is_complex()):
        return f"training metric '{shown}' is a tensor of {value.numel()} values, not a number"
    number = float(value)
    if not math.isfinite(number):
        return f"training metric '{shown}' is {number}, not a finite number"
    if abs(number) > MAX_METRIC_VALUE:
        return f"training metric '{shown}' is {number:g}, beyond +-{MAX_METRIC_VALUE:g}"
    return None


def rows_problem(reply: Any, class_keys: Sequence[str], max_norm: float = MAX_ROW_NORM) -> str | None:
    """Why the rows of the reply's class tensors ``class_keys`` (the method's declared ones) that its client
    holds (``class_counts > 0``; every row without counts) cannot be aggregated, or None when each is finite with
    an L2 norm of at most ``max_norm`` (:data:`MAX_ROW_NORM`). Rows of classes the client does not hold are never
    read (the methods' own checks skip them too)."""
    if not isinstance(reply, Mapping):
        return None  # the method's checks name what the reply is
    counts = reply.get("class_counts")
    for key in class_keys:
        rows = reply.get(key)
        if not isinstance(rows, Tensor) or rows.dim() == 0 or not rows.is_floating_point():
            continue
        flat = rows.detach().reshape(rows.shape[0], -1)
        if flat.numel() == 0:
            continue
        peaks = flat.abs().amax(dim=1)  # one pass in the tensor's own dtype; a NaN stays NaN
        held = torch.ones(flat.shape[0], dtype=torch.bool, device=flat.device)
        if isinstance(counts, Tensor) and counts.dim() == 1 and counts.shape[0] == flat.shape[0]:
            held = counts.detach().to(flat.device) > 0
        peaks = peaks[held]
        if peaks.numel() == 0:
            continue
        if not bool(torch.isfinite(peaks).all()):
            return f"{key} holds NaN or Inf in a row of a class it holds"
        if float(peaks.max()) * math.sqrt(flat.shape[1]) <= max_norm:
            continue  # no row's norm can exceed the bound: the exact norms are not needed
        norms = flat[held].double().norm(dim=1)  # in float64: a float32 row of 1e30 entries has a finite norm
        if bool((norms > max_norm).any()):
            return (f"{key} holds a class row of L2 norm {float(norms.max()):.3g}, beyond {max_norm:g} (its square "
                    "would overflow the model's arithmetic)")
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


def weight_cap(aggregation: Any, sizes: Sequence[float], claimed: bool) -> float:
    """The most weight one of the clients of ``sizes`` may hold under ``aggregation``
    (:class:`~fedhpro.config.AggregationOptions`): the share cap, and where the sizes are ``claimed`` (nobody
    vouches for them) ``max_ratio`` times the median claim too (:func:`~fedhpro.aggregation.claim_cap`)."""
    return claim_cap(sizes, aggregation.max_share, aggregation.max_ratio if claimed else 0.0)


def bound_text(aggregation: Any, claimed: bool) -> str:
    """The bound on a client's weight in words, for the lines that say a size was capped."""
    share = f"aggregation.max_share={aggregation.max_share:g} of the federation's total"
    if claimed and aggregation.max_ratio > 0:
        return f"{share} or aggregation.max_ratio={aggregation.max_ratio:g} x the median client's size"
    return share


def check_bounds(aggregation: Any) -> None:
    """The bounds of ``aggregation`` a protocol can apply (a one-line ConfigError otherwise): ``max_share`` in
    (0, 1], ``max_row_norm >= 0``, ``max_ratio`` 0 or at least 1 (the config checks these too when it reads
    them; options built in Python are checked here)."""
    if not 0.0 < aggregation.max_share <= 1.0:
        raise ConfigError(f"aggregation.max_share must be in (0, 1], got {aggregation.max_share!r}")
    if not aggregation.max_row_norm >= 0.0:
        raise ConfigError(f"aggregation.max_row_norm must be >= 0, got {aggregation.max_row_norm!r}")
    if not (aggregation.max_ratio == 0.0 or aggregation.max_ratio >= 1.0):
        raise ConfigError(f"aggregation.max_ratio must be 0 or >= 1, got {aggregation.max_ratio!r}")


class LayoutChecks(ReplyStep):
    """The reply's keys must be exactly those the method's reply layout declares (``layout``: the server's
    :meth:`~fedhpro.methods.base.Server.reply_layout`, privatized under ``privacy=client``), its tensors of the
    declared shapes (:func:`~fedhpro.methods.layout.layout_problem`): what the Flower server refuses before it
    decodes a reply, refused here on every engine, so that a client uploads only what its server reads. A set
    comparison of the keys and a look at each tensor's shape: nothing of an honest reply changes."""

    def __init__(self, layout: Mapping[str, Any] | None = None) -> None:
        self.layout = layout

    def for_round(self, round: RoundState, fold: Fold) -> ReplyStep:
        """Without a ``layout`` given: the checks of the layout the server declares now."""
        return self if self.layout is not None else LayoutChecks(round.protocol.server.reply_layout())

    def receive(self, incoming: Incoming, round: RoundState) -> str | None:
        if not isinstance(incoming.reply, Mapping):
            return None  # the method's checks name what the reply is
        problem = layout_problem(incoming.reply, self.layout or {})
        return None if problem is None else f"invalid update: {problem}"


class SizeChecks(ReplyStep):
    """The reply's ``num_examples`` (:func:`examples_problem`) and ``class_counts`` (:func:`counts_problem`)
    must be what its client can hold, and its training metrics finite and bounded (:func:`metrics_problem`): a
    reply with an inf, NaN or 1e308 metric is refused whole, like an invalid update, before anything of it is
    measured or folded (the first checks of the chain, before the injected faults: the client's own fault)."""

    def receive(self, incoming: Incoming, round: RoundState) -> str | None:
        problem = examples_problem(incoming.reply, incoming.client, incoming.num_samples)
        if problem is None:
            problem = counts_problem(incoming.reply, round.num_classes)
        if problem is None:
            problem = metrics_problem(incoming.metrics)
        return None if problem is None else f"invalid update: {problem}"


class MethodChecks(ReplyStep):
    """The method's own checks (its server's ``validate_reply``) of the reply as it now is (as ``view`` shows
    it to the method), then, for every method alike, its declared class tensors' held rows
    (:func:`~fedhpro.engines.class_rows.declared_class_keys`): finite and of L2 norm at most :data:`MAX_ROW_NORM`
    (:func:`rows_problem`). After the injected faults: a hostile factor that makes a row unbounded is the fault's."""

    def __init__(self, view: Callable[[Any], Any] = same) -> None:
        self.view = view
        self.class_keys: list[str] | None = None  # the server's declared class tensors, read once

    def receive(self, incoming: Incoming, round: RoundState) -> str | None:
        reply = self.view(incoming.reply)
        problem = method_problem(round, reply)
        if problem is not None:
            return problem
        if self.class_keys is None:
            self.class_keys = declared_class_keys(round.protocol.server)
        problem = rows_problem(reply, self.class_keys)
        return None if problem is None else f"invalid update: {problem}"


class Measured(ReplyStep):
    """The bytes and parameters the reply carried, into the round's ``bytes_up`` / ``params_up``."""

    def receive(self, incoming: Incoming, round: RoundState) -> str | None:
        round.bytes_up += payload_bytes(incoming.reply)
        round.params_up += payload_parameters(incoming.reply)
        return None


class RowBound(ReplyStep):
    """``aggregation.max_row_norm``: every class-tensor row (``keys``: the method's declared class tensors) longer
    than ``max_norm`` scaled down to it (:func:`bounded_rows`); the round's ``rows_bounded`` says whose."""

    def __init__(self, keys: Sequence[str] | None, max_norm: float) -> None:
        self.keys = list(keys) if keys is not None else None
        self.max_norm = max_norm

    def for_round(self, round: RoundState, fold: Fold) -> ReplyStep:
        """Without ``keys`` given: the class tensors the server declares now."""
        return self if self.keys is not None else RowBound(declared_class_keys(round.protocol.server), self.max_norm)

    def receive(self, incoming: Incoming, round: RoundState) -> str | None:
        incoming.reply, scaled = bounded_rows(incoming.reply, self.keys or [], self.max_norm)
        if scaled:
            round.rows_bounded.append({"client": incoming.client, "rows": scaled})
        return None


class WeightCap(ReplyStep):
    """A size is a claim: it buys at most the round's ``cap`` (:meth:`RoundProtocol.weight_cap
    <fedhpro.engines.protocol.RoundProtocol.weight_cap>`). A reply above it weighs ``floor(cap)``
    (:func:`capped_reply`); the round's ``capped`` lists it, and the first time a client is capped the protocol's
    ``on_drop`` says so."""

    def __init__(self, cap: float | None = None) -> None:
        self.cap = cap

    def for_round(self, round: RoundState, fold: Fold) -> ReplyStep:
        """Without a ``cap`` given: the protocol's weight cap now."""
        return self if self.cap is not None else WeightCap(round.protocol.weight_cap())

    def receive(self, incoming: Incoming, round: RoundState) -> str | None:
        reply, client, protocol = incoming.reply, incoming.client, round.protocol
        cap = self.cap if self.cap is not None else math.inf
        if int(reply["num_examples"]) <= cap:
            return None
        weight = incoming.weight = max(1, math.floor(cap))
        round.capped.append({"client": client, "claimed": int(reply["num_examples"]), "weight": weight})
        if client not in protocol.warned_caps and protocol.on_drop is not None:
            protocol.warned_caps.add(client)
            claimed = protocol.sizes_claimed
            protocol.on_drop(
                f"round {round.round + 1}: client {client}'s weight is capped at {weight} (it reports "
                f"{int(reply['num_examples'])} training samples, more than "
                f"{bound_text(protocol.aggregation, claimed)} of {sum(protocol.client_sizes or [])}); "
                + ("if that size is right, vouch for it in flower.roster (or raise aggregation.max_ratio, 0: no "
                   "such bound)" if claimed and protocol.aggregation.max_ratio > 0 else
                   "if that size is right, raise aggregation.max_share (1: no cap)"))
        incoming.reply = capped_reply(reply, weight)
        return None


class TrainingMetrics(ReplyStep):
    """The client's training metrics, weighted by what its reply weighs (its sample count, or the cap); finite and
    at most :data:`MAX_METRIC_VALUE` in magnitude (:class:`SizeChecks`, earlier in the chain, refused any other)."""

    def receive(self, incoming: Incoming, round: RoundState) -> str | None:
        round.train_metrics.append((min(int(incoming.num_samples), incoming.weight), incoming.metrics))
        return None


__all__ = ["MAX_METRIC_VALUE", "MAX_ROW_NORM", "LayoutChecks", "MethodChecks", "Measured", "RowBound", "SizeChecks",
           "TrainingMetrics", "WeightCap", "bound_text", "bounded_rows", "capped_reply", "check_bounds",
           "counts_problem", "examples_problem", "metric_problem", "metrics_problem", "rows_problem", "weight_cap"]
