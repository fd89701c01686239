"""The pixel limit of every image fedhpro reads (training data, ``fedhpro predict``): an image's size comes
from its file's header and one over the limit is refused, in one line, before anything is decoded; and
:class:`CompactImages`, a set of images held as its 8- or 16-bit pixels that reads as its decoded floats."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree

from fedhpro.bounded import limit_from_environment
from fedhpro.errors import DataError

#: the most pixels (width x height) an image may have: read from its header and refused before it is decoded
#: (a PNG of a few hundred KB can hold 144 megapixels, over 400 MB once decoded to RGB). Pillow's own warning
#: threshold; the environment variable :data:`MAX_PIXELS_VARIABLE` sets another (Pillow itself still refuses
#: images over twice its threshold, 178,956,970 pixels)
MAX_IMAGE_PIXELS = 89_478_485
#: the environment variable that sets the pixel limit of every image read (training data and ``fedhpro predict``)
MAX_PIXELS_VARIABLE = "FEDHPRO_MAX_IMAGE_PIXELS"


def max_image_pixels() -> int:
    """The pixel limit of an image: ``$FEDHPRO_MAX_IMAGE_PIXELS`` when set (a whole number >= 1), else
    :data:`MAX_IMAGE_PIXELS`; a value that is not one is a one-line ConfigError."""
    return limit_from_environment(MAX_PIXELS_VARIABLE, MAX_IMAGE_PIXELS, "pixels an image may have")


def check_image_size(image: Any, where: str = "the image", limit: int | None = None) -> None:
    """A one-line DataError if the PIL image ``image`` (opened, not yet decoded: its size comes from the file's
    header) has more than ``limit`` pixels (default :func:`max_image_pixels`)."""
    limit = max_image_pixels() if limit is None else limit
    width, height = image.size
    if width * height > limit:
        raise DataError(f"{where} is {width}x{height} = {width * height:,} pixels, over the limit of {limit:,}; "
                        f"shrink the image, or raise the limit with {MAX_PIXELS_VARIABLE}=N")


def open_image(path: Path | str | Any, where: str | None = None, limit: int | None = None) -> Any:
    """``PIL.Image.open(path)`` (use it in a ``with``), its pixel count checked before anything is decoded
    (:func:`check_image_size`); Pillow's own decompression-bomb warning is left out, this check replaces it."""
    import warnings

    from PIL import Image

    limit = max_image_pixels() if limit is None else limit
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        image = Image.open(path)
    try:
        check_image_size(image, where or str(path), limit)
    except BaseException:
        image.close()
        raise
    return image


#: what a :class:`CompactImages` answers from its pixels, never decoding them
_PIXEL_METADATA = frozenset({Tensor.shape.__get__, Tensor.device.__get__, Tensor.ndim.__get__,  # type: ignore[attr-defined]
                             Tensor.is_cuda.__get__, Tensor.layout.__get__,  # type: ignore[attr-defined]
                             Tensor.requires_grad.__get__, Tensor.size, Tensor.dim,  # type: ignore[attr-defined]
                             Tensor.__len__, Tensor.numel, Tensor.get_device})
_MOVES = frozenset({Tensor.to, Tensor.cpu, Tensor.cuda})


class CompactImages(Tensor):
    """A set of images held as its ``uint8`` (or ``uint16``) pixels that reads as its decoded floats: a quarter
    (a half) of float32's memory. Indexing (``x[i:j]``, ``x[rows]``) decodes only those images, ``x.to(device)``
    moves the pixels, shape, device and length are the pixels' and ``dtype`` the decoding's; any other use
    decodes the whole set first, as the float tensor held before would give it. ``decode`` must work image by
    image (``normalize_images``), so a batch decoded alone is that batch of the decoded whole, to the bit.
    Read-only: writing into it (``x[i] = ...``, ``x.add_(...)``) is refused."""

    pixels: Tensor
    decode: Callable[[Tensor], Tensor]

    @staticmethod
    def __new__(cls, pixels: Tensor, decode: Callable[[Tensor], Tensor]) -> CompactImages:
        if pixels.dtype not in (torch.uint8, torch.uint16):
            raise DataError(f"compact images hold uint8 or uint16 pixels, got {pixels.dtype}; decode other "
                            "images up front")
        images = Tensor._make_subclass(cls, pixels)
        images.pixels, images.decode = pixels, decode
        return images

    def __init__(self, pixels: Tensor, decode: Callable[[Tensor], Tensor]) -> None:
        pass  # set up in __new__ (a Tensor subclass is made there)

    def decoded(self) -> Tensor:
        """Every image decoded: the float tensor this set stands for."""
        return self.decode(self.pixels)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = args[0] if args and isinstance(args[0], CompactImages) else None
        if self is not None:
            if func is Tensor.__getitem__:
                return self.decode(self.pixels[args[1]])
            if func in _PIXEL_METADATA:
                return func(self.pixels, *args[1:], **kwargs)
            if func is Tensor.dtype.__get__:  # type: ignore[attr-defined]
                return self.decode(self.pixels[:0]).dtype
            if func is Tensor.is_floating_point:
                return self.decode(self.pixels[:0]).is_floating_point()
            if func in _MOVES:
                moved = func(self.pixels, *args[1:], **kwargs)
                if moved.dtype == self.pixels.dtype:  # another device only: the pixels move
                    return self if moved is self.pixels else CompactImages(moved, self.decode)
        name = getattr(func, "__name__", "")
        if name == "__setitem__" or (name.endswith("_") and not name.endswith("__")):
            raise DataError(f"compact images are read-only ({name}): write into the float tensor of "
                            "their .decoded() instead")
        args, kwargs = _pytree.tree_map(lambda v: v.decoded() if isinstance(v, CompactImages) else v, (args, kwargs))
        return func(*args, **kwargs)
