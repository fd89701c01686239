"""FedAvgCNN: the two-convolution network of McMahan et al. (2017), as PFLlib and FedTGP use it."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fedhpro.models._common import MaxPool2d


class FedAvgCNN(nn.Module):
    """conv5x5(32) - ReLU - maxpool2 - conv5x5(64) - ReLU - maxpool2 - linear(d) - ReLU | linear(C).

    ``features`` maps a ``C_in x H x W`` image to a ``d``-dim feature (after the
    ReLU, so non-negative); ``classifier`` is the linear head. Works for 28x28
    (flattened width 1024) and 32x32 (1600) inputs, and any size the two
    convolutions accept.
    """

    def __init__(self, num_classes: int = 10, input_shape: tuple[int, ...] = (3, 32, 32), feature_dim: int = 512):
        super().__init__()
        channels = input_shape[0]
        trunk = nn.Sequential(
            nn.Conv2d(channels, 32, kernel_size=5),
            nn.ReLU(inplace=True),
            MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=5),
            nn.ReLU(inplace=True),
            MaxPool2d(2),
            nn.Flatten(),
        )
        with torch.no_grad():
            flat_width = trunk(torch.zeros(1, *input_shape)).shape[1]
        self.features = nn.Sequential(*trunk, nn.Linear(flat_width, feature_dim), nn.ReLU(inplace=True))
        self.classifier = nn.Linear(feature_dim, num_classes)
        self.feature_dim = feature_dim
        self.num_classes = num_classes

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class CNN4(FedAvgCNN):
    """The paper's "4-layer CNN" of the HtFE_2 / HtFE_8 lists: FedAvgCNN under its HtFE name.

    FedHPro's HtFE lists follow FedTGP (Zhang et al., 2024a) and FedSA, whose
    code builds that entry as ``FedAvgCNN(in_features=3, dim=1600)``: two 5x5
    convolutions (32, 64 channels, ReLU, 2x2 max-pool) and two fully connected
    layers (flatten -> 512 -> ReLU, then the classifier), i.e. four weight
    layers. So ``cnn4`` is exactly :class:`FedAvgCNN` (features = conv, conv,
    linear(d) + ReLU; classifier = linear(d, C)), with ``d`` honoured by the
    first linear layer. It needs inputs of at least 16x16.
    """

    input_kind = "image"
