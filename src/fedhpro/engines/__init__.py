"""Engines run methods: the in-process simulator (default) and the Flower apps, both around one run lifecycle
(:mod:`fedhpro.engines.lifecycle`: rows, checkpoints, summary, result files; the :class:`Engine` protocol of
:mod:`fedhpro.engines.interface`).

The names below are imported on first use: the package also holds torch-free option declarations
(:mod:`fedhpro.engines.fault_options`), which ``fedhpro config`` reads without loading torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedhpro.engines.client_tests import evaluate
    from fedhpro.engines.interface import Engine
    from fedhpro.engines.lifecycle import Run
    from fedhpro.engines.simulator import Simulator

#: name -> the module that defines it
_LAZY = {"Engine": "fedhpro.engines.interface", "Run": "fedhpro.engines.lifecycle",
         "Simulator": "fedhpro.engines.simulator", "evaluate": "fedhpro.engines.client_tests"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fedhpro.engines' has no attribute {name!r}")


__all__ = ["Engine", "Run", "Simulator", "evaluate"]
