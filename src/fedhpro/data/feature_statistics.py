"""Federated feature statistics (``data.standardize=federated``): one scaling shared by every site.

Each site computes, from its own training features, the count, the sum and
the sum of squares of every feature (:func:`feature_sums`, float64: a sum of
squares in float32 cancels badly); that is all it releases. The server
combines the sites' sums into one mean and one population standard deviation
per feature (:func:`shared_scaling`), the statistics of every site's training
rows pooled (what scikit-learn's ``StandardScaler`` fits on the pooled rows),
and every site scales its training and test features by them
(:func:`~fedhpro.data.client_scaling.apply_statistics`). Per-site scaling
(``data.standardize=client``) maps a site that holds one class onto the
others' classes; a shared scaling keeps the sites' features comparable.

The in-process simulator and a Flower node use the same functions: the
simulator over its clients' tensors, the Flower server over the sums the
nodes send in their answer to the discovery query.

What a site sends is a claim (:func:`sums_problem` checks its form and its
consistency). Two guards bound what a false one buys:

* ``weights``: each site's sums count as ``weight`` rows (its sums scaled by
  ``weight / count``), the weight the round gives its training size; where
  sizes are claims that weight is bounded as ``aggregation.max_ratio`` bounds
  sizes;
* ``data.statistics_limit``: with three sites or more, a site whose sums make
  the pooled standard deviation of some feature more than ``limit`` times
  what the other sites' give alone (:func:`influence`) is left out of the
  statistics, with a warning naming the site and the feature. One node's sum
  of squares cannot squash every site's inputs; honest label skew (a site of
  one class) moves a feature's spread by a small factor (a site 3 standard
  deviations away with half the weight: 2.0).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fedhpro.data.standardize_options import (  # noqa: F401 (kept importable here: declared torch-free there)
    CLIENT,
    FEDERATED,
    FORMER_FEDERATED,
    NONE,
    STANDARDIZE_CHOICES,
    STATISTICS_LIMIT,
    resolved_standardize,
)
from fedhpro.errors import ConfigError

#: the most features whose sums one answer may carry (a bound on what a node's claim allocates)
MAX_FEATURES = 1_000_000


@dataclass(frozen=True)
class FeatureSums:
    """One site's release: how many training rows, and per feature their sum and sum of squares (float64)."""

    count: int
    sum: Tensor
    sum_squares: Tensor

    def as_json(self) -> dict[str, Any]:
        return {"count": self.count, "sum": self.sum.tolist(), "sum_squares": self.sum_squares.tolist()}


@dataclass
class SharedScaling:
    """The combined statistics: ``mean`` and ``std`` per feature (float64; ``std`` 1 where a feature is
    constant, so that it is only centred), the sites they pool and the sites left out, with why; ``given``:
    where they came from when no sums were combined (the config's ``data.feature_mean`` / ``feature_std``)."""

    mean: Tensor
    std: Tensor
    sites: list[str]
    left_out: dict[str, str] = field(default_factory=dict)
    given: str | None = None

    def as_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"mean": self.mean.tolist(), "std": self.std.tolist(), "sites": list(self.sites)}
        if self.left_out:
            record["left_out"] = dict(self.left_out)
        if self.given is not None:
            record["given"] = self.given
        return record


def feature_sums(x: Tensor) -> FeatureSums:
    """The count, sum and sum of squares per feature of float ``N x F`` training features, in float64."""
    column = x.detach().to(torch.float64)
    return FeatureSums(int(column.shape[0]), column.sum(dim=0), (column * column).sum(dim=0))


def sums_from_json(value: Any, features: int | None = None) -> FeatureSums:
    """A node's sums as it sent them (``{"count", "sum", "sum_squares"}``), checked for form only: a count
    >= 1, two equally long lists of numbers (``features`` of them when given). Raises ``ValueError``."""
    if not isinstance(value, Mapping) or set(value) != {"count", "sum", "sum_squares"}:
        raise ValueError("the feature sums are not a mapping of count, sum and sum_squares")
    count = value["count"]
    if type(count) is not int or count < 1:
        raise ValueError(f"the feature sums' count is {count!r}, not a whole number >= 1")
    parts = []
    for key in ("sum", "sum_squares"):
        values = value[key]
        if not isinstance(values, list) or not 1 <= len(values) <= MAX_FEATURES or not all(
                type(v) in (int, float) for v in values):
            raise ValueError(f"the feature sums' {key} is not a list of 1 to {MAX_FEATURES} numbers")
        parts.append(torch.tensor(values, dtype=torch.float64))
    if parts[0].shape != parts[1].shape or (features is not None and parts[0].numel() != features):
        raise ValueError(f"the feature sums hold {parts[0].numel()} and {parts[1].numel()} values, not "
                         f"{features if features is not None else 'as many'} for each feature")
    return FeatureSums(count, parts[0], parts[1])


