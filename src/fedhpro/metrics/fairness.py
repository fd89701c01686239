"""Fairness of the accuracy across clients (the paper's Table A8, after Li et al., 2020c, q-FFL)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def fairness_statistics(accuracies: Sequence[float], fraction: float = 0.1) -> dict[str, float]:
    """Mean, worst 10 %, best 10 %, variance and standard deviation of per-client accuracies.

    ``worst_10`` is the mean of the ``ceil(fraction * n)`` lowest accuracies (at least one client),
    ``best_10`` the mean of as many highest ones; ``variance`` is the population variance
    (``ddof=0``, in squared accuracy units) and ``std`` its square root. Table A8 calls its last
    column "Variance"; its values (8-13 for accuracies spread over 36-79 %) are on the scale of a
    standard deviation, so reports print both.
    """
    values = np.sort(np.asarray(list(accuracies), dtype=np.float64))
    if values.size == 0:
        raise ValueError("fairness_statistics needs at least one client accuracy")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    count = max(1, math.ceil(fraction * values.size - 1e-9))
    return {
        "mean": float(values.mean()),
        "worst_10": float(values[:count].mean()),
        "best_10": float(values[-count:].mean()),
        "variance": float(values.var()),
        "std": float(values.std()),
    }
