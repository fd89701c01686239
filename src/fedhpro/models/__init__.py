"""Model zoo: every model exposes ``features(x) -> z`` (B x d) and ``classifier`` (an ``nn.Linear(d, C)``),
with ``forward(x) == classifier(features(x))`` and attributes ``feature_dim`` / ``num_classes``.

Adding a model is one new file plus one ``REGISTRY.builtin`` line here, or, without editing the package,
``fedhpro.models.register(name, constructor)`` or an installed package's entry point in the group
``fedhpro.models`` (``mine = "my_package:build"``); ``model=<name>`` then works everywhere.
:func:`with_projection_head` adds the MOON
authors' projection head to any of them (the run key ``projection_head=true``). Constructors take
``(num_classes, input_shape, feature_dim=512, **options)``; image models take
``input_shape = (C, H, W)``, ``textcnn`` takes ``(L,)`` (LongTensor token ids), ``mlp`` any float shape
(flattened; ``(F,)`` for tabular features).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from fedhpro.errors import ConfigError
from fedhpro.models._common import check_image_shape, check_token_shape
from fedhpro.models.authors_resnet import resnet10_authors
from fedhpro.models.cnn import CNN4, FedAvgCNN
from fedhpro.models.mlp import MLP
from fedhpro.models.textcnn import TextCNN
from fedhpro.registry import Registry

#: classes of the modules that need torchvision, imported on first use (keeps ``import fedhpro`` light)
_LAZY_CLASSES = {"ResNetFE": "resnet", "MobileNetV2FE": "mobilenet", "GoogLeNetFE": "googlenet"}


def __getattr__(name: str) -> Any:
    if name in _LAZY_CLASSES:
        return getattr(importlib.import_module(f"fedhpro.models.{_LAZY_CLASSES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _lazy(module: str, attr: str) -> Callable[..., nn.Module]:
    """A constructor that imports ``fedhpro.models.<module>`` (and so torchvision) only when called."""

    def build(num_classes: int = 10, input_shape: tuple[int, ...] = (3, 32, 32), feature_dim: int = 512,
              **options: Any) -> nn.Module:
        constructor = getattr(importlib.import_module(f"fedhpro.models.{module}"), attr)
        return constructor(num_classes=num_classes, input_shape=input_shape, feature_dim=feature_dim, **options)

    build.__name__ = build.__qualname__ = attr
    build.__doc__ = f"Build :func:`fedhpro.models.{module}.{attr}` (imported on first call)."
    build.input_kind = "image"  # type: ignore[attr-defined]
    return build

__all__ = ["ENTRY_POINT_GROUP", "MODELS", "REGISTRY", "build_model", "model_names", "register", "FedAvgCNN",
           "CNN4", "ResNetFE", "MobileNetV2FE", "GoogLeNetFE", "TextCNN",
           "HTFE", "architecture_for_client"]

def _checked(name: str, loaded: object, where: str) -> Callable[..., nn.Module]:
    if not callable(loaded):
        raise ConfigError(f"{where} gives a {type(loaded).__name__}, not a model constructor "
                          "(num_classes, input_shape, feature_dim, **options) -> nn.Module")
    return loaded


#: the entry-point group through which installed packages add models
ENTRY_POINT_GROUP = "fedhpro.models"

#: name -> constructor(num_classes, input_shape, feature_dim, **options): a live mapping (built-ins first)
REGISTRY: Registry[Callable[..., nn.Module]] = Registry(
    "model", ENTRY_POINT_GROUP, key="model", check=_checked,
    hint=f" (or add one with fedhpro.models.register or a package's {ENTRY_POINT_GROUP!r} entry point)")
REGISTRY.builtin("cnn", FedAvgCNN)
REGISTRY.builtin("cnn4", CNN4)
REGISTRY.builtin("resnet10", _lazy("resnet", "resnet10"))
REGISTRY.builtin("resnet18", _lazy("resnet", "resnet18"))
REGISTRY.builtin("resnet34", _lazy("resnet", "resnet34"))
REGISTRY.builtin("resnet50", _lazy("resnet", "resnet50"))
REGISTRY.builtin("resnet101", _lazy("resnet", "resnet101"))
REGISTRY.builtin("resnet10-authors", resnet10_authors)
REGISTRY.builtin("mobilenetv2", _lazy("mobilenet", "MobileNetV2FE"))
REGISTRY.builtin("googlenet", _lazy("googlenet", "GoogLeNetFE"))
REGISTRY.builtin("textcnn", TextCNN)
REGISTRY.builtin("mlp", MLP)

MODELS: Registry[Callable[..., nn.Module]] = REGISTRY


def register(name: str, constructor: Callable[..., nn.Module], *, replace: bool = False
             ) -> Callable[..., nn.Module]:
    """Add ``constructor`` as ``model=name`` (``input_kind`` attribute: "image" (default), "tokens" or "any")."""
    return REGISTRY.register(name, constructor, replace=replace)


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


from fedhpro.models.heterogeneity import HTFE, architecture_for_client  # noqa: E402
from fedhpro.models.projection import ProjectionHeadNet, with_projection_head  # noqa: E402
from fedhpro.models.split import SplitModel, split  # noqa: E402

__all__ += ["split", "SplitModel", "with_projection_head", "ProjectionHeadNet"]