def sums_problem(sums: FeatureSums, size: int | None = None) -> str | None:
    """Why a site's sums cannot be rows' sums, or None: non-finite values, a sum of squares below zero or below
    what its sum implies (Cauchy-Schwarz: ``n * sum_squares >= sum**2``, up to rounding), or a count other than
    the training ``size`` the site declares."""
    if size is not None and sums.count != size:
        return f"its feature sums count {sums.count} rows but it declares {size} training rows"
    if not (bool(torch.isfinite(sums.sum).all()) and bool(torch.isfinite(sums.sum_squares).all())):
        return "its feature sums hold non-finite values"
    slack = 1e-9 * (sums.count * sums.sum_squares.abs() + sums.sum * sums.sum) + 1e-300
    short = sums.count * sums.sum_squares - sums.sum * sums.sum < -slack
    if bool((sums.sum_squares < 0).any()) or bool(short.any()):
        feature = int(torch.nonzero(short | (sums.sum_squares < 0))[0])
        return f"its feature sums are not those of any rows (feature {feature}: a sum of squares below its sum's)"
    return None


def moments(parts: Sequence[FeatureSums], weights: Sequence[float] | None = None) -> tuple[Tensor, Tensor, float]:
    """``(mean, variance, total weight)`` per feature of the rows of ``parts`` pooled, each part counting as
    its ``weight`` rows (default: its count). The population variance, never below 0."""
    weights = [float(p.count) for p in parts] if weights is None else [float(w) for w in weights]
    total = sum(weights)
    first = sum((w / p.count) * p.sum for p, w in zip(parts, weights)) / total
    second = sum((w / p.count) * p.sum_squares for p, w in zip(parts, weights)) / total
    assert isinstance(first, Tensor) and isinstance(second, Tensor)
    return first, (second - first * first).clamp(min=0.0), total


def constant(mean: Tensor, variance: Tensor, total: float) -> Tensor:
    """Which features are constant up to float64 rounding of the sums (scikit-learn's test for its
    ``StandardScaler``): their variance is no more than the error that summing ``total`` values leaves."""
    eps = torch.finfo(torch.float64).eps
    bound = total * eps * variance + (total * mean * eps) ** 2
    return variance <= bound


def scaling_of(mean: Tensor, variance: Tensor, total: float) -> Tensor:
    """The std that scales each feature: ``sqrt(variance)``, 1 for a constant feature (only centred)."""
    return torch.where(constant(mean, variance, total), torch.ones_like(variance), variance.sqrt())


def influence(parts: Mapping[str, FeatureSums], weights: Mapping[str, float]) -> dict[str, tuple[float, int]]:
    """For each site, ``(factor, feature)``: the most that the pooled std of one feature grows when that
    site's sums join the others' (pooled std with it / without it), and that feature. A feature the other
    sites hold constant is not counted (scaling their constant value moves nothing)."""
    names = list(parts)
    mean, variance, total = moments([parts[n] for n in names], [weights[n] for n in names])
    with_all = scaling_of(mean, variance, total)
    found = {}
    for name in names:
        others = [n for n in names if n != name]
        m, v, t = moments([parts[n] for n in others], [weights[n] for n in others])
        varying = ~constant(m, v, t)
        ratio = torch.where(varying, with_all / v.sqrt().clamp(min=1e-300), torch.ones_like(v))
        feature = int(torch.argmax(ratio))
        found[name] = (float(ratio[feature]), feature)
    return found


def shared_scaling(parts: Mapping[str, FeatureSums], weights: Mapping[str, float] | None = None,
                   limit: float = STATISTICS_LIMIT, columns: Sequence[str] | None = None) -> SharedScaling:
    """The shared ``mean`` and ``std`` of the sites' sums (``parts``, by site name), each site counting as
    its ``weights[name]`` rows (default its count); with three sites or more and ``limit > 0``, the sites
    whose sums make some feature's pooled std more than ``limit`` times what the others give alone are left
    out first (fewer than half of them: with more, the sites disagree and none is singled out; all are kept).
    ``columns``: the feature names, for the reasons given."""
    weights = {name: float(parts[name].count) for name in parts} if weights is None else dict(weights)
    left_out: dict[str, str] = {}
    if limit > 0 and len(parts) >= 3:
        flagged = {name: found for name, found in influence(parts, weights).items() if found[0] > limit}
        if len(flagged) < len(parts) / 2:
            for name, (factor, feature) in sorted(flagged.items()):
                what = f"{columns[feature]!r}" if columns is not None and feature < len(columns) else \
                    f"feature {feature}"
                left_out[name] = (f"its feature sums make the pooled std of {what} {_factor(factor)} times what the "
                                  f"other sites give (data.statistics_limit={limit:g})")
    kept = [name for name in parts if name not in left_out]
    mean, variance, total = moments([parts[n] for n in kept], [weights[n] for n in kept])
    return SharedScaling(mean, scaling_of(mean, variance, total), kept, left_out)


