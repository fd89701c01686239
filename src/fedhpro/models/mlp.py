"""MLP: a small fully connected network for tabular features (``dataset=clients`` with ``train.npz``, say)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor, nn

from fedhpro.errors import DataError
from fedhpro.models._common import ZooModel, _int_tuple, check_dims


def _float_features(module: nn.Module, args: tuple) -> None:
    if args and isinstance(args[0], Tensor) and not args[0].is_floating_point():
        raise DataError(f"model=mlp takes float features, but the inputs are {args[0].dtype} (integer x in tensor "
                        "files are token ids, for model=textcnn); save x as floats, e.g. x.astype('float32')")


class MLP(ZooModel):
    """Flatten -> ``Linear(F, hidden)`` -> ReLU -> ``Linear(hidden, d)`` -> ReLU = features; classifier
    ``Linear(d, C)``.

    ``input_shape`` is ``(F,)`` for tabular rows, or any shape (it is
    flattened: ``F`` = the product of its sizes). Inputs are float features;
    the features are non-negative (after the ReLU), as the CNNs' are.
    """

    #: any float input shape (flattened), not only images
    input_kind = "any"

    def __init__(self, num_classes: int = 10, input_shape: Sequence[int] = (32,), feature_dim: int = 512, *,
                 hidden: int = 256):
        super().__init__()
        check_dims("mlp", num_classes, feature_dim)
        shape = _int_tuple(input_shape)
        if not shape or not all(isinstance(s, int) and s >= 1 for s in shape):
            raise ValueError(f"model 'mlp' takes input_shape of positive ints, e.g. (F,) features, got {shape}")
        if int(hidden) < 1:
            raise ValueError(f"mlp: hidden must be >= 1, got {hidden}")
        self.in_features = math.prod(shape)
        self.features = nn.Sequential(nn.Flatten(), nn.Linear(self.in_features, int(hidden)), nn.ReLU(inplace=True),
                                      nn.Linear(int(hidden), feature_dim), nn.ReLU(inplace=True))
        self._finish(num_classes, feature_dim)
        self.features.register_forward_pre_hook(_float_features)  # integer x: one line, not a matmul traceback
