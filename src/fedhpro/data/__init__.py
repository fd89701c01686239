"""Data sets and federations by name. Adding one is one new module of code plus a torch-free declaration
(a :class:`DatasetDeclaration`: its name, ``data.*`` options class, description and run settings) and one
``REGISTRY.declare`` line here (a paper benchmark: one line in
:data:`fedhpro.data.benchmark_options.BENCHMARK_DECLARATIONS` and its spec's line in
:mod:`fedhpro.data.benchmarks`), or, without editing the package, ``fedhpro.data.register(name, spec)`` from
Python or an installed package's entry point in the group ``fedhpro.datasets`` (``mine = "my_package:DATASET"``,
a :class:`DatasetSpec`, a zero-argument callable returning one, or a :class:`~fedhpro.registry.Declared` of a
declaration and the spec's ``"module:attr"``). ``dataset=<name>`` then works everywhere a config is read, and its
options dataclass gives the ``data.*`` keys (``fedhpro config --keys dataset=<name>``).

A data set entry is a :class:`DatasetSpec`: an options dataclass (the
``data.*`` config keys) and ``build(options, clients, seed, data_dir=None,
progress=False, partition=None)`` returning a
:class:`~fedhpro.data.federation.Federation`; ``partition`` is the
``partition.*`` section (:class:`~fedhpro.data.partition.PartitionOptions`).

This package imports no torch: :func:`declared_dataset` answers what a config reads of a data set from its
declaration; :func:`get_dataset` imports the data set's code (and torch) on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fedhpro.data import clients_options, digits_federation_options, huggingface_options, imagefolder_options
from fedhpro.data.benchmark_options import BENCHMARK_DECLARATIONS, code_attribute
from fedhpro.data.spec import DatasetDeclaration, DatasetSpec
from fedhpro.registry import Declared, Registry, checked_spec

if TYPE_CHECKING:
    from fedhpro.data.federation import Federation

#: public names whose modules import torch, imported on first use (``import fedhpro.data`` stays torch-free)
_LAZY = {"Federation": ("fedhpro.data.federation", "Federation")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _checked(name: str, loaded: object, where: str) -> DatasetSpec:
    """A data set entry from a :class:`DatasetSpec` or a zero-argument callable returning one; a one-line
    ConfigError saying what a data set must be otherwise."""
    return checked_spec(name, loaded, where, DatasetSpec, path="fedhpro.data.DatasetSpec",
                        give="DatasetSpec(name, options, build) (see fedhpro.data.digits_federation)",
                        keys="the data.* keys",
                        callables={"build": "callable (options, clients, seed, ...) -> Federation"})


def _declaration_of(spec: DatasetSpec) -> DatasetDeclaration:
    return spec.declaration


#: the entry-point group through which installed packages add data sets
ENTRY_POINT_GROUP = "fedhpro.datasets"

#: name -> its spec, declared (the declaration now, the code on first lookup) or registered whole
REGISTRY: Registry[DatasetSpec] = Registry(
    "data set", ENTRY_POINT_GROUP, key="dataset", check=_checked, declaration_of=_declaration_of,
    declaration_type=DatasetDeclaration,
    hint=f" (or add one with fedhpro.data.register or a package's {ENTRY_POINT_GROUP!r} entry point)")

REGISTRY.declare("digits-offline", digits_federation_options.DECLARATION, "fedhpro.data.digits_federation:DATASET")
# the paper's benchmarks on the real data sets (files: fedhpro.data.loaders)
for _name, _declaration in BENCHMARK_DECLARATIONS.items():
    REGISTRY.declare(_name, _declaration, f"fedhpro.data.benchmarks:{code_attribute(_name)}")
# your own data
REGISTRY.declare("clients", clients_options.DECLARATION, "fedhpro.data.clients:DATASET")
REGISTRY.declare("imagefolder", imagefolder_options.DECLARATION, "fedhpro.data.imagefolder:DATASET")
REGISTRY.declare("huggingface", huggingface_options.DECLARATION, "fedhpro.data.huggingface:DATASET")

#: the data sets as a live mapping name -> spec (the built-ins, registered, installed)
DATASETS: Registry[DatasetSpec] = REGISTRY


def register(name: str, spec: DatasetSpec | Callable[[], DatasetSpec] | Declared, *,
             replace: bool = False) -> DatasetSpec | Declared:
    """Add ``spec`` (or a zero-argument callable returning one, or a :class:`~fedhpro.registry.Declared` whose
    code is imported on first use) as ``dataset=name``; returns the spec (the Declared as given)."""
    return REGISTRY.register(name, spec, replace=replace)


def get_dataset(name: str) -> DatasetSpec:
    """The spec of data set ``name`` (its code imported); a one-line ConfigError for an unknown one (with the
    closest names)."""
    return REGISTRY.lookup(name)


def declared_dataset(name: str) -> DatasetDeclaration:
    """What a config reads of data set ``name`` (its options class, description, run settings) without
    importing its code, nor torch; the one-line ConfigError of :func:`get_dataset` for an unknown name."""
    return REGISTRY.declared(name)


def dataset_names() -> list[str]:
    """Every data set's name: the built-ins first, then those registered or installed."""
    return REGISTRY.names()


__all__ = ["DATASETS", "DatasetDeclaration", "DatasetSpec", "ENTRY_POINT_GROUP", "Federation", "REGISTRY",
           "dataset_names", "declared_dataset", "get_dataset", "register"]
