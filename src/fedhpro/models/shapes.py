"""The checks of a model's sizes and input shape, without torch: :func:`fedhpro.models.build_model` refuses a
shape that does not suit the model before its code (and torch) is imported."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral


def check_dims(name: str, num_classes: int, feature_dim: int) -> None:
    if int(num_classes) < 1:
        raise ValueError(f"{name}: num_classes must be >= 1, got {num_classes}")
    if int(feature_dim) < 1:
        raise ValueError(f"{name}: feature_dim must be >= 1, got {feature_dim}")


def _int_tuple(input_shape: Sequence[int]) -> tuple:
    """The shape as a tuple, integral entries (numpy / torch ints too) turned into ``int``."""
    return tuple(int(s) if isinstance(s, Integral) and not isinstance(s, bool) else s for s in input_shape)


def check_image_shape(name: str, input_shape: Sequence[int], min_size: int = 1) -> tuple[int, int, int]:
    """``input_shape`` as ``(C, H, W)``; ``ValueError`` when it is not an image shape of at least ``min_size``."""
    shape = _int_tuple(input_shape)
    if len(shape) != 3 or not all(isinstance(s, int) and s >= 1 for s in shape):
        hint = (" (a flat shape: use 'mlp' for feature vectors, 'textcnn' for token sequences)"
                if len(shape) == 1 else "")
        raise ValueError(f"model {name!r} takes images: input_shape must be (channels, height, width) of "
                         f"positive ints, got {shape}{hint}")
    if min(shape[1:]) < min_size:
        raise ValueError(f"model {name!r} needs images of at least {min_size}x{min_size}, got {shape}")
    return shape  # type: ignore[return-value]


def check_token_shape(name: str, input_shape: Sequence[int]) -> int:
    """``input_shape`` as ``(L,)``; ``ValueError`` otherwise. Returns ``L``."""
    shape = _int_tuple(input_shape)
    if len(shape) != 1 or not isinstance(shape[0], int) or shape[0] < 1:
        raise ValueError(f"model {name!r} takes token-id sequences: input_shape must be (L,) with L >= 1, "
                         f"got {shape}" + (" (an image shape: use an image model)" if len(shape) == 3 else ""))
    return shape[0]


__all__ = ["check_dims", "check_image_shape", "check_token_shape"]
