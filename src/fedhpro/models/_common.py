"""Pieces shared by the model zoo: the common model shape, input-shape checks, and the ``-> d`` projection."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from fedhpro.models.shapes import (  # noqa: F401 (the zoo's modules import them from here)
    _int_tuple,
    check_dims,
    check_image_shape,
    check_token_shape,
)

#: inputs with ``min(H, W) <= SMALL_INPUT`` get the small-image ("CIFAR") stems; larger ones keep ImageNet's
SMALL_INPUT = 32

PROJECTIONS = ("linear", "pool")


class ZooModel(nn.Module):
    """``features`` (an ``nn.Module``: input -> ``B x d``) followed by ``classifier`` (``nn.Linear(d, C)``).

    ``forward(x) == classifier(features(x))``. Subclasses set ``self.features``;
    :meth:`_finish` adds the classifier and the ``feature_dim`` / ``num_classes``
    attributes.
    """

    #: "image" (input_shape = C x H x W) or "tokens" (input_shape = (L,), LongTensor token ids)
    input_kind = "image"

    features: nn.Module
    classifier: nn.Linear

    def _finish(self, num_classes: int, feature_dim: int) -> None:
        self.classifier = nn.Linear(feature_dim, num_classes)
        self.feature_dim = feature_dim
        self.num_classes = num_classes

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class FeaturePool(nn.Module):
    """Parameter-free ``B x W -> B x d`` adaptive average pooling over the feature axis (HtFLlib's trick)."""

    def __init__(self, feature_dim: int):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool1d(feature_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.pool(x.unsqueeze(1)).squeeze(1)


def projection(width: int, feature_dim: int, kind: str = "linear") -> nn.Module:
    """The map from a trunk's pooled width to ``d``: identity when equal, else ``nn.Linear(width, d)``
    (``kind="linear"``, the default) or parameter-free adaptive average pooling (``kind="pool"``, what the
    paper's "adaptive average pooling layer after each feature extractor" and FedTGP/HtFLlib do)."""
    if kind not in PROJECTIONS:
        raise ValueError(f"projection must be one of {PROJECTIONS}, got {kind!r}")
    if width == feature_dim:
        return nn.Identity()
    if kind == "pool":
        return FeaturePool(feature_dim)
    return nn.Linear(width, feature_dim)


class MaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` with a faster, exactly equal forward where no gradient is taken.

    PyTorch's CPU kernel for NCHW max pooling computes the argmax indices even
    under ``no_grad`` and is slow: in ``cnn`` it took ~45 % of an eval-mode
    forward pass. For the 2 x 2, stride 2 window (no padding, dilation 1,
    floor mode) the pool is the elementwise maximum of four strided views;
    a maximum is exact, so the output is bit for bit the same (measured 7x
    faster on one CPU thread). Where autograd records (training) the standard
    kernel runs, so training and its gradients are unchanged. The state dict
    is that of ``nn.MaxPool2d`` (no parameters).
    """

    def forward(self, x: Tensor) -> Tensor:
        if (x.requires_grad and torch.is_grad_enabled()) or not self._strided_maximum_applies(x):
            return super().forward(x)
        height, width = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2  # floor mode drops an odd last row/column
        top = torch.maximum(x[..., 0:height:2, 0:width:2], x[..., 0:height:2, 1:width:2])
        bottom = torch.maximum(x[..., 1:height:2, 0:width:2], x[..., 1:height:2, 1:width:2])
        return torch.maximum(top, bottom)

    def _strided_maximum_applies(self, x: Tensor) -> bool:
        return (x.dim() == 4 and x.device.type == "cpu" and not self.return_indices and not self.ceil_mode
                and _pair(self.kernel_size) == (2, 2) and _pair(self.stride or self.kernel_size) == (2, 2)
                and _pair(self.padding) == (0, 0) and _pair(self.dilation) == (1, 1)
                and x.shape[-2] >= 2 and x.shape[-1] >= 2)
