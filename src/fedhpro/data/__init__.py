"""Data sets and federations by name. Adding one is one new module plus one ``REGISTRY.builtin`` line here
(a paper benchmark: one line in :data:`fedhpro.data.benchmarks.BENCHMARKS`), or, without editing the
package, ``fedhpro.data.register(name, spec)`` from Python or an installed package's entry point in the group
``fedhpro.datasets`` (``mine = "my_package:DATASET"``, a :class:`DatasetSpec` or a zero-argument callable
returning one). ``dataset=<name>`` then works everywhere a config is read, and its options dataclass gives
the ``data.*`` keys (``fedhpro config --keys dataset=<name>``).

A data set entry is a :class:`DatasetSpec`: an options dataclass (the
``data.*`` config keys) and ``build(options, clients, seed, data_dir=None,
progress=False, partition=None)`` returning a
:class:`~fedhpro.data.federation.Federation`; ``partition`` is the
``partition.*`` section (:class:`~fedhpro.data.partition.PartitionOptions`).
"""

from __future__ import annotations

from collections.abc import Callable

from fedhpro.data.federation import Federation
from fedhpro.data.spec import DatasetSpec
from fedhpro.registry import Registry, checked_spec


def _digits_offline() -> DatasetSpec:
    from fedhpro.data.digits_federation import DATASET

    return DATASET


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


def _checked(name: str, loaded: object, where: str) -> Callable[[], DatasetSpec]:
    """A data set entry (a factory of its spec) from a :class:`DatasetSpec` or a zero-argument callable
    returning one; a one-line ConfigError saying what a data set must be otherwise."""
    spec = checked_spec(name, loaded, where, DatasetSpec, path="fedhpro.data.DatasetSpec",
                        give="DatasetSpec(name, options, build) (see fedhpro.data.digits_federation)",
                        keys="the data.* keys",
                        callables={"build": "callable (options, clients, seed, ...) -> Federation"})
    return lambda: spec


#: the entry-point group through which installed packages add data sets
ENTRY_POINT_GROUP = "fedhpro.datasets"

#: name -> factory of its spec (imported lazily: building one data set never imports another's code)
REGISTRY: Registry[Callable[[], DatasetSpec]] = Registry(
    "data set", ENTRY_POINT_GROUP, key="dataset", check=_checked,
    hint=f" (or add one with fedhpro.data.register or a package's {ENTRY_POINT_GROUP!r} entry point)")

REGISTRY.builtin("digits-offline", _digits_offline)
# the paper's benchmarks on the real data sets: every entry of fedhpro.data.benchmarks.BENCHMARKS (files:
# fedhpro.data.loaders); their specs are built on first use
from fedhpro.data.benchmarks import BENCHMARKS  # noqa: E402 (after the registry it fills)

for _name in BENCHMARKS:
    REGISTRY.builtin(_name, _benchmark(_name))
# your own data (fedhpro.data.clients, .imagefolder, .huggingface)
REGISTRY.builtin("clients", lambda: _own("clients"))
REGISTRY.builtin("imagefolder", lambda: _own("imagefolder"))
REGISTRY.builtin("huggingface", lambda: _own("huggingface"))

#: the data sets as a live mapping name -> factory of its spec (the built-ins, registered, installed)
DATASETS: Registry[Callable[[], DatasetSpec]] = REGISTRY


def register(name: str, spec: DatasetSpec | Callable[[], DatasetSpec], *, replace: bool = False) -> DatasetSpec:
    """Add ``spec`` (or a zero-argument callable returning one) as ``dataset=name``; returns the spec."""
    return REGISTRY.register(name, spec, replace=replace)()


def get_dataset(name: str) -> DatasetSpec:
    """The spec of data set ``name``; a one-line ConfigError for an unknown one (with the closest names)."""
    return REGISTRY.lookup(name)()


def dataset_names() -> list[str]:
    """Every data set's name: the built-ins first, then those registered or installed."""
    return REGISTRY.names()


__all__ = ["DATASETS", "DatasetSpec", "ENTRY_POINT_GROUP", "Federation", "REGISTRY", "dataset_names", "get_dataset",
           "register"]
