"""FLOPs with ``torch.utils.flop_counter``'s formulas (the paper's Table 4, FLOPs column).

:class:`FlopCounter` is a context manager that adds up the FLOPs of every ATen operation run
inside it, forward and backward (matrix products and convolutions; element-wise operations are
not counted, as in the usual FLOP tables). It only observes: the operations and their results
are the same with and without it.

It is a bare ``TorchDispatchMode`` over torch's ``flop_registry`` rather than
``FlopCounterMode`` itself: ``FlopCounterMode`` also tracks the module hierarchy with global
backward hooks, and those make ``torch.autograd.grad(..., inputs)`` fail ("A leaf node was
passed to _will_engine_execute_node"), which FedHPro's class gradients (Eq. 5) call.
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry


class _CountingMode(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.total += int(count(*args, **kwargs, out_val=out))
        return out


class FlopCounter:
    """``with FlopCounter() as counter: ...`` then ``counter.total`` (FLOPs, an int)."""

    def __init__(self) -> None:
        self._mode = _CountingMode()
        self.total = 0

    def __enter__(self) -> FlopCounter:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self.total = self._mode.total
