"""Data sets and federations by name. Adding one is one new module plus one line in ``DATASETS``.

A data set entry is a :class:`DatasetSpec`: an options dataclass (the
``data.*`` config keys) and ``build(options, clients, seed, data_dir)``
returning a :class:`~fedhpro.data.federation.Federation`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fedhpro.data.federation import Federation


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    options: type
    build: Callable[..., Federation]
    description: str = ""


def _digits_offline() -> DatasetSpec:
    from fedhpro.data import digits_federation

    return digits_federation.DATASET


#: name -> factory of its spec (imported lazily: building one data set never imports another's code)
DATASETS: dict[str, Callable[[], DatasetSpec]] = {
    "digits-offline": _digits_offline,
}


def get_dataset(name: str) -> DatasetSpec:
    return DATASETS[name]()


__all__ = ["DATASETS", "DatasetSpec", "Federation", "get_dataset"]
