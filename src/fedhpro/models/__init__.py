"""Model zoo: every model exposes ``features(x) -> z`` (B x d) and ``classifier`` (an ``nn.Linear(d, C)``),
with ``forward(x) == classifier(features(x))`` and attributes ``feature_dim`` / ``num_classes``.

Adding a model is one new file plus one ``REGISTRY.declare`` line here (its :class:`ModelDeclaration`: the
inputs it takes and a description, and its constructor's ``"module:attr"``, imported on first use), or, without
editing the package, ``fedhpro.models.register(name, constructor)`` or an installed package's entry point in the
group ``fedhpro.models`` (``mine = "my_package:build"``); ``model=<name>`` then works everywhere. This package
imports no torch until a model's code is asked for (:func:`build_model`, ``MODELS[name]``, a class by name).
:func:`with_projection_head` adds the MOON
authors' projection head to any of them (the run key ``projection_head=true``). Constructors take
``(num_classes, input_shape, feature_dim=512, **options)``; image models take
``input_shape = (C, H, W)``, ``textcnn`` takes ``(L,)`` (LongTensor token ids), ``mlp`` any float shape
(flattened; ``(F,)`` for tabular features).
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fedhpro.errors import ConfigError
from fedhpro.models.declaration import INPUT_KINDS, ModelDeclaration
from fedhpro.models.heterogeneity import HTFE, architecture_for_client
from fedhpro.models.shapes import check_image_shape, check_token_shape
from fedhpro.registry import Declared, Registry

if TYPE_CHECKING:
    from torch import nn

    from fedhpro.models.cnn import CNN4, FedAvgCNN
    from fedhpro.models.googlenet import GoogLeNetFE
    from fedhpro.models.mobilenet import MobileNetV2FE
    from fedhpro.models.projection import ProjectionHeadNet, with_projection_head
    from fedhpro.models.resnet import ResNetFE
    from fedhpro.models.split import SplitModel, split
    from fedhpro.models.textcnn import TextCNN

#: public names whose modules import torch (and torchvision), imported on first use (``import fedhpro.models``
#: stays torch-free): name -> its module
_LAZY = {"FedAvgCNN": "cnn", "CNN4": "cnn", "ResNetFE": "resnet", "MobileNetV2FE": "mobilenet",
         "GoogLeNetFE": "googlenet", "TextCNN": "textcnn", "MLP": "mlp", "resnet10_authors": "authors_resnet",
         "split": "split", "SplitModel": "split", "with_projection_head": "projection",
         "ProjectionHeadNet": "projection"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"fedhpro.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """This package, whose name ``split`` is the function :func:`fedhpro.models.split.split`: importing the module
    of the same name binds the name to the module, which a lazy name would otherwise never override."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "split" and isinstance(value, types.ModuleType):
            value = value.split
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def _checked(name: str, loaded: object, where: str) -> Callable[..., nn.Module]:
    if not callable(loaded):
        raise ConfigError(f"{where} gives a {type(loaded).__name__}, not a model constructor "
                          "(num_classes, input_shape, feature_dim, **options) -> nn.Module")
    kind = getattr(loaded, "input_kind", "image")
    if kind not in INPUT_KINDS:
        raise ConfigError(f"{where} gives a constructor whose input_kind is {kind!r}; set it to one of "
                          f"{', '.join(INPUT_KINDS)}")
    return loaded


def _declaration_of(constructor: Callable[..., nn.Module]) -> ModelDeclaration:
    """What :meth:`Registry.declared` answers for a constructor registered whole: its ``input_kind`` (default
    ``image``) and the first line of its docstring."""
    doc = (getattr(constructor, "__doc__", None) or "").strip()
    return ModelDeclaration(getattr(constructor, "input_kind", "image"), doc.splitlines()[0] if doc else "")


#: the entry-point group through which installed packages add models
ENTRY_POINT_GROUP = "fedhpro.models"

#: name -> constructor(num_classes, input_shape, feature_dim, **options): a live mapping (built-ins first; each
#: built-in declared: its :class:`ModelDeclaration` now, its code on first lookup)
REGISTRY: Registry[Callable[..., nn.Module]] = Registry(
    "model", ENTRY_POINT_GROUP, key="model", check=_checked, declaration_of=_declaration_of,
    declaration_type=ModelDeclaration,
    hint=f" (or add one with fedhpro.models.register or a package's {ENTRY_POINT_GROUP!r} entry point)")

