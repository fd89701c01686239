"""``aggregation=norm-clip``: each update ``Delta = w_k - w_global``, over all its floating-point tensors
together, scaled down to a global L2 norm of at most ``aggregation.max_norm`` (``min(1, max_norm / ||Delta||)``),
or, with ``max_norm = 0``, ``aggregation.norm_multiple`` times the round's median update norm."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

from fedhpro.options import option
from fedhpro.robust.base import RobustRule
from fedhpro.robust.median import coordinate_median, median_value


@dataclass
class NormClipOptions:
    max_norm: float = option(0.0, min=0.0, help="norm-clip: the largest L2 norm of an update w_k - w_global "
                                                "(0: norm_multiple x the round's median update norm)")
    norm_multiple: float = option(1.0, gt=0.0, help="norm-clip with max_norm=0: updates longer than this many "
                                                    "times the round's median update norm are clipped to it "
                                                    "(class tensors: rows farther from the class's median row)")


def update_norm(weights: Mapping[str, Tensor], reference: Mapping[str, Tensor]) -> float:
    """``||w - w_ref||_2`` over every floating-point tensor of ``weights`` together (in float64)."""
    total = 0.0
    for name, value in weights.items():
        if value.is_floating_point():
            delta = value.detach().double() - reference[name].detach().to(value.device).double()
            total += float(delta.pow(2).sum())
    return math.sqrt(total)


def clip_factor(norm: float, max_norm: float) -> float:
    """``min(1, max_norm / norm)``: what scales an update of L2 norm ``norm`` to at most ``max_norm``
    (1 for a zero update)."""
    if norm <= max_norm or norm == 0.0:
        return 1.0
    return max_norm / norm


def clip_update(weights: Mapping[str, Tensor], reference: Mapping[str, Tensor],
                max_norm: float) -> tuple[dict[str, Tensor], float]:
    """``(w_ref + f * (w - w_ref), f)`` with ``f = clip_factor(||w - w_ref||, max_norm)``.

    The norm is taken over all floating-point tensors together (one update, one
    factor); integer tensors are kept as they are. With ``f == 1`` the weights
    themselves are returned (no copy).
    """
    factor = clip_factor(update_norm(weights, reference), max_norm)
    if factor == 1.0:
        return dict(weights), factor
    return _scaled(weights, reference, factor), factor


def _scaled(weights: Mapping[str, Tensor], reference: Mapping[str, Tensor], factor: float) -> dict[str, Tensor]:
    scaled = {}
    for name, value in weights.items():
        if value.is_floating_point():
            base = reference[name].detach().to(device=value.device, dtype=value.dtype)
            scaled[name] = base + factor * (value.detach() - base)
        else:
            scaled[name] = value
    return scaled


class NormClip(RobustRule):
    """Each update clipped to the round's limit (``robust_clipped`` counts the clipped ones, ``robust_clip_norm``
    is the limit); each holder's row of a class pulled towards the holders' coordinate-wise median row to a
    distance of at most ``norm_multiple`` times the median distance (``robust_rows_clipped``)."""

    needs = "each update's norm"
    rows_metric = "robust_rows_clipped"
    always_written = True  # config.yaml has held its knobs since before rules declared them
    options_class = NormClipOptions

    def __init__(self, options: NormClipOptions) -> None:
        super().__init__(options)
        self.max_norm = float(options.max_norm)
        self.norm_multiple = float(options.norm_multiple)

    def weights(self, weights: Sequence[Mapping[str, Tensor]], reference: Mapping[str, Tensor],
                clients: Sequence[int]) -> tuple[list[dict[str, Tensor]], dict[str, float]]:
        norms = [update_norm(w, reference) for w in weights]
        limit = self.max_norm if self.max_norm > 0 else self.norm_multiple * median_value(norms)
        out, clipped = [], 0
        for w, norm in zip(weights, norms):
            factor = clip_factor(norm, limit)
            if factor < 1.0:
                clipped += 1
                out.append(_scaled(w, reference, factor))
            else:
                out.append(dict(w))
        return out, {"robust_clipped": float(clipped), "robust_clip_norm": float(limit)}

    def rows(self, rows: Tensor) -> tuple[Tensor, int]:
        centre = coordinate_median(list(rows))
        offsets = rows - centre
        distances = [float(d) for d in offsets.reshape(rows.shape[0], -1).double().norm(dim=1)]
        limit = self.norm_multiple * median_value(distances)
        factors = [clip_factor(d, limit) for d in distances]
        scale = rows.new_tensor(factors).reshape(-1, *([1] * (rows.dim() - 1)))
        return centre + scale * offsets, sum(f < 1.0 for f in factors)


__all__ = ["NormClip", "NormClipOptions", "clip_factor", "clip_update", "update_norm"]
