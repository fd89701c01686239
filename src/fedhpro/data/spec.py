"""What a data set is to the registry (:data:`fedhpro.data.REGISTRY`): its own module, so that the data set
modules the registry imports never import the package that imports them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fedhpro.data.federation import Federation


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    options: type
    build: Callable[..., Federation]
    description: str = ""
    #: run settings this benchmark changes from the defaults (SUN397: participation 0.2); the user's win
    run_defaults: dict[str, Any] = field(default_factory=dict)
