"""Model zoo: every model exposes ``features(x) -> z`` (B x d) and ``classifier`` (an ``nn.Linear(d, C)``),
with ``forward(x) == classifier(features(x))`` and attributes ``feature_dim`` / ``num_classes``.

Adding a model is one new file plus one line in ``MODELS``. :func:`with_projection_head` adds the MOON
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

from fedhpro.models._common import check_image_shape, check_token_shape
from fedhpro.models.cnn import CNN4, FedAvgCNN
from fedhpro.models.mlp import MLP
from fedhpro.models.textcnn import TextCNN

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

__all__ = ["MODELS", "build_model", "FedAvgCNN", "CNN4", "ResNetFE", "MobileNetV2FE", "GoogLeNetFE", "TextCNN",
           "describe_models", "format_model_table", "HTFE", "architecture_for_client"]

#: name -> constructor(num_classes, input_shape, feature_dim, **options)
MODELS: dict[str, Callable[..., nn.Module]] = {
    "cnn": FedAvgCNN,
    "cnn4": CNN4,
    "resnet10": _lazy("resnet", "resnet10"),
    "resnet18": _lazy("resnet", "resnet18"),
    "resnet34": _lazy("resnet", "resnet34"),
    "resnet50": _lazy("resnet", "resnet50"),
    "resnet101": _lazy("resnet", "resnet101"),
    "mobilenetv2": _lazy("mobilenet", "MobileNetV2FE"),
    "googlenet": _lazy("googlenet", "GoogLeNetFE"),
    "textcnn": TextCNN,
    "mlp": MLP,
}


def build_model(name: str, num_classes: int, input_shape: tuple[int, ...], feature_dim: int = 512,
                **options: Any) -> nn.Module:
    """Build the registered model ``name`` for ``num_classes`` classes and inputs of ``input_shape``
    (C x H x W for image models, (L,) for ``textcnn``); ``options`` go to the constructor.

    Raises ``KeyError`` for an unknown name (listing the valid ones) and
    ``ValueError`` when ``input_shape`` does not suit the model.
    """
    try:
        constructor = MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; choose one of {sorted(MODELS)}") from None
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
from fedhpro.models.summary import describe_models, format_model_table  # noqa: E402

__all__ += ["split", "SplitModel", "with_projection_head", "ProjectionHeadNet"]
