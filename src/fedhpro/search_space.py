"""Search spaces of hyperparameters, declared next to the options they search (no Optuna here).

A method declares where ``fedhpro tune`` may look for each of its knobs with ``search=`` on the option
(:func:`fedhpro.options.option`)::

    mu: float = option(0.01, min=0.0, help="...", search=LogUniform(1e-4, 1.0))

The shared run keys a tuning searches for every method (``lr``, ``local_epochs``, ``max_grad_norm``) are
:data:`SHARED` (also ``fedhpro.tune.SHARED``). The classes only describe a range; :mod:`fedhpro.tune` turns them
into an optimiser's suggestions. :func:`searched` is every key a tuning of a method may set: what a tuned file
(``tuned.yaml``) may carry, and all it may carry.
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

#: the run keys every method's search covers (not options of a method); ``max_grad_norm``: off (0) or a cap of
#: 1 or 10, so a method whose loss explodes at a large lr (a cosine loss at a small temperature on small
#: features) can have that lr with a cap. ``lr`` ends at 0.1 (10x the default 0.01): above it, SGD with momentum
#: 0.9 and up to 5 local epochs diverges on the built-in digits federations (FedAvg at 0.2 goes NaN under label
#: skew and its features die at 0.1-0.3, FedSA diverges at 0.4-0.5, FedHPro without a cap at 0.1), while every
#: best lr this package's tuned comparison found lies below it (bench/RESULTS.md, tuning and divergence)
SHARED: dict[str, Space] = {"lr": LogUniform(1e-3, 0.1), "local_epochs": IntRange(1, 5),
                            "max_grad_norm": Categorical([0, 1, 10])}


def declared(options: type) -> dict[str, Space]:
    """``{field name: its space}`` of the fields of the options dataclass ``options`` that declare ``search=``."""
    return {f.name: f.metadata["search"] for f in dataclasses.fields(options)
            if f.metadata.get("search") is not None}


def searched(method: str, options: type) -> dict[str, Space]:
    """``{config key: space}`` of every key a tuning of ``method`` (whose options dataclass is ``options``) may
    search: :data:`SHARED` and its declared knobs as ``method.knob``."""
    own = declared(options) if options is not None else {}  # a method without options: the shared keys only
    return {**SHARED, **{f"{method}.{name}": knob for name, knob in own.items()}}


def contains(space: Space, value: Any) -> bool:
    """Whether ``value`` is one ``space`` can give (a number in its range, an integer on its steps, one of its
    choices)."""
    if isinstance(value, bool):
        return isinstance(space, Categorical) and any(value is choice for choice in space.choices)
    if isinstance(space, Categorical):
        return any(value == choice and type(value) is type(choice) for choice in space.choices)
    if isinstance(space, IntRange):
        return (isinstance(value, int) and space.low <= value <= space.high
                and (value - space.low) % space.step == 0)
    return isinstance(value, (int, float)) and space.low <= value <= space.high


def describe(space: Space) -> str:
    """A space in a few words, for the docs and the tune command's lines: ``log-uniform [0.001, 0.3]``."""
    if isinstance(space, LogUniform):
        return f"log-uniform [{space.low:g}, {space.high:g}]"
    if isinstance(space, Uniform):
        return f"uniform [{space.low:g}, {space.high:g}]"
    if isinstance(space, IntRange):
        return f"integer [{space.low}, {space.high}]" + (f" step {space.step}" if space.step > 1 else "")
    return "one of " + ", ".join(map(str, space.choices))