_IMAGE = "image"
REGISTRY.declare("cnn", ModelDeclaration(_IMAGE, "FedAvgCNN: two 5x5 convolutions and a linear layer to d "
                                                 "(McMahan et al. 2017)"), "fedhpro.models.cnn:FedAvgCNN")
REGISTRY.declare("cnn4", ModelDeclaration(_IMAGE, "the paper's 4-layer CNN of the HtFE lists (FedAvgCNN)"),
                 "fedhpro.models.cnn:CNN4")
for _depth in (10, 18, 34, 50, 101):
    REGISTRY.declare(f"resnet{_depth}", ModelDeclaration(_IMAGE, f"ResNet-{_depth}: a torchvision ResNet trunk, "
                                                                 "projected to d"),
                     f"fedhpro.models.resnet:resnet{_depth}")
REGISTRY.declare("resnet10-authors", ModelDeclaration(_IMAGE, "the ResNet-10 of the FedHPro authors' code"),
                 "fedhpro.models.authors_resnet:resnet10_authors")
REGISTRY.declare("mobilenetv2", ModelDeclaration(_IMAGE, "MobileNetV2: torchvision's trunk, projected to d"),
                 "fedhpro.models.mobilenet:MobileNetV2FE")
REGISTRY.declare("googlenet", ModelDeclaration(_IMAGE, "GoogLeNet (Inception v1): torchvision's trunk, projected "
                                                       "to d"), "fedhpro.models.googlenet:GoogLeNetFE")
REGISTRY.declare("textcnn", ModelDeclaration("tokens", "TextCNN for token-id sequences (the paper's AG News "
                                                       "model)"), "fedhpro.models.textcnn:TextCNN")
REGISTRY.declare("mlp", ModelDeclaration("any", "a small fully connected network for features of any shape "
                                                "(flattened)"), "fedhpro.models.mlp:MLP")

MODELS: Registry[Callable[..., nn.Module]] = REGISTRY


def register(name: str, constructor: Callable[..., nn.Module] | Declared, *, replace: bool = False
             ) -> Callable[..., nn.Module] | Declared:
    """Add ``constructor`` as ``model=name`` (``input_kind`` attribute: "image" (default), "tokens" or "any"),
    or a :class:`~fedhpro.registry.Declared` of a :class:`ModelDeclaration` and the constructor's
    ``"module:attr"`` (imported on first use)."""
    return REGISTRY.register(name, constructor, replace=replace)


def declared_model(name: str) -> ModelDeclaration:
    """What model ``name`` takes, without importing its code (nor torch); the registry's one-line ConfigError
    for an unknown name."""
    return REGISTRY.declared(name)


def model_names() -> list[str]:
    return REGISTRY.names()


def build_model(name: str, num_classes: int, input_shape: tuple[int, ...], feature_dim: int = 512,
                **options: Any) -> nn.Module:
    """Build the registered model ``name`` for ``num_classes`` classes and inputs of ``input_shape``
    (C x H x W for image models, (L,) for ``textcnn``); ``options`` go to the constructor.

    Raises ``KeyError`` for an unknown name (listing the valid ones) and
    ``ValueError`` when ``input_shape`` does not suit the model.
    """
    constructor = MODELS.get(name)
    if constructor is None:
        raise KeyError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    input_shape = tuple(input_shape)
    kind = getattr(constructor, "input_kind", "image")
    if kind == "tokens":
        check_token_shape(name, input_shape)
    elif kind == "image":
        check_image_shape(name, input_shape)  # "any" (mlp): the constructor checks the shape
    try:
        return constructor(num_classes=num_classes, input_shape=input_shape, feature_dim=feature_dim, **options)
    except RuntimeError as error:  # e.g. FedAvgCNN's dry run on an image too small for its convolutions
        raise ValueError(f"model {name!r} cannot take inputs of shape {input_shape}: {error}") from error


__all__ = ["ENTRY_POINT_GROUP", "MODELS", "REGISTRY", "ModelDeclaration", "build_model", "declared_model",
           "model_names", "register", "FedAvgCNN", "CNN4", "ResNetFE", "MobileNetV2FE", "GoogLeNetFE", "TextCNN",
           "HTFE", "architecture_for_client", "split", "SplitModel", "with_projection_head", "ProjectionHeadNet"]
