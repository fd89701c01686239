"""The running weighted sum an engine folds the clients' weights into as their replies arrive.

:class:`WeightedSum` holds state (a sum, a total, a count), so it lives here rather than among the pure
equations of :mod:`fedhpro.functional`, whose :func:`~fedhpro.functional.weighted_average` (Eq. 1) folds a
list with this same code.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


class WeightedSum:
    """The global aggregation of Algorithm 1 (Eq. 1), folded one state at a time.

    ``add(w_k, n_k)`` adds ``n_k * w_k`` to a running sum of each floating-point
    entry (in arrival order, in the entry's dtype); :meth:`result` returns
    ``w* = sum_k n_k w_k / N`` with ``N = sum_k n_k``. Integer entries
    (``num_batches_tracked``) are counters, not parameters: the largest one is
    kept. Memory is one state's worth whatever the number of states, so an
    engine can fold each client's weights as the reply arrives instead of
    holding every client's copy until the end of the round.
    :func:`fedhpro.functional.weighted_average` folds a list with this same code, so a list and a
    stream in the same order give bit-identical results.
    """

    def __init__(self) -> None:
        self._sums: dict[str, Tensor] | None = None
        self.total = 0.0  # N = sum of the weights added
        self.count = 0  # number of states added

    def add(self, state: Mapping[str, Tensor], weight: float) -> None:
        """Fold one state (the keys and shapes of the first one) with weight ``n_k``; the state is not kept."""
        weight = float(weight)
        with torch.no_grad():
            if self._sums is None:
                # new tensors: a product (floating) or a copy (integer), never the input's storage
                self._sums = {key: torch.mul(value, weight) if _averaged(value) else value.detach().clone()
                              for key, value in state.items()}
            else:
                for key, total in self._sums.items():
                    value = state[key]
                    if _averaged(total):
                        total.add_(value.detach().to(total.dtype), alpha=weight)
                    else:
                        torch.maximum(total, value.detach().to(total.dtype), out=total)
        self.total += weight
        self.count += 1

    def result(self) -> dict[str, Tensor]:
        """``sum_k n_k w_k / N`` per floating entry, the max per integer entry: new tensors (the sums are kept).

        Raises ValueError when no state was added or the total weight is not positive.
        """
        if self._sums is None:
            raise ValueError("weighted_average needs at least one state")
        if not self.total > 0:
            raise ValueError("weighted_average needs a positive total weight")
        with torch.no_grad():
            return {key: total / self.total if _averaged(total) else total.clone() for key, total in self._sums.items()}


def _averaged(value: Tensor) -> bool:
    """Whether an entry is averaged (floating or complex) rather than kept as the max (integer counters)."""
    return value.is_floating_point() or value.is_complex()
