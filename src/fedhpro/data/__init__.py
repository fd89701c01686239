"""Data sets and federations by name. Adding one is one new module plus one line in ``DATASETS``.

A data set entry is a :class:`DatasetSpec`: an options dataclass (the
``data.*`` config keys) and ``build(options, clients, seed, data_dir=None,
progress=False, partition=None)`` returning a
:class:`~fedhpro.data.federation.Federation`; ``partition`` is the
``partition.*`` section (:class:`~fedhpro.data.partition.PartitionOptions`).
"""

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


def _digits_offline() -> DatasetSpec:
    from fedhpro.data import digits_federation

    return digits_federation.DATASET


#: name -> factory of its spec (imported lazily: building one data set never imports another's code)
def _benchmark(name: str) -> Callable[[], DatasetSpec]:
    def factory() -> DatasetSpec:
        from fedhpro.data.benchmarks import BENCHMARKS

        return BENCHMARKS[name]()

    return factory


def _own(module: str) -> DatasetSpec:
    """The spec of ``fedhpro.data.<module>`` (a data set of the user's own files)."""
    import importlib

    return importlib.import_module(f"fedhpro.data.{module}").DATASET


DATASETS: dict[str, Callable[[], DatasetSpec]] = {
    "digits-offline": _digits_offline,
    # the paper's benchmarks on the real data sets (fedhpro.data.benchmarks; files: fedhpro.data.loaders)
    "digits": _benchmark("digits"),
    "office-caltech": _benchmark("office-caltech"),
    "cifar10": _benchmark("cifar10"),
    "cifar100": _benchmark("cifar100"),
    "ham10000": _benchmark("ham10000"),
    "tinyimagenet": _benchmark("tinyimagenet"),
    "cifar10-lt": _benchmark("cifar10-lt"),
    "cifar100-lt": _benchmark("cifar100-lt"),
    "tinyimagenet-lt": _benchmark("tinyimagenet-lt"),
    "ag-news": _benchmark("ag-news"),
    "sun397": _benchmark("sun397"),
    # your own data (fedhpro.data.clients, .imagefolder, .huggingface)
    "clients": lambda: _own("clients"),
    "imagefolder": lambda: _own("imagefolder"),
    "huggingface": lambda: _own("huggingface"),
}


def get_dataset(name: str) -> DatasetSpec:
    return DATASETS[name]()


__all__ = ["DATASETS", "DatasetSpec", "Federation", "get_dataset"]
