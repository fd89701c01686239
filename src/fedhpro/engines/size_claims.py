"""Where a deployment's sizes are claims (no roster pins them): the line said at start (:func:`claims_line`),
the warnings naming a site that claims far more than the median or holds too much of a pooled test set, and
summary.json's ``size_claims`` block (:func:`size_claims`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fedhpro.aggregation import lower_median
from fedhpro.config import AggregationOptions
from fedhpro.engines.protocol import RoundProtocol
from fedhpro.engines.replies import weight_cap


def pooled_share_warnings(test_sizes: Sequence[tuple[str, int]], max_share: float) -> list[str]:
    """One warning line per client holding more than ``max_share`` (``aggregation.max_share``) of the test
    samples pooled for its test set, whose pooled accuracy (and so AVG) then leans on that one client.
    ``test_sizes[k]``: client ``k``'s ``(test-set name, size)``, for the clients whose test counts are pooled
    (a test size is what a client declares). A test set only one client is tested on pools nothing: left out."""
    totals: dict[str, int] = {}
    holders: dict[str, int] = {}
    for name, size in test_sizes:
        totals[name] = totals.get(name, 0) + int(size)
        holders[name] = holders.get(name, 0) + (int(size) > 0)
    lines = []
    for k, (name, size) in enumerate(test_sizes):
        total = totals[name]
        if holders[name] < 2 or int(size) <= max_share * total:
            continue
        lines.append(f"client {k} holds {int(size)} of the {total} test samples of test set {name!r} "
                     f"({100.0 * int(size) / total:.1f}%), more than aggregation.max_share={max_share:g}: the pooled "
                     f"accuracy of {name!r} leans on that one client; compare summary.json's site_accuracy (each "
                     "client's accuracy, their unweighted mean and median)")
    return lines


#: a site whose claimed size is more than this many times the median site's is named in a warning at start,
#: whether or not a bound caps it: a claim just under a cap buys the most a bound allows and would otherwise
#: leave no trace (the default aggregation.max_ratio, 2, caps claims above twice the median)
FAR_ABOVE_MEDIAN = 1.5


def claims_line(aggregation: AggregationOptions) -> str:
    """The line a deployment without a roster says at start: its sizes are claims, what bounds them, how to
    pin them."""
    bound = (f"each site counts as at most aggregation.max_ratio={aggregation.max_ratio:g} x the median site's "
             "size and " if aggregation.max_ratio > 0 else "")
    return (f"sizes are claims: without flower.roster the training and test sizes the nodes declare are trusted: "
            f"{bound}at most aggregation.max_share={aggregation.max_share:g} of the total; to pin each site's name, "
            "sizes and key, give flower.roster=<file> (see the deployment guide)")


def claimed_size_warnings(names: Sequence[str], sizes: Sequence[int], what: str,
                          aggregation: AggregationOptions) -> list[str]:
    """One warning line per site whose claimed ``sizes`` (``what``: "training samples", ...) is more than
    :data:`FAR_ABOVE_MEDIAN` times the median claim (:func:`~fedhpro.aggregation.lower_median`), saying what it
    counts as under the run's bounds (:func:`~fedhpro.engines.replies.weight_cap` of claimed sizes). Fewer than
    two sites: none."""
    if sum(int(n) > 0 for n in sizes) < 2:
        return []
    median = lower_median(sizes)
    cap = weight_cap(aggregation, sizes, claimed=True)
    lines = []
    for name, size in zip(names, sizes):
        if int(size) > FAR_ABOVE_MEDIAN * median:
            counts = (f"it counts as {max(1, math.floor(cap))}" if size > cap
                      else "under the bounds, it counts in full")
            lines.append(f"site {name!r} claims {int(size)} {what}, {size / median:.1f}x the median site's "
                         f"{median:g}: {counts}; if that size is right, vouch for it in flower.roster")
    return lines


def size_claims(protocol: RoundProtocol, test_sizes: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """summary.json's ``size_claims`` of a run whose sizes are claims: the bounds, the most weight a site's
    training claim buys (None: no cap binds) and, per test set, the most test samples a site's claim counts
    as in the pooled accuracy."""
    aggregation = protocol.aggregation
    by_set: dict[str, list[int]] = {}
    for name, size in test_sizes:
        by_set.setdefault(name, []).append(int(size))
    train_cap = protocol.weight_cap()
    test_caps = {name: weight_cap(aggregation, sizes, claimed=True) for name, sizes in by_set.items()}
    return {"max_ratio": aggregation.max_ratio, "max_share": aggregation.max_share,
            "train_cap": math.floor(train_cap) if math.isfinite(train_cap) else None,
            "test_caps": {name: math.floor(cap) if math.isfinite(cap) else None for name, cap in test_caps.items()}}
