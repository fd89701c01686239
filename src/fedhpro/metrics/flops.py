"""FLOPs with ``torch.utils.flop_counter`` (the paper's Table 4, FLOPs column).

:class:`FlopCounter` is a context manager that adds up the FLOPs of every ATen operation run
inside it, forward and backward (matrix products and convolutions; element-wise operations are
not counted, as in the usual FLOP tables). It only observes: the operations and their results
are the same with and without it.
"""

from __future__ import annotations

from torch.utils.flop_counter import FlopCounterMode


class FlopCounter:
    """``with FlopCounter() as counter: ...`` then ``counter.total`` (FLOPs, an int)."""

    def __init__(self) -> None:
        self._mode = FlopCounterMode(display=False)
        self.total = 0

    def __enter__(self) -> "FlopCounter":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self.total = int(self._mode.get_total_flops())
