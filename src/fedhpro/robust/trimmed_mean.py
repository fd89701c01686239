"""``aggregation=trimmed-mean``: each coordinate's mean after dropping the ``floor(trim * K)`` smallest and
largest values (``aggregation.trim``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

from fedhpro.errors import ConfigError
from fedhpro.options import option
from fedhpro.robust.base import RobustRule, coordinatewise, stacked


@dataclass
class TrimmedMeanOptions:
    trim: float = option(0.2, min=0.0, help="trimmed-mean: the fraction dropped at each end, "
                                            "floor(trim * K) of K values (0 <= trim < 0.5)")

    def __post_init__(self) -> None:
        if not self.trim < 0.5:
            raise ConfigError(f"aggregation.trim={self.trim} is too large; it must be < 0.5 "
                              "(the fraction trimmed at EACH end), e.g. aggregation.trim=0.2")


def trimmed_count(count: int, beta: float) -> int:
    """How many values a trimmed mean of ``count`` values drops at each end: ``floor(beta * count)``."""
    if not 0.0 <= beta < 0.5:
        raise ValueError(f"the trim fraction must be in [0, 0.5), got {beta}")
    return int(math.floor(beta * count))


def trimmed_mean(tensors: Sequence[Tensor], beta: float) -> Tensor:
    """The coordinate-wise ``beta``-trimmed mean of ``K`` tensors of one shape.

    Each coordinate's ``floor(beta * K)`` smallest and largest values are
    dropped and the rest averaged (``beta`` in ``[0, 0.5)``; ``beta = 0`` is
    the plain unweighted mean).
    """
    ordered = stacked(tensors).sort(dim=0).values
    cut = trimmed_count(ordered.shape[0], beta)
    return ordered[cut:ordered.shape[0] - cut].mean(dim=0)


class TrimmedMean(RobustRule):
    """Every reply's weights, and each holder's row of a class, become the coordinate-wise trimmed mean of all
    of them (``aggregation.trim`` dropped at each end)."""

    needs = "a trimmed mean"
    always_written = True  # config.yaml has held its knobs since before rules declared them
    options_class = TrimmedMeanOptions

    def __init__(self, options: TrimmedMeanOptions) -> None:
        super().__init__(options)
        self.trim = float(options.trim)

    def weights(self, weights: Sequence[Mapping[str, Tensor]], reference: Mapping[str, Tensor],
                clients: Sequence[int]) -> tuple[list[dict[str, Tensor]], dict[str, float]]:
        return coordinatewise(weights, lambda tensors: trimmed_mean(tensors, self.trim)), {}

    def rows(self, rows: Tensor) -> tuple[Tensor, int]:
        return trimmed_mean(list(rows), self.trim).expand_as(rows), 0


__all__ = ["TrimmedMean", "TrimmedMeanOptions", "trimmed_count", "trimmed_mean"]
