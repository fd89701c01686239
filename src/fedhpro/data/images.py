"""Image files of the user's own data sets (``dataset=clients``, ``imagefolder``, ``huggingface``) as tensors.

One decoding rule for all of them: PIL decodes the image, converts it to RGB
(grey replicated, alpha dropped), resizes it to ``size x size`` with PIL's
bilinear filter (deterministic: the same file gives the same pixels on every
machine) and :func:`~fedhpro.data.federation.normalize_images` maps the
``uint8`` pixels to ``[-1, 1]``. Images of more than 8 bits are scaled by
their bit depth, never clipped (:func:`eight_bit`): 16-bit ones (PIL's
``I;16`` modes, and ``I`` holding 0..65535) by 255/65535, float ones (``F``)
holding 0..1 by 255; float pixels outside 0..1 and 32-bit integers beyond
65535 are refused in one line (their range is not known). An image of more
pixels than :func:`max_image_pixels` (``$FEDHPRO_MAX_IMAGE_PIXELS``, default
Pillow's 89,478,485) is refused in one line from its header, before any pixel
is decoded (:func:`open_image`).

Class folders are read as torchvision's ``ImageFolder`` reads them: every
image below a class folder, in nested subfolders too (:func:`class_files`).
Split folders are matched by name without regard to case
(:data:`SPLIT_NAMES`: ``train``/``training``, ``test``/``testing``,
``val``/``valid``/``validation``; :func:`split_folders`).

Decoded ``uint8`` arrays can be cached in a ``.fedhpro-cache`` folder beside
the data, keyed by the image size and every file's path, size, mtime, inode
and ctime: a changed, added, removed or replaced file gives a new key. The
ctime is what closes the gap of a same-size rewrite whose mtime was put back
with ``os.utime``: the kernel sets the ctime to now on every write, rename
and ``utime``, and no call sets it back. (Only a clock turned back, or a
file system without ctime, could defeat it; delete the cache folder then.)
A folder that cannot be written is simply not cached.

With ``depth=True`` (``dataset=imagefolder``) grey images of more than 8
bits keep their precision: :func:`decode_files` returns their 16-bit values
(``uint16``, resized in float) instead of 8 bits, cached under a key of its
own (format ``v2``, so an 8-bit cache is never read as 16-bit values), and
:func:`detected_depth` finds the bit depth of the whole data set (the
smallest of 8, 10, 12, 14 and 16 bits that holds its largest value: a
12-bit camera's 0..4095 in 16-bit PNGs is 12-bit). The depth is decided per
data set, not per image: one dark image of a 16-bit set must not be
stretched to full contrast while its bright neighbours are not.
:func:`to_float` scales such pixels by ``2**bits - 1`` to ``[-1, 1]``. 8-bit
data decodes byte for byte as before.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedhpro.arrays import MAX_ARRAY_BYTES_VARIABLE, ArrayFileError, Bound, load_npy
from fedhpro.data.decode_options import BIT_DEPTHS
from fedhpro.data.federation import normalize_images
from fedhpro.data.loaders import IMAGE_EXTENSIONS, files_key
from fedhpro.data.pixels import (
    MAX_IMAGE_PIXELS,
    MAX_PIXELS_VARIABLE,
    check_image_size,
    max_image_pixels,
    open_image,
)
from fedhpro.errors import DataError
from fedhpro.files import write_atomic_with

CACHE_FOLDER = ".fedhpro-cache"


def visible(path: Path) -> bool:
    """Not hidden: macOS ``._x.jpg`` companions and ``.DS_Store`` are no data."""
    return not path.name.startswith(".")


def is_image_file(path: Path) -> bool:
    return path.is_file() and visible(path) and path.suffix.lower() in IMAGE_EXTENSIONS


def image_files(folder: Path) -> list[Path]:
    """The image files directly in ``folder``, sorted by name (other files are ignored)."""
    return sorted(p for p in folder.iterdir() if is_image_file(p))


def images_below(folder: Path) -> list[Path]:
    """Every image file in ``folder`` and its non-hidden subfolders, at any depth (as torchvision's
    ``ImageFolder`` finds them, symbolic links followed, each folder once), sorted by the path below ``folder``."""
    found = []
    seen = set()
    for current, dirs, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(current)
        if real in seen:  # a link back up the tree: read each folder once
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [Path(current) / name for name in files
                  if not name.startswith(".") and Path(name).suffix.lower() in IMAGE_EXTENSIONS]
    return sorted(found, key=lambda path: path.relative_to(folder).parts)


#: the split folders' names (matched without regard to case): split -> the spellings taken for it
SPLIT_NAMES = {"train": ("train", "training"), "test": ("test", "testing"), "val": ("val", "valid", "validation")}


def split_folders(folder: Path) -> dict[str, Path]:
    """``{"train": path, "test": path, "val": path}``: the split folders of ``folder`` found (any of
    :data:`SPLIT_NAMES`, any case: ``Train/``, ``Testing/``, ``validation/``); two folders for one split
    (``train/`` and ``Training/``) are a one-line DataError."""
    spelling = {name: split for split, names in SPLIT_NAMES.items() for name in names}
    found: dict[str, list[Path]] = {}
    for sub in subfolders(folder):
        split = spelling.get(sub.name.lower())
        if split is not None:
            found.setdefault(split, []).append(sub)
    for split, paths in found.items():
        if len(paths) > 1:
            raise DataError(f"{folder} holds {' and '.join(p.name + '/' for p in paths)}, both taken for the {split} "
                            "split; merge them into one folder")
    return {split: paths[0] for split, paths in sorted(found.items(), key=lambda item: list(SPLIT_NAMES).index(
        item[0]))}


def subfolders(folder: Path) -> list[Path]:
    """The non-hidden subfolders of ``folder``, sorted by name."""
    return sorted(p for p in folder.iterdir() if p.is_dir() and visible(p))


def class_files(root: Path) -> dict[str, list[Path]]:
    """ImageFolder layout ``root/<class>/<image>``: class name -> its image files (both sorted by name).

    Every non-hidden subfolder is a class; its images are found at any depth
    below it (``seven/batch2/*.png``, as torchvision's ``ImageFolder``). A
    class folder without any image keeps its entry with no files: the callers
    leave such classes out and say so. Raises a one-line :class:`DataError`
    when ``root`` has no class subfolder or they hold no image.
    """
    classes = {folder.name: images_below(folder) for folder in subfolders(root) if folder.name != CACHE_FOLDER}
    if not classes:
        loose = " (the images lie directly in it)" if image_files(root) else ""
        raise DataError(f"{root} has no class subfolders{loose}; put each class's images in its own folder, "
                        f"{root}/<class>/<image>.png")
    if not any(classes.values()):
        raise DataError(f"the class folders of {root} hold no images ({', '.join(IMAGE_EXTENSIONS)}); "
                        f"put the images in {root}/<class>/")
    return classes


#: the largest value of a 16-bit pixel: 16-bit images are scaled by 255 / this
MAX_16_BIT = 65535

def eight_bit(image: Any, where: str = "the image") -> Any:
    """A PIL image of more than 8 bits a channel scaled to 8 bits by its bit depth (16-bit: x * 255 / 65535,
    rounded; float 0..1: x * 255), as an ``L`` image; other images as they are. Clipping them, what PIL's
    ``convert`` does, would make a 16-bit image all but white. Float pixels outside 0..1 and 32-bit integers
    beyond 0..65535 are a one-line DataError: their range is not known."""
    from PIL import Image

    mode = image.mode
    if not (mode.startswith("I") or mode == "F"):
        return image
    values = np.asarray(image)
    if mode == "F":
        values = values.astype(np.float64)
        if values.size and not (np.isfinite(values).all() and values.min() >= 0.0 and values.max() <= 1.0):
            raise DataError(f"{where} holds float pixels outside 0..1 ({float(np.nanmin(values)):g} to "
                            f"{float(np.nanmax(values)):g}); save it scaled to 0..1, or as an 8- or 16-bit image")
        scaled = values * 255.0
    else:
        values = values.astype(np.int64)
        if values.size and (values.min() < 0 or values.max() > MAX_16_BIT):
            raise DataError(f"{where} holds 32-bit integer pixels beyond 0..{MAX_16_BIT} ({int(values.min())} to "
                            f"{int(values.max())}); save it as an 8- or 16-bit image")
        scaled = values * (255.0 / MAX_16_BIT)
    return Image.fromarray(np.rint(scaled).astype(np.uint8))


def rgb_pixels(image: Any, size: int, where: str = "the image") -> np.ndarray:
    """A PIL image -> ``uint8`` ``3 x size x size``: scaled to 8 bits by its bit depth (:func:`eight_bit`),
    RGB, resized bilinearly when its size differs."""
    from PIL import Image

    check_image_size(image, where)  # before the pixels are decoded (eight_bit, convert)
    image = eight_bit(image, where).convert("RGB")
    if image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.BILINEAR)
    return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)


def deep_pixels(image: Any, size: int, where: str = "the image") -> np.ndarray:
    """A PIL image -> ``3 x size x size``: ``uint16`` values as stored for a grey integer image of more than
    8 bits (PIL's ``I;16`` modes, ``I`` within 0..65535; resized bilinearly in float, grey replicated),
    :func:`rgb_pixels` (``uint8``) for every other image."""
    from PIL import Image

    if not image.mode.startswith("I"):
        return rgb_pixels(image, size, where)
    check_image_size(image, where)
    values = np.asarray(image).astype(np.int64)
    if values.size and (values.min() < 0 or values.max() > MAX_16_BIT):
        raise DataError(f"{where} holds 32-bit integer pixels beyond 0..{MAX_16_BIT} ({int(values.min())} to "
                        f"{int(values.max())}); save it as an 8- or 16-bit image")
    if image.size != (size, size):
        resized = Image.fromarray(values.astype(np.float32)).resize((size, size), Image.Resampling.BILINEAR)
        values = np.clip(np.rint(np.asarray(resized)), 0, MAX_16_BIT)
    return np.broadcast_to(values.astype(np.uint16), (3, size, size)).copy()


def decode_file(path: Path, size: int, depth: bool = False) -> np.ndarray:
    """One image file as :func:`rgb_pixels` (``uint8``), or with ``depth`` as :func:`deep_pixels` (16-bit
    values kept); a file PIL cannot decode is a one-line DataError naming it."""
    from PIL import Image

    limit = max_image_pixels()
    try:
        with open_image(path, str(path), limit) as image:
            return deep_pixels(image, size, str(path)) if depth else rgb_pixels(image, size, str(path))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DataError(f"cannot decode the image {path} ({reason}); replace or remove the file") from None


def decode_files(files: Sequence[Path], size: int, cache: Path | None = None, progress: bool = False,
                 depth: bool = False) -> np.ndarray:
    """``N x 3 x size x size`` pixels of ``files`` (in order), from/into the cache folder ``cache``:
    ``uint8`` (16-bit images scaled to 8 bits), or with ``depth`` ``uint16`` when any image has more than 8
    bits (:func:`deep_pixels`; its 8-bit images then as ``x * 257``, their 16-bit equivalent) and ``uint8``
    when none has."""
    path = _cache_path(files, size, cache, depth) if cache is not None and files else None
    if path is not None and path.is_file():
        try:  # read within the bytes these files decode to: a cache file is input too (checked from its header)
            cached = load_npy(path, Bound(len(files) * 3 * size * size * 2, MAX_ARRAY_BYTES_VARIABLE))
            if cached.shape == (len(files), 3, size, size) and (
                    cached.dtype == np.uint8 or (depth and cached.dtype == np.uint16)):
                return cached
        except (OSError, ValueError, ArrayFileError):
            pass  # an unreadable or oversized cache file: decode again (and replace it)
    out = np.empty((len(files), 3, size, size), dtype=np.uint8)
    deep: dict[int, np.ndarray] = {}
    iterator: Any = files
    if progress and len(files) > 1000:
        from tqdm.auto import tqdm

        iterator = tqdm(files, desc=f"decoding images to {size}px", unit="img", leave=False)
    for i, file in enumerate(iterator):
        pixels = decode_file(Path(file), size, depth=True) if depth else decode_file(Path(file), size)
        if pixels.dtype == np.uint16:
            deep[i] = pixels
        else:
            out[i] = pixels
    if deep:
        wide = out.astype(np.uint16) * np.uint16(257)  # 8-bit x is x * 65535 / 255 in 16 bits, exactly
        for i, pixels in deep.items():
            wide[i] = pixels
        out = wide
    if path is not None:
        _save_atomic(path, out)
    return out


def detected_depth(arrays: Sequence[np.ndarray]) -> int | None:
    """The bit depth of a data set decoded with ``depth=True``: None when every array is ``uint8`` (8-bit
    images, scaled as they always were), else the smallest of :data:`BIT_DEPTHS` that holds the largest value
    of all of them (``uint8`` arrays counted as ``x * 257``)."""
    if not any(a.dtype == np.uint16 for a in arrays):
        return None
    largest = max((int(a.max()) * (257 if a.dtype == np.uint8 else 1) for a in arrays if a.size), default=0)
    return next(bits for bits in BIT_DEPTHS if largest <= 2 ** bits - 1)


def depth_note(arrays: Sequence[np.ndarray], bits: int, given: bool) -> str:
    """The run's note of how 16-bit pixels were scaled: the depth detected (or given) and the values seen."""
    deep = [a for a in arrays if a.size and a.dtype == np.uint16]
    low, high = min(int(a.min()) for a in deep), max(int(a.max()) for a in deep)
    scale = 2 ** bits - 1
    if given:
        how = "data.bit_depth"
    elif bits < 16:
        how = f"detected: every value of the data set within 0..{scale}; data.bit_depth=16 if they are dark " \
              "16-bit images"
    else:
        how = "detected"
    narrow = "; they span little of that range: data.standardize=federated may learn better" if (
        high - low) * 4 < scale and bits == 16 else ""
    return (f"16-bit images read as {bits}-bit ({how}; values {low}..{high}): pixels scaled by 1/{scale} to "
            f"[-1, 1], their precision kept{narrow}")


def to_float(pixels: np.ndarray, bits: int | None = None) -> Tensor:
    """``uint8`` ``N x 3 x H x W`` -> float32 in ``[-1, 1]`` (:func:`normalize_images`); ``uint16`` pixels
    (:func:`decode_files` with ``depth``) scaled by ``2**bits - 1`` (default 16 bits)."""
    if pixels.dtype != np.uint16:
        return normalize_images(torch.from_numpy(np.ascontiguousarray(pixels)))
    scale = 2 ** (bits or 16) - 1
    if pixels.size and int(pixels.max()) > scale:
        raise DataError(f"pixel values up to {int(pixels.max())} exceed {bits} bits (0..{scale}); set "
                        "data.bit_depth=16, or leave it unset to detect the depth")
    out = torch.from_numpy(pixels.astype(np.float32))
    return out.div_(scale / 2.0).sub_(1.0)


def _cache_path(files: Sequence[Path], size: int, cache: Path, depth: bool = False) -> Path | None:
    """The cache file of these files at this size: a key of every path, size, mtime, inode and ctime
    (:func:`fedhpro.data.loaders.files_key`); 16-bit values kept (``depth``) are cache format v2, keyed apart
    so that an 8-bit cache of the same files is never read as them."""
    salt = f"rgb bilinear bit-depth-scaled {size}\n" if not depth else f"v2 rgb bilinear 16-bit-kept {size}\n"
    key = files_key(files, salt)
    return cache / f"{key}-{size}px.npy" if key is not None else None


def _save_atomic(path: Path, array: np.ndarray) -> None:
    """Write ``array`` to ``path`` atomically (:func:`fedhpro.files.write_atomic_with`); give up quietly
    if it cannot."""
    try:
        write_atomic_with(path, lambda handle: np.save(handle, array, allow_pickle=False))
    except OSError:
        pass  # a read-only data folder: no cache


__all__ = ["BIT_DEPTHS", "CACHE_FOLDER", "MAX_16_BIT", "MAX_IMAGE_PIXELS", "MAX_PIXELS_VARIABLE", "SPLIT_NAMES",
           "check_image_size", "class_files", "decode_file", "decode_files", "deep_pixels", "depth_note",
           "detected_depth", "eight_bit", "image_files", "images_below", "is_image_file", "max_image_pixels",
           "open_image", "rgb_pixels", "split_folders", "subfolders", "to_float", "visible"]
