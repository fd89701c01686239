"""The bound on what one reply's content can buy (``aggregation.update_bound``): a step of the round's chain that
holds the accepted replies until close and scales each one's change to a multiple of the round's median
before the method (or a robust rule) aggregates them.

A size is a claim that ``aggregation.max_ratio`` bounds; the content of a reply is a claim too where its node
trains on data the server never sees (a Flower deployment whose nodes hold their own data, with or without a
roster: a roster vouches for sizes, not for what a node sends). Scale-free, as ``aggregation=norm-clip`` with
``max_norm=0``, but weighted: what a reply moves the model by is its weight times its change, ``n_k ||Delta_k||``
(``Delta_k = w_k - w_global``), so :func:`bounded_updates` scales each ``Delta_k`` so that
``n_k ||Delta_k|| <= kappa x median_j n_j ||Delta_j||`` (``kappa = aggregation.update_multiple``), and each
class row ``r_kc`` so that ``n_kc ||r_kc|| <= kappa x median n_jc ||r_jc||`` over the replies that hold class c
(``n_kc``: its class count; a row's norm, since a class row is a statistic, not a change). A reply that weighs
1/K of the round pulls at most ``kappa`` honest medians however large its values; one that legally weighs twice
the median is held to the same pull as the others, since its weight is already counted.

:class:`BoundedFold` is the step: a fold around the round's own fold (the method's running sum or a robust
rule's), which it hands the bounded replies at close, in the order they came.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from fedhpro.engines.chain import Fold, Incoming, RoundState
from fedhpro.engines.class_rows import class_tensor_keys, declared_class_keys, holders
from fedhpro.robust.median import median_value
from fedhpro.robust.norm_clip import clip_factor, update_norm


def _weight(reply: Mapping[str, Any]) -> float:
    value = reply.get("num_examples", 1)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 1.0


def _scaled_update(weights: Mapping[str, Tensor], reference: Mapping[str, Tensor], factor: float
                   ) -> dict[str, Tensor]:
    out = {}
    for name, value in weights.items():
        if isinstance(value, Tensor) and value.is_floating_point() and name in reference:
            base = reference[name].detach().to(device=value.device, dtype=value.dtype)
            out[name] = base + factor * (value.detach() - base)
        else:
            out[name] = value
    return out


def bounded_updates(replies: Sequence[Mapping[str, Any]], global_weights: Mapping[str, Tensor], multiple: float,
                    num_classes: int | None = None, class_keys: Sequence[str] | None = None,
                    clients: Sequence[int] | None = None, weighted: bool = True
                    ) -> tuple[list[dict[str, Any]], dict[str, float], list[dict[str, Any]]]:
    """``replies`` (a round's accepted replies, their weights ``num_examples`` as capped) with each one's pull
    bounded to ``multiple`` x the round's median pull, as new dicts (the inputs are not changed), the
    server metrics (``bounded_updates``: how many updates were scaled down, ``bounded_rows``: how many class
    rows) and the round row's entries (``{"client", "factor"}`` for an update, ``"rows"`` for class rows).

    Weights: ``Delta_k = w_k - w_global`` over the floating-point tensors together is scaled by
    ``min(1, multiple x median_j(n_j ||Delta_j||) / (n_k ||Delta_k||))``. Class tensors (``class_keys``, else
    :func:`~fedhpro.engines.class_rows.class_tensor_keys`), class by class over the replies that hold it
    (``class_counts > 0``): row ``r_kc`` scaled by ``min(1, multiple x median_j(n_jc ||r_jc||) /
    (n_kc ||r_kc||))``, ``n_kc`` the reply's count of class c (its ``num_examples`` without counts). Norms in
    float64, so a row of 1e30 is measured, not overflowed. ``clients``: whose each reply is (default: positions).
    ``weighted=False``: every weight and count taken as 1 (the plain ``||Delta_k||`` of norm-clip, measured in
    ``bench/liar_sites.py --unweighted``).
    """
    out = [dict(reply) for reply in replies]
    who = list(clients) if clients is not None else list(range(len(out)))
    found: dict[int, dict[str, Any]] = {}
    scaled_updates = scaled_rows = 0
    if not out:
        return out, {"bounded_updates": 0.0, "bounded_rows": 0.0}, []
    weights = [_weight(reply) if weighted else 1.0 for reply in out]
    if all(isinstance(reply.get("weights"), Mapping) and reply["weights"]
           and all(name in global_weights for name, value in reply["weights"].items()
                   if isinstance(value, Tensor) and value.is_floating_point()) for reply in out):
        pulls = [n * update_norm(reply["weights"], global_weights) for n, reply in zip(weights, out)]
        limit = multiple * median_value(pulls)
        for index, (reply, pull) in enumerate(zip(out, pulls)):
            factor = clip_factor(pull, limit) if math.isfinite(pull) else 0.0
            if factor < 1.0:
                scaled_updates += 1
                reply["weights"] = _scaled_update(reply["weights"], global_weights, factor)
                found.setdefault(index, {"client": who[index]})["factor"] = float(f"{factor:.6g}")
    keys = [key for key in class_tensor_keys(out[0], num_classes, class_keys)
            if all(isinstance(r.get(key), Tensor) and r[key].shape == out[0][key].shape for r in out)]
    if keys:
        classes = num_classes if num_classes is not None else out[0][keys[0]].shape[0]
        held_by = holders(out, classes)
        counts = torch.stack([reply["class_counts"].detach().cpu().double()
                              if weighted and isinstance(reply.get("class_counts"), Tensor)
                              and tuple(reply["class_counts"].shape) == (classes,)
                              else torch.full((classes,), weight, dtype=torch.float64)
                              for reply, weight in zip(out, weights)])
        for key in keys:
            stacked = torch.stack([reply[key].detach() for reply in out])
            norms = stacked.reshape(len(out), classes, -1).double().norm(dim=2).cpu()
            pulls = counts * norms
            factors = torch.ones(len(out), classes, dtype=torch.float64)
            for c in range(classes):
                held = held_by[:, c]
                if not bool(held.any()):
                    continue
                limit = multiple * median_value([float(p) for p in pulls[held, c]])
                for index in torch.nonzero(held).flatten().tolist():
                    pull = float(pulls[index, c])
                    factors[index, c] = clip_factor(pull, limit) if math.isfinite(pull) else 0.0
            for index, reply in enumerate(out):
                row = factors[index] < 1.0
                if not bool(row.any()):
                    continue
                count = int(row.sum())
                scaled_rows += count
                scale = factors[index].to(dtype=stacked.dtype, device=stacked.device)
                reply[key] = stacked[index] * scale.reshape(classes, *([1] * (stacked.dim() - 2)))
                entry = found.setdefault(index, {"client": who[index]})
                entry["rows"] = entry.get("rows", 0) + count
    metrics = {"bounded_updates": float(scaled_updates), "bounded_rows": float(scaled_rows)}
    return out, metrics, [found[index] for index in sorted(found)]


class BoundedFold(Fold):
    """``aggregation.update_bound``: the accepted replies held whole until close, then bounded
    (:func:`bounded_updates` at ``multiple``) and handed, in the order they came, to ``inner`` (the round's own
    fold: the method's running sum, or a robust rule's), which aggregates them. The round's row lists what was
    scaled (``bounded``), the server metrics count it."""

    #: each pull weighted by the reply's weight (``False``: the plain norms, for the bench's comparison)
    weighted: ClassVar[bool] = True

    def __init__(self, round: RoundState, inner: Fold, multiple: float) -> None:
        self.inner = inner
        self.multiple = multiple
        #: the replies held until close, whole (views copied), in the order they came
        self.held: list[dict[str, Any]] = []
        self._incoming: list[Incoming] = []

    @property
    def replies(self) -> Any:  # type: ignore[override]
        """The inner fold's container (the method's replies)."""
        return self.inner.replies

    @property
    def count(self) -> int:
        return len(self._incoming) + self.inner.count

    def add(self, incoming: Incoming, round: RoundState) -> None:
        reply = incoming.kept_whole()
        self._incoming.append(Incoming(incoming.client, reply, incoming.metrics, incoming.num_samples,
                                       incoming.weight, None, incoming.fault))
        self.held.append(reply)

    def aggregate(self, round: RoundState) -> dict[str, float]:
        held, self._incoming, self.held = self._incoming, [], []
        bounded, metrics, entries = bounded_updates(
            [incoming.reply for incoming in held], round.global_weights, self.multiple, round.num_classes,
            declared_class_keys(round.protocol.server), [incoming.client for incoming in held], self.weighted)
        if entries and hasattr(round, "bounded"):
            round.bounded.extend(entries)
        for incoming, reply in zip(held, bounded):
            incoming.reply = reply
            self.inner.add(incoming, round)
        return {**self.inner.aggregate(round), **metrics}


__all__ = ["BoundedFold", "bounded_updates"]
