"""Engines run methods: the in-process simulator (default) and the Flower apps, both around one run lifecycle
(:mod:`fedhpro.engines.lifecycle`: rows, checkpoints, summary, result files; the :class:`Engine` protocol of
:mod:`fedhpro.engines.interface`)."""

from fedhpro.engines.client_tests import evaluate
from fedhpro.engines.interface import Engine
from fedhpro.engines.lifecycle import Run
from fedhpro.engines.simulator import Simulator

__all__ = ["Engine", "Run", "Simulator", "evaluate"]
