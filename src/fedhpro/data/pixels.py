"""The pixel limit of every image fedhpro reads (training data, ``fedhpro predict``): an image's size comes
from its file's header and one over the limit is refused, in one line, before anything is decoded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
