"""Image files of the user's own data sets (``dataset=clients``, ``imagefolder``, ``huggingface``) as tensors.

One decoding rule for all of them: PIL decodes the image, converts it to RGB
(grey replicated, alpha dropped), resizes it to ``size x size`` with PIL's
bilinear filter (deterministic: the same file gives the same pixels on every
machine) and :func:`~fedhpro.data.federation.normalize_images` maps the
``uint8`` pixels to ``[-1, 1]``.

Decoded ``uint8`` arrays can be cached in a ``.fedhpro-cache`` folder beside
the data, keyed by the image size and every file's path, size, mtime, inode
and ctime: a changed, added, removed or replaced file gives a new key. The
ctime is what closes the gap of a same-size rewrite whose mtime was put back
with ``os.utime``: the kernel sets the ctime to now on every write, rename
and ``utime``, and no call sets it back. (Only a clock turned back, or a
file system without ctime, could defeat it; delete the cache folder then.)
A folder that cannot be written is simply not cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedhpro.data.federation import normalize_images
from fedhpro.data.loaders import IMAGE_EXTENSIONS, files_key
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


def subfolders(folder: Path) -> list[Path]:
    """The non-hidden subfolders of ``folder``, sorted by name."""
    return sorted(p for p in folder.iterdir() if p.is_dir() and visible(p))


def class_files(root: Path) -> dict[str, list[Path]]:
    """ImageFolder layout ``root/<class>/<image>``: class name -> its image files (both sorted by name).

    Every non-hidden subfolder is a class, also one without images (it still
    names a label). Raises a one-line :class:`DataError` when ``root`` has no
    class subfolder or they hold no image.
    """
    classes = {folder.name: image_files(folder) for folder in subfolders(root)}
    if not classes:
        loose = " (the images lie directly in it)" if image_files(root) else ""
        raise DataError(f"{root} has no class subfolders{loose}; put each class's images in its own folder, "
                        f"{root}/<class>/<image>.png")
    if not any(classes.values()):
        raise DataError(f"the class folders of {root} hold no images ({', '.join(IMAGE_EXTENSIONS)}); "
                        f"put the images in {root}/<class>/")
    return classes


def rgb_pixels(image: Any, size: int) -> np.ndarray:
    """A PIL image -> ``uint8`` ``3 x size x size``: RGB, resized bilinearly when its size differs."""
    from PIL import Image

    image = image.convert("RGB")
    if image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.BILINEAR)
    return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)


def decode_file(path: Path, size: int) -> np.ndarray:
    """One image file as :func:`rgb_pixels`; a file PIL cannot decode is a one-line DataError naming it."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return rgb_pixels(image, size)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DataError(f"cannot decode the image {path} ({reason}); replace or remove the file") from None


def decode_files(files: Sequence[Path], size: int, cache: Path | None = None, progress: bool = False) -> np.ndarray:
    """``uint8`` ``N x 3 x size x size`` pixels of ``files`` (in order), from/into the cache folder ``cache``."""
    path = _cache_path(files, size, cache) if cache is not None and files else None
    if path is not None and path.is_file():
        try:
            cached = np.load(path, allow_pickle=False)
            if cached.shape == (len(files), 3, size, size) and cached.dtype == np.uint8:
                return cached
        except (OSError, ValueError):
            pass  # an unreadable cache file: decode again (and replace it)
    out = np.empty((len(files), 3, size, size), dtype=np.uint8)
    iterator: Any = files
    if progress and len(files) > 1000:
        from tqdm.auto import tqdm

        iterator = tqdm(files, desc=f"decoding images to {size}px", unit="img", leave=False)
    for i, file in enumerate(iterator):
        out[i] = decode_file(Path(file), size)
    if path is not None:
        _save_atomic(path, out)
    return out


def to_float(pixels: np.ndarray) -> Tensor:
    """``uint8`` ``N x 3 x H x W`` -> float32 in ``[-1, 1]`` (:func:`normalize_images`)."""
    return normalize_images(torch.from_numpy(np.ascontiguousarray(pixels)))


def _cache_path(files: Sequence[Path], size: int, cache: Path) -> Path | None:
    """The cache file of these files at this size: a key of every path, size, mtime, inode and ctime
    (:func:`fedhpro.data.loaders.files_key`)."""
    key = files_key(files, f"rgb bilinear {size}\n")
    return cache / f"{key}-{size}px.npy" if key is not None else None


def _save_atomic(path: Path, array: np.ndarray) -> None:
    """Write ``array`` to ``path`` atomically (:func:`fedhpro.files.write_atomic_with`); give up quietly
    if it cannot."""
    try:
        write_atomic_with(path, lambda handle: np.save(handle, array, allow_pickle=False))
    except OSError:
        pass  # a read-only data folder: no cache


__all__ = ["CACHE_FOLDER", "class_files", "decode_file", "decode_files", "image_files", "is_image_file",
           "rgb_pixels", "subfolders", "to_float", "visible"]
