"""A robust aggregation rule at close: the round's accepted replies, kept whole, made robust by the rule the run
chose (``aggregation=``, any rule of :data:`fedhpro.robust.REGISTRY`) before the method aggregates them.

:func:`robust_replies` applies a :class:`~fedhpro.robust.base.RobustRule` to a round's replies: the rule's
:meth:`~fedhpro.robust.base.RobustRule.weights` to the replies' weights, and its
:meth:`~fedhpro.robust.base.RobustRule.rows` to each class's rows of every class tensor over the replies that
hold the class (``class_counts > 0``; every class for a reply without counts), rows of a class a reply does not
hold left as they were. :class:`RobustFold` is the fold of the reply chain (:mod:`fedhpro.engines.chain`) that
keeps the replies until close and hands the method the robust ones: the method's mean of equal values is that
value (to float rounding), so FedAvg, the prototype means, FedGMKD's DAT weighting and FedHPro's class gradients
all aggregate robustly without any method knowing; a server step that is not a mean (FedTGP's trained
prototypes, FedHPro's gradient matching) gets robust inputs instead of robust outputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from fedhpro.engines.chain import Fold, Incoming, RoundState
from fedhpro.engines.class_rows import class_tensor_keys, declared_class_keys, holders
from fedhpro.robust import RobustRule, rule_for


def robust_replies(replies: Sequence[dict[str, Any]], global_weights: Mapping[str, Tensor], rule: Any,
                   num_classes: int | None, class_keys: Sequence[str] | None = None,
                   clients: Sequence[int] | None = None) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """A round's validated replies made robust by ``rule`` (a :class:`~fedhpro.robust.base.RobustRule`, or the
    ``aggregation.*`` options naming one), as new dicts (the inputs are not changed), and what was done
    (``robust_*`` server metrics: ``robust_updates``, then the rule's own). ``clients``: whose each reply is
    (default: their positions), for a rule's metrics.

    Weights: the rule's new weights for every reply (``median`` / ``trimmed-mean``: the coordinate-wise
    aggregate of all replies' floating-point weights, integer counters staying each reply's own; ``norm-clip``:
    each update ``w_k - w_global`` scaled to at most the round's limit; ``krum``: the chosen update's).

    Class tensors (:func:`~fedhpro.engines.class_rows.class_tensor_keys`), per class over the replies that hold it
    (``class_counts > 0``; every class for a reply without counts): the holders' rows through the rule's
    ``rows`` (the coordinate-wise median or trimmed mean, or with ``norm-clip`` each holder's row pulled
    towards the holders' coordinate-wise median to at most ``norm_multiple`` x the median distance, counted in
    the rule's ``rows_metric``). Rows of classes a reply does not hold are left as they are.

    The method then aggregates these replies with its own rule: a mean of equal values is that value,
    so the method's aggregate is the robust one.
    """
    robust = rule if isinstance(rule, RobustRule) else rule_for(rule)
    out = [dict(reply) for reply in replies]
    metrics = {"robust_updates": float(len(out))}
    if not out:
        return out, metrics
    first = out[0].get("weights")
    if isinstance(first, Mapping) and first:
        who = list(clients) if clients is not None else list(range(len(out)))
        weights, found = robust.weights([reply["weights"] for reply in out], global_weights, who)
        for reply, value in zip(out, weights):
            reply["weights"] = value
        metrics.update(found)
    keys = [key for key in class_tensor_keys(out[0], num_classes, class_keys)
            if all(isinstance(r.get(key), Tensor) and r[key].shape == out[0][key].shape for r in out)]
    if keys:
        classes = num_classes if num_classes is not None else out[0][keys[0]].shape[0]
        held_by = holders(out, classes)
        changed = 0
        for key in keys:
            stacked = torch.stack([reply[key].detach() for reply in out])
            combined = stacked.clone()
            for c in range(classes):
                held = held_by[:, c].to(stacked.device)
                if bool(held.any()):
                    combined[held, c], count = robust.rows(stacked[held, c])
                    changed += count
            for index, reply in enumerate(out):
                reply[key] = combined[index]
        if robust.rows_metric is not None:
            metrics[robust.rows_metric] = float(changed)
    return out, metrics


class RobustFold(Fold):
    """The accepted replies kept whole until close (a robust rule needs them all at once: one model per client,
    not the running sum); at close :func:`robust_replies` under ``rule``, then the method's own aggregate of the
    robust replies, with the rule's metrics."""

    def __init__(self, round: RoundState, rule: RobustRule) -> None:
        super().__init__(round)
        self.rule = rule
        #: whose each held reply is, in the order they came
        self.clients: list[int] = []

    def add(self, incoming: Incoming, round: RoundState) -> None:
        self.held.append(incoming.kept_whole())
        self.clients.append(incoming.client)

    def aggregate(self, round: RoundState) -> dict[str, float]:
        server = round.protocol.server
        robust, metrics = robust_replies(self.held, round.global_weights, self.rule, round.num_classes,
                                         declared_class_keys(server), self.clients)
        self.held, self.clients = [], []
        for reply in robust:
            self.replies.append(reply)
        return {**server.aggregate(round.round, self.replies), **metrics}


__all__ = ["RobustFold", "robust_replies"]
