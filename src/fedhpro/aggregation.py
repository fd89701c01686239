"""The pure tensor rules of aggregation (the ``aggregation=`` setting and the weight caps).

A federated mean lets one client move the global model as far as it likes:
a reply of ``w_global + 100 * Delta`` drags the average by ``100 * Delta / K``.
The robust rules bound what one client's update can do; each is one class in
:mod:`fedhpro.robust` (registered by name in :data:`fedhpro.robust.REGISTRY`),
and their pure tensor functions are importable from here too:

* :func:`coordinate_median`: each coordinate's median over the ``K`` clients
  (for even ``K`` the mean of the two middle values), so fewer than half the
  clients cannot move a coordinate outside the honest clients' range;
* :func:`trimmed_mean`: each coordinate's mean after dropping the
  ``floor(beta * K)`` smallest and largest values;
* :func:`clip_factor` / :func:`clip_update`: the update ``Delta = w_k - w_global``
  of one client, over all its floating-point tensors together, scaled down to a
  global L2 norm of at most ``max_norm`` (``min(1, max_norm / ||Delta||)``);
* :func:`krum_scores` / :func:`krum_choice`: Krum (Blanchard et al. 2017), the
  update whose summed squared distance to its ``K - f - 2`` nearest others is
  the smallest.

The weight caps live here (what a client *says* it holds is a claim):

* :func:`share_cap`: the largest weight one client may hold so that no client
  holds more than ``max_share`` of the total (``aggregation.max_share``): what a
  client *says* it holds (its sample and test counts) is a claim, and this
  bounds what a claim can buy under every rule, the plain mean included;
* :func:`claim_cap`: that cap, and where sizes are claims nobody vouches for,
  at most ``max_ratio`` times the median claim (``aggregation.max_ratio``), a
  bound that falls with the number of clients where a share cannot.

The robust rules weight the clients equally (a client's ``num_examples`` is what it
says it has, so a hostile client could claim a large weight); integer tensors
(BatchNorm's ``num_batches_tracked``) are counters, not parameters, and are
left to the caller. :mod:`fedhpro.engines.robust` applies the chosen rule to a
round's replies for every method.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fedhpro.robust import AGGREGATION_RULES
from fedhpro.robust.krum import krum_choice, krum_scores
from fedhpro.robust.median import coordinate_median
from fedhpro.robust.norm_clip import clip_factor, clip_update, update_norm
from fedhpro.robust.trimmed_mean import trimmed_count, trimmed_mean


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



__all__ = ["AGGREGATION_RULES", "claim_cap", "clip_factor", "clip_update", "coordinate_median", "krum_choice",
           "krum_scores", "lower_median", "share_cap", "trimmed_count", "trimmed_mean", "update_norm"]
