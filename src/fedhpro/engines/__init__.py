"""Engines run methods: the in-process simulator (default) and, later, the Flower apps."""

from fedhpro.engines.simulator import Simulator, evaluate

__all__ = ["Simulator", "evaluate"]
