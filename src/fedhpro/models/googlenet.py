"""GoogLeNet (Inception v1) feature extractor built from torchvision's ``GoogLeNet`` (random init, no weights)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn
from torchvision.models import GoogLeNet
from torchvision.models.googlenet import BasicConv2d

from fedhpro.models._common import SMALL_INPUT, ZooModel, check_dims, check_image_shape
from fedhpro.models._common import projection as make_projection


class GoogLeNetFE(ZooModel):
    """torchvision ``GoogLeNet(aux_logits=False, init_weights=True)`` up to its global average pool (1024),
    then flatten -> projection to ``d`` (``nn.Linear(1024, d)``; ``projection="pool"``: parameter-free
    adaptive average pooling; identity if d = 1024). The dropout before torchvision's fc is not kept.

    Stem: torchvision's stem (7x7 stride-2 conv, max-pool, 1x1 and 3x3 convs,
    max-pool) downsamples by 8 before inception 3, and maxpool3/maxpool4 by 4
    more, so a 32x32 image would reach inception 5 at 1x1. For small inputs
    (``min(H, W) <= 32``) the first convolution becomes a 3x3 stride-1 one and
    the first max-pool is dropped (the same 4x the ResNet CIFAR stem removes):
    inception 3 runs at 16x16, inception 4 at 8x8 and inception 5 at 4x4 for a
    32x32 input (28x28: 14, 7, 4). Larger inputs keep torchvision's stem. The first
    convolution takes ``input_shape[0]`` channels; a replaced one gets
    torchvision's GoogLeNet init (truncated normal, std 0.01).
    """

    def __init__(self, num_classes: int = 10, input_shape: Sequence[int] = (3, 32, 32), feature_dim: int = 512, *,
                 projection: str = "linear"):
        super().__init__()
        check_dims("googlenet", num_classes, feature_dim)
        channels, height, width = check_image_shape("googlenet", input_shape)
        self.small_input_stem = min(height, width) <= SMALL_INPUT
        net = GoogLeNet(num_classes=1, aux_logits=False, transform_input=False, init_weights=True)
        if self.small_input_stem:
            net.conv1 = BasicConv2d(channels, 64, kernel_size=3, stride=1, padding=1)
        elif channels != 3:
            net.conv1 = BasicConv2d(channels, 64, kernel_size=7, stride=2, padding=3)
        torch.nn.init.trunc_normal_(net.conv1.conv.weight, mean=0.0, std=0.01, a=-2, b=2)
        names = ["conv1", "maxpool1", "conv2", "conv3", "maxpool2", "inception3a", "inception3b", "maxpool3",
                 "inception4a", "inception4b", "inception4c", "inception4d", "inception4e", "maxpool4",
                 "inception5a", "inception5b", "avgpool"]
        if self.small_input_stem:
            names.remove("maxpool1")
        self.trunk_width = net.fc.in_features
        stages = [(name, getattr(net, name)) for name in names]
        stages += [("flatten", nn.Flatten(1)),
                   ("projection", make_projection(self.trunk_width, feature_dim, projection))]
        self.features = nn.Sequential(OrderedDict(stages))
        self._finish(num_classes, feature_dim)
