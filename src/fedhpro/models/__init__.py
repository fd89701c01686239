"""Model zoo: every model exposes ``features(x) -> z`` (B x d) and ``classifier`` (an ``nn.Linear``).

Adding a model is one new file plus one line in ``MODELS``.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from fedhpro.models.cnn import FedAvgCNN

__all__ = ["MODELS", "build_model", "FedAvgCNN"]

#: name -> constructor(num_classes, input_shape, feature_dim)
MODELS: dict[str, Callable[..., nn.Module]] = {
    "cnn": FedAvgCNN,
}


def build_model(name: str, num_classes: int, input_shape: tuple[int, ...], feature_dim: int = 512) -> nn.Module:
    """Build the registered model ``name`` for ``num_classes`` classes and inputs of ``input_shape`` (C x H x W)."""
    try:
        constructor = MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; choose one of {sorted(MODELS)}") from None
    return constructor(num_classes=num_classes, input_shape=tuple(input_shape), feature_dim=feature_dim)
