"""What a data set is to the registry (:data:`fedhpro.data.REGISTRY`): its own module, so that the data set
modules the registry imports never import the package that imports them. It imports no torch: a
:class:`DatasetDeclaration` (what a config reads of a data set: its name, its ``data.*`` options class, its
description and the run settings it changes) is known before the data set's code, which holds its
:class:`DatasetSpec` (the declaration with ``build`` and ``image_input``), is imported.

A data set also says how a new image becomes one of its inputs (:attr:`DatasetSpec.image_input`): written into a
run folder's model.json, it is what ``fedhpro predict`` applies to an image file, so predicting with a new data
set's model needs no code beyond its spec."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the type of what ``build`` returns; the federation's module imports torch
    from fedhpro.data.federation import Federation

#: ``(options, partition, size) -> description | None``: see :attr:`DatasetSpec.image_input`
ImageInput = Callable[[Any, Mapping[str, Any], int], "dict[str, Any] | None"]


@dataclass(frozen=True)
class DatasetDeclaration:
    """What a config reads of a data set without building it: ``dataset=name``, its ``data.*`` options class,
    its one-line description and the run settings it changes from the defaults (SUN397: participation 0.2; the
    user's win). Declared in a module that imports no torch; the data set's code makes its :class:`DatasetSpec`
    from it (:meth:`DatasetSpec.of`)."""

    name: str
    options: type
    description: str = ""
    run_defaults: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DatasetSpec:
    """A data set's code: its declaration's fields, ``build(options, clients, seed, data_dir=None,
    progress=False, partition=None) -> Federation`` and ``image_input``."""

    name: str
    options: type
    build: Callable[..., Federation]
    description: str = ""
    #: run settings this benchmark changes from the defaults (SUN397: participation 0.2); the user's win
    run_defaults: dict[str, Any] = field(default_factory=dict)
    #: optional ``(options, partition, size) -> description | None``: how a new image file becomes one of this
    #: data set's ``3 x size x size`` inputs (``options``: the run's ``data.*`` options; ``partition``: the run's
    #: partition.json record, ``{}`` when none), as model.json's ``input`` (:func:`half_range_image`,
    #: :func:`preset_image`); None (or no function): the inputs are tensors, given to predict as .pt/.npz files
    image_input: ImageInput | None = None

    @classmethod
    def of(cls, declaration: DatasetDeclaration, build: Callable[..., Federation],
           image_input: ImageInput | None = None) -> DatasetSpec:
        """The spec of the data set ``declaration`` declares: its fields, and the code given here."""
        return cls(declaration.name, declaration.options, build, declaration.description,
                   dict(declaration.run_defaults), image_input)

    @property
    def declaration(self) -> DatasetDeclaration:
        """What a config reads of this data set (:meth:`fedhpro.registry.Registry.declared` of one registered
        whole); its ``options`` is this spec's class itself."""
        return DatasetDeclaration(self.name, self.options, self.description, dict(self.run_defaults))


def half_range_image(dataset: str, size: int, resize: bool) -> dict[str, Any]:
    """An image input scaled from 0..255 to [-1, 1] (mean and std 0.5 per channel); ``resize``: any image is
    resized to ``size`` as in training, else only ``size x size`` images fit."""
    return {"kind": "image", "size": size, "mean": [0.5] * 3, "std": [0.5] * 3, "normalize": "half",
            "resize": resize, "dataset": dataset}


def preset_image(dataset: str, size: int, mean: Sequence[float], std: Sequence[float]) -> dict[str, Any]:
    """An image input of a paper benchmark: ``size x size`` images only, normalised per channel by ``mean``
    and ``std`` (of pixels in 0..1) as :func:`fedhpro.data.benchmarks.to_float` does."""
    return {"kind": "image", "size": size, "resize": False, "mean": list(mean), "std": list(std),
            "normalize": "preset", "dataset": dataset}

