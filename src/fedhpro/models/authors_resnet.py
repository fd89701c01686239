"""The ResNet-10 of the FedHPro authors' code (mala-lab/FedHPro, ``backbone/ResNet10.py``), as a zoo model.

Not the zoo's ``resnet10`` (torchvision's trunk, widths 64-512, Kaiming init,
5.0 M parameters at d = 512): theirs is ``resnet10(nclasses, nf=32)`` of
``backbone/ResNet10.py`` lines 145-152, ``ResNet(BasicBlock, [1, 1, 1, 1])``
with widths ``nf, 2 nf, 4 nf, 8 nf`` = 32-256 (1.2 M parameters for 10
classes), PyTorch's default initialisation (no init code), and features
taken after the last block's ReLU, average-pooled with a kernel the size of
the last map (``features``, lines 116-122). Its ``encoder`` (lines 93-97, two
linear layers) is used by nothing in their FedHPro (``main_run.py`` calls
``forward`` and ``features`` only), so it is left out here: a block no
forward pass reaches would only be sent and averaged unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from fedhpro.models._common import ZooModel, check_dims, check_image_shape

#: ``d = WIDTH_MULTIPLE * nf``: the pooled last stage has 8 nf channels (their ``nf * 8 * block.expansion``)
WIDTH_MULTIPLE = 8


class AuthorsBasicBlock(nn.Module):
    """Their ``BasicBlock`` (lines 20-56): conv3x3-BN-ReLU-conv3x3-BN, plus the shortcut (a 1x1 conv and BN
    when the shape changes), then ReLU."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False),
                                          nn.BatchNorm2d(planes))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = out + self.shortcut(x)
        return F.relu(out)


class LastMapAveragePool(nn.Module):
    """Their pooling (line 119): ``avg_pool2d`` with a kernel the height of the map, then flatten: the mean
    over the whole map when it is square (every square input)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.avg_pool2d(x, x.shape[2]).flatten(1)


class AuthorsResNet10(ZooModel):
    """``model=resnet10-authors``: their ResNet-10, ``features`` = stem (conv3x3 stride 1, BN, ReLU), four stages
    of one :class:`AuthorsBasicBlock` (strides 1, 2, 2, 2), :class:`LastMapAveragePool`; ``classifier`` =
    ``nn.Linear(d, C)``.

    The feature dimension is the width of the last stage, ``d = 8 nf``: their ``--dim 256`` is ``nf = 32``
    (their default); another ``feature_dim`` scales every width (``feature_dim=512``: ``nf = 64``) and must be a
    multiple of 8. Images must be square (their pooling kernel is the map's height) and at least 8 px.
    """

    def __init__(self, num_classes: int = 10, input_shape: Sequence[int] = (3, 32, 32), feature_dim: int = 256):
        super().__init__()
        name = "resnet10-authors"
        check_dims(name, num_classes, feature_dim)
        channels, height, width = check_image_shape(name, input_shape, min_size=8)
        if height != width:
            raise ValueError(f"model {name!r} needs square images (its pooling kernel is the map's height), "
                             f"got {height}x{width}")
        if feature_dim % WIDTH_MULTIPLE:
            raise ValueError(f"model {name!r}: feature_dim is 8 x its base width, so it must be a multiple of 8, "
                             f"got {feature_dim} (their code: 256)")
        nf = feature_dim // WIDTH_MULTIPLE
        stages: list[nn.Module] = [nn.Conv2d(channels, nf, kernel_size=3, stride=1, padding=1, bias=False),
                                   nn.BatchNorm2d(nf), nn.ReLU()]
        in_planes = nf
        for multiple, stride in ((1, 1), (2, 2), (4, 2), (8, 2)):
            stages.append(AuthorsBasicBlock(in_planes, nf * multiple, stride))
            in_planes = nf * multiple
        stages.append(LastMapAveragePool())
        self.features = nn.Sequential(*stages)
        self._finish(num_classes, feature_dim)


def resnet10_authors(num_classes: int = 10, input_shape: Sequence[int] = (3, 32, 32), feature_dim: int = 256,
                     **options) -> AuthorsResNet10:
    """resnet10-authors: the FedHPro authors' ResNet-10 (see :class:`AuthorsResNet10`)."""
    if options:
        raise ValueError(f"model 'resnet10-authors' takes no options, got {sorted(options)}")
    return AuthorsResNet10(num_classes, input_shape, feature_dim)


resnet10_authors.input_kind = "image"  # type: ignore[attr-defined]
