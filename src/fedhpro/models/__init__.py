"""Model zoo: every model exposes ``features(x) -> z`` (B x d) and ``classifier`` (an ``nn.Linear(d, C)``),
with ``forward(x) == classifier(features(x))`` and attributes ``feature_dim`` / ``num_classes``.

Adding a model is one new file plus one line in ``MODELS``. Constructors take
``(num_classes, input_shape, feature_dim=512, **options)``; image models take
``input_shape = (C, H, W)``, ``textcnn`` takes ``(L,)`` (LongTensor token ids).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from fedhpro.models._common import check_image_shape, check_token_shape
from fedhpro.models.cnn import CNN4, FedAvgCNN
from fedhpro.models.googlenet import GoogLeNetFE
from fedhpro.models.mobilenet import MobileNetV2FE
from fedhpro.models.resnet import ResNetFE, resnet10, resnet18, resnet34, resnet50, resnet101
from fedhpro.models.textcnn import TextCNN

__all__ = ["MODELS", "build_model", "FedAvgCNN", "CNN4", "ResNetFE", "MobileNetV2FE", "GoogLeNetFE", "TextCNN",
           "describe_models", "format_model_table", "HTFE", "architecture_for_client"]

#: name -> constructor(num_classes, input_shape, feature_dim, **options)
MODELS: dict[str, Callable[..., nn.Module]] = {
    "cnn": FedAvgCNN,
    "cnn4": CNN4,
    "resnet10": resnet10,
    "resnet18": resnet18,
    "resnet34": resnet34,
    "resnet50": resnet50,
    "resnet101": resnet101,
    "mobilenetv2": MobileNetV2FE,
    "googlenet": GoogLeNetFE,
    "textcnn": TextCNN,
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
    if getattr(constructor, "input_kind", "image") == "tokens":
        check_token_shape(name, input_shape)
    else:
        check_image_shape(name, input_shape)
    try:
        return constructor(num_classes=num_classes, input_shape=input_shape, feature_dim=feature_dim, **options)
    except RuntimeError as error:  # e.g. FedAvgCNN's dry run on an image too small for its convolutions
        raise ValueError(f"model {name!r} cannot take inputs of shape {input_shape}: {error}") from error


from fedhpro.models.heterogeneity import HTFE, architecture_for_client  # noqa: E402
from fedhpro.models.summary import describe_models, format_model_table  # noqa: E402
