"""The ``data.*`` keys of decoding image files, shared by every data set of image files (``dataset=clients``
and ``dataset=imagefolder``), declared once here with one meaning each, without torch (the decoding itself:
:mod:`fedhpro.data.images`)."""

from __future__ import annotations

from typing import Any

from fedhpro.options import option

#: the bit depths of 16-bit images' values (the usual depths of cameras and scanners): what ``data.bit_depth``
#: may say and what :func:`fedhpro.data.images.detected_depth` chooses from
BIT_DEPTHS = (8, 10, 12, 14, 16)
#: ``data.bit_depth=0``: the depth is detected from the images
DETECTED = 0


def cache_option() -> Any:
    """``data.cache``: whether decoded pixels are kept for later runs."""
    return option(True, help="image files: keep the decoded pixels in data_dir/.fedhpro-cache (keyed by the "
                             "files' names, sizes, mtimes, inodes and ctimes), so later runs skip decoding")


def bit_depth_option() -> Any:
    """``data.bit_depth``: how 16-bit images' values are scaled; 0 (:data:`DETECTED`) detects it."""
    return option(DETECTED, choices=(DETECTED, *BIT_DEPTHS),
                  help="bits of 16-bit grey images' values: 8..16 scales them by 1/(2**bits - 1) to [-1, 1] (a "
                       "larger value is refused); 0 detects the depth, the smallest of 8, 10, 12, 14, 16 bits "
                       "holding the largest value of the images decoded together (said in the run's notes): "
                       "dataset=imagefolder's whole data set, dataset=clients' each site alone, where a site "
                       "whose 16-bit images fit fewer than 16 bits is refused (every site must scale alike: set "
                       "it). 8-bit images are not affected")


def scaling_depth(bit_depth: int, detected: int | None) -> int | None:
    """The depth 16-bit values are scaled by: ``data.bit_depth`` when set, else (:data:`DETECTED`) the depth
    ``detected`` from the images decoded together (None: every image is 8-bit)."""
    return bit_depth if bit_depth != DETECTED else detected


__all__ = ["BIT_DEPTHS", "DETECTED", "bit_depth_option", "cache_option", "scaling_depth"]
