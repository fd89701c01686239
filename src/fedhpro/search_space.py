"""Search spaces of hyperparameters, declared next to the options they search (no Optuna here).

A method declares where ``fedhpro tune`` may look for each of its knobs with ``search=`` on the option
(:func:`fedhpro.options.option`)::

    mu: float = option(0.01, min=0.0, help="...", search=LogUniform(1e-4, 1.0))

The shared run keys a tuning searches for every method (``lr``, ``local_epochs``, ``max_grad_norm``) are
declared in :mod:`fedhpro.tune`. The classes only describe a range; :mod:`fedhpro.tune` turns them into an
optimiser's suggestions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LogUniform:
    """A float drawn uniformly on a log scale in ``[low, high]`` (both > 0): learning rates, weights."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if not 0 < self.low < self.high:
            raise ValueError(f"LogUniform needs 0 < low < high, got {self.low}, {self.high}")


@dataclass(frozen=True)
class Uniform:
    """A float drawn uniformly in ``[low, high]``."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if not self.low < self.high:
            raise ValueError(f"Uniform needs low < high, got {self.low}, {self.high}")


@dataclass(frozen=True)
class IntRange:
    """An integer in ``[low, high]`` (inclusive), every ``step``-th."""

    low: int
    high: int
    step: int = 1

    def __post_init__(self) -> None:
        if not self.low < self.high or self.step < 1:
            raise ValueError(f"IntRange needs low < high and step >= 1, got {self.low}, {self.high}, {self.step}")


@dataclass(frozen=True)
class Categorical:
    """One of ``choices`` (numbers, strings or booleans)."""

    choices: tuple[Any, ...]

    def __init__(self, choices: Sequence[Any]) -> None:
        if len(choices) < 2:
            raise ValueError("Categorical needs at least two choices")
        object.__setattr__(self, "choices", tuple(choices))


Space = LogUniform | Uniform | IntRange | Categorical
SPACES = (LogUniform, Uniform, IntRange, Categorical)


def declared(options: type) -> dict[str, Space]:
    """``{field name: its space}`` of the fields of the options dataclass ``options`` that declare ``search=``."""
    return {f.name: f.metadata["search"] for f in dataclasses.fields(options)
            if f.metadata.get("search") is not None}


def describe(space: Space) -> str:
    """A space in a few words, for the docs and the tune command's lines: ``log-uniform [0.001, 0.3]``."""
    if isinstance(space, LogUniform):
        return f"log-uniform [{space.low:g}, {space.high:g}]"
    if isinstance(space, Uniform):
        return f"uniform [{space.low:g}, {space.high:g}]"
    if isinstance(space, IntRange):
        return f"integer [{space.low}, {space.high}]" + (f" step {space.step}" if space.step > 1 else "")
    return "one of " + ", ".join(map(str, space.choices))
