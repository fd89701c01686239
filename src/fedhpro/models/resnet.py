"""ResNet-10/18/34/50/101 feature extractors built from torchvision's ``ResNet`` (random init, no weights)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

from fedhpro.models._common import SMALL_INPUT, ZooModel, check_dims, check_image_shape
from fedhpro.models._common import projection as make_projection

#: name -> (block, blocks per stage); resnet10 (BasicBlock, [1, 1, 1, 1]) has no torchvision builder
RESNET_LAYOUTS: dict[str, tuple[type[nn.Module], list[int]]] = {
    "resnet10": (BasicBlock, [1, 1, 1, 1]),
    "resnet18": (BasicBlock, [2, 2, 2, 2]),
    "resnet34": (BasicBlock, [3, 4, 6, 3]),
    "resnet50": (Bottleneck, [3, 4, 6, 3]),
    "resnet101": (Bottleneck, [3, 4, 23, 3]),
}


class ResNetFE(ZooModel):
    """A torchvision ``ResNet`` trunk as a feature extractor, plus a linear classifier.

    Stem rule: inputs with ``min(H, W) <= 32`` (CIFAR, digits at 28x28) get the
    CIFAR stem -- a 3x3 stride-1 convolution and *no* max-pool, so the four
    stages run at 32/16/8/4 pixels; larger inputs (TinyImageNet's 64x64 and up)
    keep the ImageNet stem (7x7 stride-2 convolution + 3x3 stride-2 max-pool).
    The stem convolution takes ``input_shape[0]`` channels (1 or 3).

    ``features``: stem -> layer1..layer4 -> global average pool -> flatten ->
    projection. The pooled width is 512 (BasicBlock) or 2048 (Bottleneck); when
    it differs from ``d`` the projection is ``nn.Linear(width, d)`` (no
    activation; ``projection="pool"`` swaps in parameter-free adaptive average
    pooling as in FedTGP/HtFLlib), otherwise the identity, so ResNet-10/18/34
    with ``d = 512`` have features = the pooled last stage, exactly.
    Weights: torchvision's init (Kaiming-normal convolutions, BN weight 1 / bias 0);
    a replaced stem convolution gets the same Kaiming init.
    """

    def __init__(self, num_classes: int = 10, input_shape: Sequence[int] = (3, 32, 32), feature_dim: int = 512, *,
                 arch: str = "resnet18", projection: str = "linear"):
        super().__init__()
        if arch not in RESNET_LAYOUTS:
            raise ValueError(f"unknown ResNet depth {arch!r}; choose one of {sorted(RESNET_LAYOUTS)}")
        check_dims(arch, num_classes, feature_dim)
        channels, height, width = check_image_shape(arch, input_shape)
        block, layers = RESNET_LAYOUTS[arch]
        net = ResNet(block, layers, num_classes=1)  # its fc is dropped below
        self.arch = arch
        self.small_input_stem = min(height, width) <= SMALL_INPUT
        if self.small_input_stem:
            net.conv1 = nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        elif channels != 3:
            net.conv1 = nn.Conv2d(channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
        trunk_width = net.fc.in_features
        stages: list[tuple[str, nn.Module]] = [("conv1", net.conv1), ("bn1", net.bn1), ("relu", net.relu)]
        if not self.small_input_stem:
            stages.append(("maxpool", net.maxpool))
        stages += [("layer1", net.layer1), ("layer2", net.layer2), ("layer3", net.layer3), ("layer4", net.layer4),
                   ("avgpool", net.avgpool), ("flatten", nn.Flatten(1)),
                   ("projection", make_projection(trunk_width, feature_dim, projection))]
        self.features = nn.Sequential(OrderedDict(stages))
        self.trunk_width = trunk_width
        self._finish(num_classes, feature_dim)


def _named(arch: str):
    def build(num_classes: int = 10, input_shape: Sequence[int] = (3, 32, 32), feature_dim: int = 512,
              **options) -> ResNetFE:
        return ResNetFE(num_classes, input_shape, feature_dim, arch=arch, **options)

    build.__name__ = build.__qualname__ = arch
    summary = (ResNetFE.__doc__ or "A torchvision ResNet trunk as a feature extractor.").splitlines()[0]
    build.__doc__ = f"{arch}: {summary} (see :class:`ResNetFE`)."
    build.input_kind = "image"  # type: ignore[attr-defined]
    return build


resnet10 = _named("resnet10")
resnet18 = _named("resnet18")
resnet34 = _named("resnet34")
resnet50 = _named("resnet50")
resnet101 = _named("resnet101")
