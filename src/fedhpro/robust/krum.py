"""``aggregation=krum``: the one update closest to its nearest others (Blanchard et al., NeurIPS 2017).

With ``K`` updates of which up to ``f`` may be Byzantine (``aggregation.byzantine``), the score of update ``i``
is the sum of its squared L2 distances to its ``n = K - f - 2`` nearest other updates::

    score(i) = sum over the n nearest j != i of ||w_i - w_j||^2

(``w_i - w_j = Delta_i - Delta_j``: the distance between two replies is that between their updates). The update
of the lowest score is chosen (a tie goes to the earlier reply, in client order), and every reply's
floating-point weights become the chosen one's: the method's mean of equal values returns it. Distances are
taken in float64 over all floating-point tensors of a reply together; integer tensors (BatchNorm's counters) stay
each reply's own, as under ``median``.

Krum's guarantee (the chosen update stays within a bounded distance of the honest clients' mean, whatever the
``f`` Byzantine ones send) needs ``K > 2f + 2``. With fewer replies the rule still chooses, using
``max(1, K - f - 2)`` neighbours (at most ``K - 1``; a lone reply is chosen as it is), but the guarantee does not
hold; each round's ``robust_krum_neighbours`` says how many were used, ``robust_krum_chosen`` whose update won.

Class tensors (prototypes, class gradients, soft predictions), like ``median``'s, class by class over the
replies that hold the class: Krum over the ``H`` holders' rows of that class (``H`` in place of ``K``), every
holder's row becoming the chosen row; the rows of a class a reply does not hold stay as they were.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

from fedhpro.errors import ConfigError
from fedhpro.options import option
from fedhpro.robust.base import RobustRule

#: ``aggregation.byzantine``'s default: the number of Byzantine clients Krum assumes (its guarantee then needs
#: at least 5 replies a round)
BYZANTINE = 1


@dataclass
class KrumOptions:
    byzantine: int = option(BYZANTINE, min=0,
                            help="krum: the number f of Byzantine clients it assumes; a reply's score is the sum "
                                 "of its squared distances to its K - f - 2 nearest others, the lowest wins (the "
                                 "guarantee needs K > 2f + 2 replies a round)")


def krum_neighbours(count: int, byzantine: int) -> int:
    """How many nearest others a score sums over among ``count`` updates: ``count - byzantine - 2``, at least 1
    and at most ``count - 1`` (0 for a lone update)."""
    return min(count - 1, max(1, count - byzantine - 2))


def krum_scores(distances: Sequence[Sequence[float]], byzantine: int) -> list[float]:
    """Each update's Krum score from the ``K x K`` squared distances: the sum of its
    :func:`krum_neighbours` smallest distances to the others (added smallest first)."""
    count = len(distances)
    nearest = krum_neighbours(count, byzantine)
    return [sum(sorted(distances[i][j] for j in range(count) if j != i)[:nearest]) for i in range(count)]


def krum_choice(distances: Sequence[Sequence[float]], byzantine: int) -> int:
    """The index of the update Krum chooses: the lowest :func:`krum_scores`, the earliest of equal ones."""
    scores = krum_scores(distances, byzantine)
    return min(range(len(scores)), key=lambda i: (scores[i], i))


def squared_distances(updates: Sequence[Sequence[Tensor]]) -> list[list[float]]:
    """``K x K`` squared L2 distances between updates, each a sequence of tensors (taken together), in float64."""
    count = len(updates)
    table = [[0.0] * count for _ in range(count)]
    for i in range(count):
        for j in range(i + 1, count):
            total = 0.0
            for a, b in zip(updates[i], updates[j]):
                total += float((a.detach().double() - b.detach().to(a.device).double()).pow(2).sum())
            table[i][j] = table[j][i] = total
    return table


class Krum(RobustRule):
    """Every reply's weights become those of the update with the lowest Krum score; each class's holders' rows
    become the holders' Krum row (``aggregation.byzantine``: the ``f`` it assumes)."""

    needs = "pairwise distances"
    always_written = True  # config.yaml has held its knobs since before rules declared them
    options_class = KrumOptions

    def __init__(self, options: KrumOptions) -> None:
        super().__init__(options)
        self.byzantine = int(options.byzantine)
        if self.byzantine < 0:
            raise ConfigError(f"aggregation.byzantine={self.byzantine} must be >= 0 (the number of Byzantine clients "
                              "Krum assumes), e.g. aggregation.byzantine=1")

    def weights(self, weights: Sequence[Mapping[str, Tensor]], reference: Mapping[str, Tensor],
                clients: Sequence[int]) -> tuple[list[dict[str, Tensor]], dict[str, float]]:
        keys = [key for key, value in weights[0].items() if value.is_floating_point()]
        chosen = krum_choice(squared_distances([[w[key] for key in keys] for w in weights]), self.byzantine)
        winner = weights[chosen]
        out = [{key: winner[key] if value.is_floating_point() else value for key, value in w.items()}
               for w in weights]
        return out, {"robust_krum_chosen": float(clients[chosen]),
                     "robust_krum_neighbours": float(max(0, krum_neighbours(len(weights), self.byzantine)))}

    def rows(self, rows: Tensor) -> tuple[Tensor, int]:
        chosen = krum_choice(squared_distances([[row] for row in rows]), self.byzantine)
        return rows[chosen].expand_as(rows), 0


__all__ = ["BYZANTINE", "Krum", "KrumOptions", "krum_choice", "krum_neighbours", "krum_scores", "squared_distances"]
