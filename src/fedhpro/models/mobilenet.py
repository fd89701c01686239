"""MobileNetV2 feature extractor built from torchvision's ``MobileNetV2`` (random init, no weights)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torchvision.models import MobileNetV2

from fedhpro.models._common import SMALL_INPUT, ZooModel, check_dims, check_image_shape
from fedhpro.models._common import projection as make_projection

#: torchvision's (expansion t, channels c, repeats n, first stride s) per stage, width 1.0
IMAGENET_SETTING = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1],
                    [6, 160, 3, 2], [6, 320, 1, 1]]


class MobileNetV2FE(ZooModel):
    """torchvision MobileNetV2 ``features`` -> adaptive average pool -> flatten -> projection 1280 -> d.

    The paper uses it for TinyImageNet (64x64): there the network is torchvision's
    unchanged (stride-2 stem conv + strides 2, 2, 2, 2 in the stages: 32x
    downsampling, a 2x2 last map). For small inputs (``min(H, W) <= 32``) the
    first two strides are dropped, as the usual CIFAR MobileNetV2 does: the stem
    convolution gets stride 1 and the second stage (24 channels) stride 1, so the
    downsampling is 8x and a 32x32 image ends in a 4x4 map (28x28: 4x4).
    The stem takes ``input_shape[0]`` channels. The classifier-side dropout of
    torchvision's model is not kept. Projection: ``nn.Linear(1280, d)``
    (``projection="pool"``: parameter-free adaptive average pooling), identity if d = 1280.
    """

    def __init__(self, num_classes: int = 10, input_shape: Sequence[int] = (3, 64, 64), feature_dim: int = 512, *,
                 projection: str = "linear", width_mult: float = 1.0):
        super().__init__()
        check_dims("mobilenetv2", num_classes, feature_dim)
        channels, height, width = check_image_shape("mobilenetv2", input_shape)
        self.small_input_stem = min(height, width) <= SMALL_INPUT
        setting = [list(row) for row in IMAGENET_SETTING]
        if self.small_input_stem:
            setting[1][3] = 1
        net = MobileNetV2(num_classes=1, width_mult=width_mult, inverted_residual_setting=setting)
        trunk = net.features
        stem = trunk[0][0]
        if self.small_input_stem or channels != 3:
            stride = 1 if self.small_input_stem else 2
            trunk[0][0] = nn.Conv2d(channels, stem.out_channels, kernel_size=3, stride=stride, padding=1, bias=False)
            nn.init.kaiming_normal_(trunk[0][0].weight, mode="fan_out")
        self.trunk_width = net.last_channel
        self.features = nn.Sequential(trunk, nn.AdaptiveAvgPool2d(1), nn.Flatten(1),
                                      make_projection(self.trunk_width, feature_dim, projection))
        self._finish(num_classes, feature_dim)