def _factor(factor: float) -> str:
    return f"{factor:.3g}" if math.isfinite(factor) and factor < 1e6 else f"{factor:.2e}"


def feature_ranges(low: Sequence[float] | None, high: Sequence[float] | None,
                   features: int | None = None) -> tuple[Tensor, Tensor] | None:
    """``(low, high)`` of ``data.feature_low`` / ``feature_high`` as float64, checked (both or neither, as long
    as each other and ``features``, every ``high > low``); None when not given. ConfigError otherwise."""
    if low is None and high is None:
        return None
    if low is None or high is None or len(low) != len(high) or not low:
        raise ConfigError("data.feature_low and data.feature_high go together, as two lists of one number per "
                          "feature")
    if features is not None and len(low) != features:
        raise ConfigError(f"data.feature_low and data.feature_high give {len(low)} features but the data has "
                          f"{features}; give one bound per feature, in the columns' order")
    bad = [j for j, (a, b) in enumerate(zip(low, high)) if not b > a]
    if bad:
        raise ConfigError(f"data.feature_high is not above data.feature_low for feature {bad[0]}; give each "
                          "feature a range it spans")
    return torch.tensor(list(low), dtype=torch.float64), torch.tensor(list(high), dtype=torch.float64)


def range_sums(x: Tensor, low: Tensor, high: Tensor) -> FeatureSums:
    """:func:`feature_sums` of ``u = clip((x - low) / (high - low), 0, 1)``: the features in units of their
    public range, each within [0, 1], so that a sum of ``n`` rows is within [0, n] (what SecAgg+ needs)."""
    u = ((x.detach().to(torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
    return feature_sums(u)


def packed_sums(sums: FeatureSums, weight: float, bound: float, clip: float) -> Tensor:
    """A site's range sums as the vector SecAgg+ adds up: ``clip / bound * [w, w mean(u), w mean(u^2)]`` with
    ``w`` the ``weight`` the server counts the site as (its size, bounded as a claim), each entry within
    ``[0, clip]`` while ``w <= bound`` (the largest weight). ValueError for a weight outside ``(0, bound]``."""
    if not 0 < weight <= bound:
        raise ValueError(f"the server counts this site as {weight:g} rows, outside (0, {bound:g}]")
    per_row = torch.cat([torch.ones(1, dtype=torch.float64), sums.sum / sums.count, sums.sum_squares / sums.count])
    return per_row * (weight * clip / bound)


def unpacked_scaling(total: Tensor, bound: float, clip: float, low: Tensor, high: Tensor,
                     tolerance: float) -> tuple[Tensor, Tensor, float]:
    """``(mean, std, weight)`` in the features' own units from the sum of :func:`packed_sums` vectors: the
    pooled mean and population std of the clipped features, each site counting as its weight, and the
    weights summed. ``tolerance``: how far each summed entry may be off, in weight units (quantization:
    ``K * 2 * bound / Q`` for ``K`` sites); a feature whose variance is within what that error makes is
    constant (std 1)."""
    values = total.to(torch.float64) * (bound / clip)
    features = (values.numel() - 1) // 2
    rows = float(values[0])
    mean_u = values[1:1 + features] / rows
    variance_u = (values[1 + features:] / rows - mean_u * mean_u).clamp(min=0.0)
    span = high - low
    mean, variance = low + span * mean_u, span * span * variance_u
    # a constant feature's variance is not 0 after quantization: within 4 x the entries' error over the rows
    flat = variance_u <= 4.0 * tolerance / max(rows, 1.0)
    return mean, torch.where(flat, torch.ones_like(variance), scaling_of(mean, variance, rows)), rows


__all__ = ["CLIENT", "FEDERATED", "FORMER_FEDERATED", "FeatureSums", "MAX_FEATURES", "NONE", "STANDARDIZE_CHOICES",
           "STATISTICS_LIMIT",
           "SharedScaling", "constant", "feature_ranges", "feature_sums", "influence", "moments", "packed_sums",
           "range_sums", "resolved_standardize", "scaling_of", "shared_scaling", "sums_from_json", "sums_problem",
           "unpacked_scaling"]
