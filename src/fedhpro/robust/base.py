"""What every robust aggregation rule is: :class:`RobustRule`, and the helpers the rules share.

A rule (``aggregation=<name>``) sees the round's accepted replies at once, before the method aggregates them,
and gives each reply new values of two kinds (:mod:`fedhpro.engines.robust` applies it, the same on every
engine and for every method):

* the weights: :meth:`RobustRule.weights` maps every reply's floating-point weights (integer tensors such as
  BatchNorm's ``num_batches_tracked`` are counters, and stay each reply's own) to new ones;
* the class tensors (prototypes, class gradients, soft predictions): for each class, the rows of the replies
  that hold it (``H x ...``) go through :meth:`RobustRule.rows`.

The method then aggregates the changed replies with its own rule, so a mean of equal values returns the robust
value. Every rule weights the clients equally: a client's ``num_examples`` is what it says it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from torch import Tensor


class RobustRule:
    """One rule of ``aggregation=``: a subclass, registered by name in :data:`fedhpro.robust.REGISTRY`.

    A rule declares its own knobs beside its code: :attr:`options`, a dataclass of ``option(...)`` fields (torch-free;
    each field becomes the key ``aggregation.<field>``, listed by ``fedhpro config --keys``). It is built with an
    instance of them (:func:`fedhpro.robust.rule_for` takes the values from the run's ``aggregation.*`` section)
    and reads them in ``__init__``. The base class is the identity: what :meth:`weights` and :meth:`rows` return for
    a rule that changes nothing.
    """

    #: the rule's own knobs (a dataclass whose fields all have defaults), None for none
    options_class: ClassVar[type | None] = None
    #: whether config.yaml holds the rule's knobs whichever rule a run chooses (the rules whose knobs it has always
    #: held, so that every run's config.yaml stays as it was); otherwise only when the run chooses the rule or sets
    #: a knob off its default
    always_written: ClassVar[bool] = False

    #: what the rule needs of each client's own update, in words ("": nothing, the replies reach the method as
    #: they came and the round folds them as they arrive); a server that sees only the replies' noised or
    #: masked sum (``privacy=client``, SecAgg+) cannot give it, and says so with these words
    needs: ClassVar[str] = ""
    #: the server metric counting the class-tensor rows :meth:`rows` changed (None: not reported)
    rows_metric: ClassVar[str | None] = None

    def __init__(self, options: object = None) -> None:
        self.options = options

    def weights(self, weights: Sequence[Mapping[str, Tensor]], reference: Mapping[str, Tensor],
                clients: Sequence[int]) -> tuple[list[dict[str, Tensor]], dict[str, float]]:
        """Each reply's new weights (``weights[i]``: reply ``i``'s, of client ``clients[i]``; ``reference``: the
        global weights the round broadcast) and the rule's ``robust_*`` server metrics. New dicts, in the
        replies' key order; the inputs are not changed."""
        return [dict(w) for w in weights], {}

    def rows(self, rows: Tensor) -> tuple[Tensor, int]:
        """One class's rows over its holders (``H x ...``, ``H >= 1``): ``(new rows, how many were changed)``,
        counted under :attr:`rows_metric`."""
        return rows, 0


def stacked(tensors: Sequence[Tensor]) -> Tensor:
    """The tensors of one shape stacked along a new first dimension (detached); a ValueError for none."""
    if len(tensors) == 0:
        raise ValueError("a robust aggregate needs at least one tensor")
    # torch only when a round is aggregated: the rules are listed (`fedhpro config`) without it
    import torch

    return torch.stack([t.detach() for t in tensors])


def coordinatewise(weights: Sequence[Mapping[str, Tensor]],
                   combine: Callable[[list[Tensor]], Tensor]) -> list[dict[str, Tensor]]:
    """Every reply's weights replaced by ``combine`` of all replies' tensors, key by key: one value shared by
    every reply for each floating-point key of the first reply, the other tensors each reply's own."""
    combined = {key: combine([w[key] for w in weights]) for key, value in weights[0].items()
                if value.is_floating_point()}
    return [{key: combined.get(key, value) for key, value in w.items()} for w in weights]


__all__ = ["RobustRule", "coordinatewise", "stacked"]
