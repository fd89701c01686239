"""The two parts every fedhpro model has (:mod:`fedhpro.models`), typed: the feature extractor
``model.features`` and the linear head ``model.classifier``. The training loop, the no-grad passes and the
methods reach a model's parts through these."""

from __future__ import annotations

from typing import cast

from torch import nn


def features_of(model: nn.Module) -> nn.Module:
    """``model.features``, the feature extractor every fedhpro model has (:mod:`fedhpro.models`), typed:
    ``nn.Module``'s attribute access is typed ``Tensor | Module`` by torch."""
    return cast(nn.Module, model.features)


def classifier_of(model: nn.Module) -> nn.Linear:
    """``model.classifier``, the linear head ``nn.Linear(d, C)`` every fedhpro model has (:mod:`fedhpro.models`),
    typed: ``nn.Module``'s attribute access is typed ``Tensor | Module`` by torch."""
    return cast(nn.Linear, model.classifier)
