"""``aggregation=median``: the coordinate-wise median of the replies, so that fewer than half the clients
cannot move a coordinate outside the honest clients' range."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

from fedhpro.robust.base import RobustRule, coordinatewise, stacked


def coordinate_median(tensors: Sequence[Tensor]) -> Tensor:
    """The coordinate-wise median of ``K`` tensors of one shape: a new tensor of that shape.

    With an even ``K`` each coordinate is the mean of its two middle values (the
    usual median, not ``torch.median``'s lower one), so the median of two
    tensors is their mean.
    """
    ordered = stacked(tensors).sort(dim=0).values
    count = ordered.shape[0]
    if count % 2 == 1:
        return ordered[count // 2].clone()
    return (ordered[count // 2 - 1] + ordered[count // 2]) / 2


def median_value(values: Sequence[float]) -> float:
    """The median of a few numbers (the mean of the two middle ones for an even count), as
    :func:`coordinate_median` takes it."""
    # torch only when a round is aggregated: the rules are listed (`fedhpro config`) without it
    import torch

    return float(coordinate_median([torch.tensor(float(v), dtype=torch.float64) for v in values]))


class Median(RobustRule):
    """Every reply's weights become the coordinate-wise median of all replies' weights; each holder's row of a
    class becomes the coordinate-wise median of the holders' rows."""

    needs = "a coordinate-wise median"

    def weights(self, weights: Sequence[Mapping[str, Tensor]], reference: Mapping[str, Tensor],
                clients: Sequence[int]) -> tuple[list[dict[str, Tensor]], dict[str, float]]:
        return coordinatewise(weights, coordinate_median), {}

    def rows(self, rows: Tensor) -> tuple[Tensor, int]:
        return coordinate_median(list(rows)).expand_as(rows), 0


__all__ = ["Median", "coordinate_median", "median_value"]
