"""Engines run methods: the in-process simulator (default) and the Flower apps, both around one run driver
(:mod:`fedhpro.engines.driver`: rows, checkpoints, summary, result files; the :class:`Engine` protocol)."""

from fedhpro.engines.client_tests import evaluate
from fedhpro.engines.driver import Engine, Run
from fedhpro.engines.simulator import Simulator

__all__ = ["Engine", "Run", "Simulator", "evaluate"]
