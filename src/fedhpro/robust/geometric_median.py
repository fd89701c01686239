"""``aggregation=geometric-median``: the point of least summed Euclidean distance to the updates (the robust
aggregate of RFA, Pillutla et al. 2022), by Weiszfeld's iterations.

The geometric median of ``K`` points ``x_1 .. x_K`` minimises ``sum_i ||x_i - z||``. Unlike the mean it moves by
at most a bounded amount whatever fewer than half the points do, and unlike the coordinate-wise median it is one
point of the updates' space (invariant to rotations). Weiszfeld's iteration, from the mean ``z_0``::

    d_i = max(||x_i - z_t||, EPS)      z_{t+1} = sum_i (x_i / d_i) / sum_i (1 / d_i)

repeated ``aggregation.iterations`` times (a fixed count, so every engine computes the same numbers; ``EPS``
keeps a step defined when ``z_t`` lands on a point). Each reply is one point: all its floating-point tensors
together, in float64; every reply's floating-point weights become the median (the method's mean of equal values
returns it), integer tensors (BatchNorm's counters) stay each reply's own. Class tensors class by class over the
replies that hold the class: each holder's row becomes the holders' geometric median row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fedhpro.options import option
from fedhpro.robust.base import RobustRule, stacked

if TYPE_CHECKING:
    from torch import Tensor

#: the smallest distance a Weiszfeld step divides by (a median on one of the points stays defined there)
EPS = 1e-8


@dataclass
class GeometricMedianOptions:
    iterations: int = option(100, min=1, help="geometric-median: the number of Weiszfeld steps from the updates' "
                                              "mean (each moves the point towards the least summed distance; "
                                              "a fixed count, the same on every engine)")


def geometric_median(points: Tensor, iterations: int) -> Tensor:
    """The geometric median of the rows of ``points`` (``K x D``), after ``iterations`` Weiszfeld steps from their
    mean, in float64."""
    x = points.double()
    z = x.mean(dim=0)
    for _ in range(iterations):
        inverse = 1.0 / (x - z).norm(dim=1).clamp_min(EPS)
        z = (inverse[:, None] * x).sum(dim=0) / inverse.sum()
    return z


class GeometricMedian(RobustRule):
    """Every reply's weights, and each holder's row of a class, become the geometric median of all of them."""

    needs = "the distances between updates"
    options_class = GeometricMedianOptions

    def __init__(self, options: GeometricMedianOptions) -> None:
        super().__init__(options)
        self.iterations = int(options.iterations)

    def weights(self, weights: Sequence[Mapping[str, Tensor]], reference: Mapping[str, Tensor],
                clients: Sequence[int]) -> tuple[list[dict[str, Tensor]], dict[str, float]]:
        keys = [key for key, value in weights[0].items() if value.is_floating_point()]
        if not keys:
            return [dict(w) for w in weights], {}
        points = stacked([_flat([w[key] for key in keys]) for w in weights])
        median = geometric_median(points, self.iterations)
        shared, start = {}, 0
        for key in keys:
            value = weights[0][key]
            shared[key] = median[start:start + value.numel()].reshape(value.shape).to(value.dtype)
            start += value.numel()
        return [{key: shared.get(key, value) for key, value in w.items()} for w in weights], {}

    def rows(self, rows: Tensor) -> tuple[Tensor, int]:
        median = geometric_median(rows.detach().reshape(rows.shape[0], -1), self.iterations)
        return median.reshape(rows.shape[1:]).to(rows.dtype).expand_as(rows), 0


def _flat(tensors: Sequence[Tensor]) -> Tensor:
    """One reply's floating-point tensors as one float64 vector, in the given order."""
    # torch only when a round is aggregated: the rules' options are read (`fedhpro config`) without it
    import torch

    return torch.cat([t.detach().double().reshape(-1) for t in tensors])


__all__ = ["EPS", "GeometricMedian", "GeometricMedianOptions", "geometric_median"]
