"""Robust aggregation rules, as pure tensor functions (the ``aggregation=`` setting).

A federated mean lets one client move the global model as far as it likes:
a reply of ``w_global + 100 * Delta`` drags the average by ``100 * Delta / K``.
The rules here bound what one client can do:

* :func:`coordinate_median`: each coordinate's median over the ``K`` clients
  (for even ``K`` the mean of the two middle values), so fewer than half the
  clients cannot move a coordinate outside the honest clients' range;
* :func:`trimmed_mean`: each coordinate's mean after dropping the
  ``floor(beta * K)`` smallest and largest values;
* :func:`clip_factor` / :func:`clip_update`: the update ``Delta = w_k - w_global``
  of one client, over all its floating-point tensors together, scaled down to a
  global L2 norm of at most ``max_norm`` (``min(1, max_norm / ||Delta||)``).
* :func:`share_cap`: the largest weight one client may hold so that no client
  holds more than ``max_share`` of the total (``aggregation.max_share``): what a
  client *says* it holds (its sample and test counts) is a claim, and this
  bounds what a claim can buy under every rule, the plain mean included;
* :func:`claim_cap`: that cap, and where sizes are claims nobody vouches for,
  at most ``max_ratio`` times the median claim (``aggregation.max_ratio``), a
  bound that falls with the number of clients where a share cannot.

The first three weight the clients equally (a client's ``num_examples`` is what it
says it has, so a hostile client could claim a large weight); integer tensors
(BatchNorm's ``num_batches_tracked``) are counters, not parameters, and are
left to the caller. :mod:`fedhpro.engines.protocol` applies them to a round's
replies for every method.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

#: the values of ``aggregation=`` (``aggregation.rule``), each with what it needs of each client's own
#: update ("": nothing, the replies reach the method as they came)
AGGREGATION_RULES: dict[str, str] = {"mean": "", "median": "a coordinate-wise median",
                                     "trimmed-mean": "a trimmed mean", "norm-clip": "each update's norm"}


def _stacked(tensors: Sequence[Tensor]) -> Tensor:
    if len(tensors) == 0:
        raise ValueError("a robust aggregate needs at least one tensor")
    return torch.stack([t.detach() for t in tensors])


def coordinate_median(tensors: Sequence[Tensor]) -> Tensor:
    """The coordinate-wise median of ``K`` tensors of one shape: a new tensor of that shape.

    With an even ``K`` each coordinate is the mean of its two middle values (the
    usual median, not ``torch.median``'s lower one), so the median of two
    tensors is their mean.
    """
    ordered = _stacked(tensors).sort(dim=0).values
    count = ordered.shape[0]
    if count % 2 == 1:
        return ordered[count // 2].clone()
    return (ordered[count // 2 - 1] + ordered[count // 2]) / 2


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
    ordered = _stacked(tensors).sort(dim=0).values
    cut = trimmed_count(ordered.shape[0], beta)
    return ordered[cut:ordered.shape[0] - cut].mean(dim=0)


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
    clipped = {}
    for name, value in weights.items():
        if value.is_floating_point():
            base = reference[name].detach().to(device=value.device, dtype=value.dtype)
            clipped[name] = base + factor * (value.detach() - base)
        else:
            clipped[name] = value
    return clipped, factor


def share_cap(sizes: Sequence[float], max_share: float) -> float:
    """The cap ``c`` of water-filling: the largest weight such that, with every size replaced by
    ``min(size, c)``, no capped size exceeds ``max_share`` of their sum, i.e. the solution of
    ``c = max_share * sum_k min(n_k, c)``; ``inf`` when no size needs a cap (the largest is at most
    ``max_share`` of the total, or ``max_share >= 1``).

    When ``max_share * K <= 1`` no positive cap can keep every share at ``max_share`` (``K`` equal
    weights are ``1/K`` each); the cap is then the smallest size: every client weighs the same.
    Sizes <= 0 hold no weight and are left out."""
    values = sorted((float(n) for n in sizes if n > 0), reverse=True)
    if not values or max_share >= 1.0:
        return math.inf
    total = sum(values)
    if values[0] <= max_share * total:
        return math.inf
    if max_share * len(values) <= 1.0:
        return values[-1]
    rest = total
    for capped, largest in enumerate(values[:-1], start=1):
        rest -= largest  # the sizes below the ``capped`` largest, which keep their own weight
        cap = max_share * rest / (1.0 - capped * max_share) if capped * max_share < 1.0 else math.inf
        if values[capped] <= cap <= largest:
            return cap
    return values[-1]  # not reached for max_share * K > 1 (the last step gives a cap >= the smallest)


def lower_median(sizes: Sequence[float]) -> float:
    """The lower median of the positive ``sizes`` (the middle one; of an even count the smaller of the two
    middle ones): one client's claim cannot move it above the largest of the others' claims (nan for none)."""
    values = sorted(float(n) for n in sizes if n > 0)
    return values[(len(values) - 1) // 2] if values else math.nan


def claim_cap(sizes: Sequence[float], max_share: float, max_ratio: float = 0.0) -> float:
    """The most weight one of the clients of ``sizes`` may hold: :func:`share_cap` at ``max_share`` and, with
    ``max_ratio > 0``, at most ``max_ratio`` times :func:`lower_median` of the sizes.

    The share cap alone is an absolute share: among ``K`` sites of equal size a client claiming a huge size
    keeps ``max_share`` of the weight however large ``K`` is (3/4 at the default, 7.5 times its fair share at
    ``K = 10``). Bounded by the median claim, it weighs at most as ``max_ratio`` sites of the median size: a
    share of ``r / (r + K - 1)`` among ``K`` equal sites, which falls with ``K``. ``inf`` when nothing binds."""
    cap = share_cap(sizes, max_share)
    if max_ratio > 0:
        median = lower_median(sizes)
        if math.isfinite(median) and max(sizes, default=0) > max_ratio * median:
            cap = min(cap, max_ratio * median)
    return cap

