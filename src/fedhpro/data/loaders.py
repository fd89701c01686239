"""Loaders for the paper's real data sets, torchvision-style, registered by name in :data:`LOADERS`.

Each loader is a ``torch.utils.data.Dataset`` taking ``root`` (the folder the
data set lives in), ``train``, ``transform`` and, where a public download
exists, ``download``. ``mnist``, ``usps``, ``svhn``, ``cifar10``,
``cifar100`` and ``sun397`` are torchvision's own classes; the others read
their usual on-disk layouts:

==================  ==========================================================================
name                files under ``root`` (``root`` = ``<data_dir>/<folder>``)
==================  ==========================================================================
``mnist``           ``MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`` (torchvision)
``usps``            ``usps.bz2``, ``usps.t.bz2`` (libsvm format, torchvision)
``svhn``            ``train_32x32.mat``, ``test_32x32.mat`` (torchvision)
``cifar10``         ``cifar-10-batches-py/`` (torchvision)
``cifar100``        ``cifar-100-python/`` (torchvision)
``sun397``          ``SUN397/ClassName.txt`` and ``SUN397/<letter>/<class>/sun_*.jpg`` (torchvision)
``syn``             ``train/<digit>/*.png`` and ``val/<digit>/*.png`` (``test/`` is accepted for
                    ``val/``): the layout of the Digits domain-skew code (FedBN / FPL / RethinkFL)
``office-caltech``  ``office_caltech_10/{amazon,caltech,dslr,webcam}/<class>/*.jpg``
``tinyimagenet``    ``tiny-imagenet-200/{wnids.txt, train/<wnid>/images/*.JPEG,
                    val/images/*.JPEG, val/val_annotations.txt}`` (the official zip)
``ham10000``        ``HAM10000_metadata.csv`` and ``<image_id>.jpg`` anywhere below ``root``
                    (e.g. the official ``HAM10000_images_part_1/`` and ``_part_2/``)
``ag_news``         ``train.csv``, ``test.csv`` (class 1-4, title, description; no header)
==================  ==========================================================================

The files already on disk are checked against torchvision's published md5
where it lists one for the files read (CIFAR-10/100's batches and meta,
SVHN's ``.mat``); a mismatch is a one-line DataError naming the file.
``data.verify=false`` skips that check for a copy you made yourself (a
re-packed or subsampled set). Either way no data file is unpickled with
``pickle.load``: CIFAR's pickles are read by an unpickler that builds only
numpy arrays, lists, strings and numbers, so a tampered file cannot run
code; MNIST, USPS and SUN397 hold no pickles.
A missing data set raises :class:`~fedhpro.errors.DataError` with one line
naming the folder and how to get the data.

:func:`image_arrays` turns a loader into ``uint8`` ``N x C x H x W`` arrays:
the torchvision sets hold their pixels in memory already; image-file sets are
decoded once, at one size, into a memory-mapped ``.npy`` cache beside the data
(``<root>/.fedhpro-cache/``), so later runs read only the samples they use.
The cache key covers every file's path, size, mtime, inode and ctime
(:func:`files_key`): a replaced or rewritten image gives a new key.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import pickle
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch.utils.data import Dataset

from fedhpro.data.pixels import open_image
from fedhpro.errors import DataError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".tif", ".tiff", ".webp")


def _pil_rgb(path: str | os.PathLike) -> Any:
    with open_image(path) as image:  # its pixel count checked before it is decoded
        return image.convert("RGB")


def _images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


class _SVHNLabels(Protocol):
    """torchvision's SVHN: its pixels in ``data`` and its labels in ``labels`` (not ``targets``)."""

    labels: Sequence[int] | np.ndarray


class _SUN397Files(Protocol):
    """torchvision's SUN397: its image paths and labels, in attributes private to torchvision."""

    _image_files: Sequence[Path]
    _labels: Sequence[int]


class _LabelledFiles(Protocol):
    """An image-file data set (:class:`_FileImages`): its image paths and their labels."""

    files: Sequence[Path]
    targets: Sequence[int]


class _FileImages(Dataset):
    """A list of (image file, label); images are opened on access (lazy)."""

    files: list[Path]
    targets: list[int]
    classes: list[str]
    transform: Callable | None

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        image = _pil_rgb(self.files[index])
        if self.transform is not None:
            image = self.transform(image)
        return image, self.targets[index]


def _class_folders(root: Path, what: str) -> tuple[list[str], list[Path], list[int]]:
    """ImageFolder layout ``root/<class>/*.<image>``: classes sorted by name, files sorted per class."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    files, targets = [], []
    for label, name in enumerate(classes):
        for path in _images_in(root / name):
            files.append(path)
            targets.append(label)
    if not files:
        raise DataError(f"{what}: no images under {root} (expected {root}/<class>/*.jpg)")
    return classes, files, targets


class SynDigits(_FileImages):
    """SYN (synthetic digits, Ganin & Lempitsky) in the layout of the Digits domain-skew code.

    ``root/train/<digit>/*.png`` and ``root/val/<digit>/*.png`` (``test/`` is
    accepted instead of ``val/``); class folders are ``0`` ... ``9``.
    """

    def __init__(self, root: str | os.PathLike, train: bool = True, transform: Callable | None = None):
        root = Path(root)
        split = "train" if train else next((s for s in ("val", "test") if (root / s).is_dir()), "val")
        folder = root / split
        if not folder.is_dir():
            raise missing("syn", root)
        self.classes, self.files, self.targets = _class_folders(folder, "syn")
        if self.classes != [str(d) for d in range(10)]:
            raise DataError(f"syn: the class folders of {folder} are {self.classes}; expected 0 ... 9")
        self.transform = transform


class OfficeCaltech(_FileImages):
    """Office-Caltech-10, one domain: ``root/office_caltech_10/<domain>/<class>/*.jpg``.

    There is no official train/test split: :attr:`train` selects the
    training or test part of a split drawn per class with ``split_seed``
    (``test_fraction`` of each class held out), the same on every machine.
    """

    DOMAINS = ("amazon", "caltech", "dslr", "webcam")

    def __init__(self, root: str | os.PathLike, domain: str, train: bool = True, transform: Callable | None = None,
                 test_fraction: float = 0.3, split_seed: int = 0):
        if domain not in self.DOMAINS:
            raise DataError(f"office-caltech: unknown domain {domain!r}; the domains are {', '.join(self.DOMAINS)}")
        folder = Path(root) / "office_caltech_10" / domain
        if not folder.is_dir():
            raise missing("office-caltech", Path(root))
        self.classes, files, targets = _class_folders(folder, f"office-caltech/{domain}")
        keep = split_indices(np.asarray(targets), test_fraction, split_seed)[0 if train else 1]
        self.files = [files[i] for i in keep]
        self.targets = [targets[i] for i in keep]
        self.transform = transform


class TinyImageNet(_FileImages):
    """TinyImageNet-200 in the official layout (``root`` = the ``tiny-imagenet-200`` folder).

    Train: ``train/<wnid>/images/*.JPEG``; test (the official validation set,
    10,000 images): ``val/images/*.JPEG`` labelled by ``val/val_annotations.txt``.
    Labels index the sorted ``wnids.txt``.
    """

    def __init__(self, root: str | os.PathLike, train: bool = True, transform: Callable | None = None):
        root = Path(root)
        if not (root / "wnids.txt").is_file():
            raise missing("tinyimagenet", root)
        self.classes = sorted(line.strip() for line in (root / "wnids.txt").read_text().splitlines() if line.strip())
        index = {wnid: i for i, wnid in enumerate(self.classes)}
        self.files, self.targets = [], []
        if train:
            for wnid in self.classes:
                for path in _images_in(root / "train" / wnid / "images"):
                    self.files.append(path)
                    self.targets.append(index[wnid])
        else:
            annotations = root / "val" / "val_annotations.txt"
            if not annotations.is_file():
                raise missing("tinyimagenet", root)
            for line in annotations.read_text().splitlines():
                parts = line.split("\t")
                if len(parts) < 2:
                    continue
                if parts[1] not in index:
                    raise DataError(f"tinyimagenet: {annotations} labels {parts[0]} with {parts[1]}, "
                                    "which is not in wnids.txt")
                self.files.append(root / "val" / "images" / parts[0])
                self.targets.append(index[parts[1]])
        if not self.files:
            raise DataError(f"tinyimagenet: no {'training' if train else 'validation'} images under {root}")
        self.transform = transform


class HAM10000(_FileImages):
    """HAM10000 skin lesions (7 classes): ``root/HAM10000_metadata.csv`` plus ``<image_id>.jpg`` below ``root``.

    The metadata's ``dx`` column is the label (classes sorted: akiec, bcc,
    bkl, df, mel, nv, vasc). No official split: a per-class split with
    ``test_fraction`` (0.11, about the paper's 8,912 / 1,103) and ``split_seed``.
    """

    CLASSES = ("akiec", "bcc", "bkl", "df", "mel", "nv", "vasc")

    def __init__(self, root: str | os.PathLike, train: bool = True, transform: Callable | None = None,
                 test_fraction: float = 0.11, split_seed: int = 0):
        root = Path(root)
        metadata = root / "HAM10000_metadata.csv"
        if not metadata.is_file():
            raise missing("ham10000", root)
        found = {p.stem: p for p in root.rglob("*.jpg")}
        files, targets = [], []
        with metadata.open(newline="") as handle:
            for row in csv.DictReader(handle):
                image_id, dx = row.get("image_id"), row.get("dx")
                if dx not in self.CLASSES:
                    raise DataError(f"ham10000: {metadata} has dx={dx!r}; expected one of {', '.join(self.CLASSES)}")
                if image_id not in found:
                    raise DataError(f"ham10000: {metadata} lists {image_id} but {image_id}.jpg is not below {root}")
                files.append(found[image_id])
                targets.append(self.CLASSES.index(dx))
        self.classes = list(self.CLASSES)
        keep = split_indices(np.asarray(targets), test_fraction, split_seed)[0 if train else 1]
        self.files = [files[i] for i in keep]
        self.targets = [targets[i] for i in keep]
        self.transform = transform


_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")


def tokenize(text: str) -> list[str]:
    """Lower-case words and numbers (``"U.S. stocks' rally"`` -> ``["u", "s", "stocks", "rally"]``)."""
    return _TOKEN.findall(text.lower().replace("#39;", "'"))  # AG News writes ' as the bare entity #39;


class AGNews(Dataset):
    """AG News (Zhang et al., 2015): ``root/train.csv`` and ``root/test.csv`` rows ``class, title, description``.

    Classes 1-4 become 0-3 (World, Sports, Business, Sci/Tech). Text is
    ``title + " " + description``, tokenised by :func:`tokenize`, mapped
    through ``vocab`` (default: built from the training split by
    :func:`build_vocab`; 0 = padding, 1 = unknown) and cut or padded to
    ``max_length``. ``tokens`` is an ``N x max_length`` LongTensor.
    """

    CLASSES = ("World", "Sports", "Business", "Sci/Tech")

    def __init__(self, root: str | os.PathLike, train: bool = True, max_length: int = 256, vocab_size: int = 30000,
                 vocab: dict[str, int] | None = None, transform: Callable | None = None):
        root = Path(root)
        if vocab is None:
            vocab = build_vocab(read_ag_news(root, True)[0], vocab_size)
        texts, labels = read_ag_news(root, train)
        self.vocab = vocab
        self.classes = list(self.CLASSES)
        self.tokens = encode(texts, vocab, max_length)
        self.targets = torch.as_tensor(labels, dtype=torch.int64)
        self.transform = transform

    def __len__(self) -> int:
        return int(self.targets.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        tokens = self.tokens[index]
        return (self.transform(tokens) if self.transform else tokens), int(self.targets[index])


def read_ag_news(root: Path, train: bool) -> tuple[list[str], list[int]]:
    path = root / ("train.csv" if train else "test.csv")
    if not path.is_file():
        raise missing("ag_news", root)
    texts, labels = [], []
    with path.open(newline="", encoding="utf-8") as handle:
        for line, row in enumerate(csv.reader(handle), start=1):
            if not row:
                continue
            try:
                label = int(row[0])
            except ValueError:
                if line == 1:  # a header row
                    continue
                raise DataError(f"ag_news: {path} line {line}: class {row[0]!r} is not a number 1-4") from None
            if not 1 <= label <= 4 or len(row) < 3:
                raise DataError(f"ag_news: {path} line {line}: expected class 1-4, title, description")
            texts.append(f"{row[1]} {row[2]}")
            labels.append(label - 1)
    return texts, labels


def build_vocab(texts: Sequence[str], vocab_size: int) -> dict[str, int]:
    """The ``vocab_size - 2`` most frequent tokens of ``texts`` -> ids 2...; ties broken alphabetically."""
    counts = Counter(token for text in texts for token in tokenize(text))
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:max(vocab_size - 2, 0)]
    return {token: i + 2 for i, (token, _) in enumerate(ranked)}


def encode(texts: Sequence[str], vocab: dict[str, int], max_length: int) -> torch.Tensor:
    """Token ids (unknown -> 1), cut to ``max_length``, padded with 0."""
    out = torch.zeros(len(texts), max_length, dtype=torch.int64)
    for row, text in enumerate(texts):
        ids = [vocab.get(token, 1) for token in tokenize(text)][:max_length]
        if ids:
            out[row, :len(ids)] = torch.as_tensor(ids)
    return out


def split_indices(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A per-class (stratified) train/test split: ``round(test_fraction * n_c)`` of each class to test."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        index = rng.permutation(np.flatnonzero(labels == c))
        cut = int(round(test_fraction * len(index)))
        test.append(index[:cut])
        train.append(index[cut:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


# --------------------------------------------------------------------------- torchvision's classes


#: the globals a CIFAR pickle may name: numpy's array reconstruction, nothing else. The official files
#: (Python 2 pickles, protocol 2) name ``numpy.core.multiarray._reconstruct``, ``numpy.ndarray`` and
#: ``numpy.dtype``; a copy pickled again under numpy 2 names ``numpy._core.multiarray._reconstruct``, and
#: one pickled with protocol 5 names ``numpy._core.numeric._frombuffer`` (``numpy.core`` before numpy 2), and
#: Python 3's protocol 2 spells bytes as ``_codecs.encode(text, "latin1")`` (admitted for latin-1 only).
_PICKLE_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): ("multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"): ("multiarray", "_reconstruct"),
    ("numpy.core.numeric", "_frombuffer"): ("numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"): ("numeric", "_frombuffer"),
    ("numpy", "ndarray"): (None, "ndarray"),
    ("numpy", "dtype"): (None, "dtype"),
    ("_codecs", "encode"): ("codecs", "encode"),  # Python 3's protocol 2 writes bytes as encode(text, "latin1")
}


def _latin1(text: str, encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles use it (text to latin-1 bytes); any other codec is refused."""
    if not isinstance(text, str) or encoding != "latin1":
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r}")
    return text.encode("latin1")


def _numpy_global(module: str, name: str) -> Any:
    """The numpy function or class ``_PICKLE_GLOBALS`` admits, from where this numpy keeps it."""
    import importlib

    where, attribute = _PICKLE_GLOBALS[(module, name)]
    if where == "codecs":
        return _latin1
    if where is None:
        return getattr(np, attribute)
    for package in ("numpy._core", "numpy.core"):  # numpy >= 2, then numpy 1
        try:
            return getattr(importlib.import_module(f"{package}.{where}"), attribute)
        except (ImportError, AttributeError):
            continue
    raise pickle.UnpicklingError(f"this numpy has no {module}.{name}")


class _ArrayUnpickler(pickle.Unpickler):
    """An unpickler that builds only dicts, lists, strings, numbers and numpy arrays (:data:`_PICKLE_GLOBALS`).

    Any other global (``os.system``, ``builtins.eval``, ``subprocess.Popen``,
    ...) is refused before it is looked up: a tampered file cannot run code.
    """

    def __init__(self, handle: Any, path: str, what: str):
        super().__init__(handle, encoding="latin1")
        self.path, self.what = path, what

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PICKLE_GLOBALS:
            return _numpy_global(module, name)
        raise DataError(f"{self.what}: {self.path} is not a data file: its pickle calls {module}.{name}, which a "
                        "data set never needs (refused, nothing was run); delete the folder and download again")


def read_pickle(path: str | os.PathLike, what: str) -> Any:
    """The object pickled in ``path``, read by :class:`_ArrayUnpickler`; any failure is one DataError."""
    try:
        with open(path, "rb") as handle:  # read whole: a corrupt length cannot make the unpickler allocate it
            data = handle.read()
        return _ArrayUnpickler(io.BytesIO(data), str(path), what).load()
    except DataError:
        raise
    except FileNotFoundError:
        raise
    except Exception as error:  # noqa: BLE001 - a truncated or malformed pickle raises many types; one line
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DataError(f"{what}: cannot read {path} ({type(error).__name__}: {reason}); delete the folder and "
                        "download again") from None


def file_md5(path: str | os.PathLike) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_file(path: str | os.PathLike, md5: str, what: str) -> None:
    """Raise a one-line DataError when ``path`` does not have torchvision's published ``md5``."""
    if file_md5(path) != md5:
        raise DataError(f"{what}: file {path} does not match torchvision's published checksum; delete the folder "
                        "and download again (data.download=true), or set data.verify=false for a copy you "
                        "made yourself")


class _CIFAR(Dataset):
    """CIFAR-10/100 from torchvision's ``cifar-10-batches-py`` / ``cifar-100-python`` folder, read safely.

    torchvision's file list, checksums and download are used; its
    ``pickle.load`` is not. With ``verify`` (the default) every file read
    must match torchvision's published md5 before it is opened; every pickle
    is then read by :class:`_ArrayUnpickler` (numpy arrays, lists, strings
    only), so even an unverified copy (``data.verify=false``) cannot run
    code. ``data``, ``targets``, ``classes`` and item access are torchvision's.
    """

    def __init__(self, parent: Any, name: str, root: str, train: bool = True, transform: Callable | None = None,
                 download: bool = False, verify: bool = True):
        self.root, self.train, self.transform, self.name = root, train, transform, name
        folder = os.path.join(root, parent.base_folder)
        files = [(n, md5) for n, md5 in (parent.train_list if train else parent.test_list)]
        meta = (parent.meta["filename"], parent.meta["md5"])
        every = [(n, md5) for n, md5 in parent.train_list + parent.test_list] + [meta]
        if download and not all(self._intact(folder, n, md5, verify) for n, md5 in every):
            from torchvision.datasets import cifar

            cifar.download_and_extract_archive(parent.url, root, filename=parent.filename, md5=parent.tgz_md5)
        if not all(os.path.isfile(os.path.join(folder, n)) for n, _ in files + [meta]):
            raise RuntimeError("Dataset not found")
        if verify:
            for n, md5 in files + [meta]:
                verify_file(os.path.join(folder, n), md5, name)
        data, targets = [], []
        for n, _ in files:
            path = os.path.join(folder, n)
            entry = read_pickle(path, name)
            key = "labels" if isinstance(entry, dict) and "labels" in entry else "fine_labels"
            if not isinstance(entry, dict) or "data" not in entry or key not in entry:
                raise DataError(f"{name}: {path} holds no 'data' and '{key}'; delete the folder and download again")
            pixels, labels = np.asarray(entry["data"]), entry[key]
            if (pixels.dtype != np.uint8 or pixels.ndim != 2 or pixels.shape[1] != 3 * 32 * 32
                    or not isinstance(labels, list) or len(labels) != pixels.shape[0]
                    or not all(type(v) is int and 0 <= v < (100 if "100" in name else 10) for v in labels)):
                raise DataError(f"{name}: {path} does not hold N x 3072 uint8 pixels and N labels in range; delete "
                                "the folder and download again")
            data.append(pixels)
            targets.extend(labels)
        self.data = np.vstack(data).reshape(-1, 3, 32, 32).transpose((0, 2, 3, 1))  # N x H x W x C, as torchvision
        self.targets = targets
        path = os.path.join(folder, meta[0])
        classes = read_pickle(path, name)
        classes = classes.get(parent.meta["key"]) if isinstance(classes, dict) else None
        if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
            raise DataError(f"{name}: {path} holds no list of class names; delete the folder and download again")
        self.classes = classes
        self.class_to_idx = {c: i for i, c in enumerate(classes)}

    @staticmethod
    def _intact(folder: str, name: str, md5: str, verify: bool) -> bool:
        path = os.path.join(folder, name)
        return os.path.isfile(path) and (not verify or file_md5(path) == md5)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        from PIL import Image

        image = Image.fromarray(self.data[index])
        if self.transform is not None:
            image = self.transform(image)
        return image, self.targets[index]


def _torchvision(name: str, verify: bool = True) -> Callable[..., Dataset]:
    """torchvision's class (or, for CIFAR, :class:`_CIFAR`) for ``name``; with ``verify`` the CIFAR and SVHN
    files must match torchvision's published md5 (MNIST, USPS and SUN397 hold no pickles: read as torchvision
    reads them)."""
    from torchvision import datasets

    if name == "mnist":
        return lambda root, train=True, transform=None, download=False: datasets.MNIST(
            root, train=train, transform=transform, download=download)
    if name == "usps":
        return lambda root, train=True, transform=None, download=False: datasets.USPS(
            root, train=train, transform=transform, download=download)
    if name == "sun397":
        return lambda root, train=True, transform=None, download=False: datasets.SUN397(
            root, transform=transform, download=download)

    if name == "svhn":
        def checked(self: Any) -> bool:  # scipy's loadmat reads the .mat (no pickle); the checksum is ours
            path = os.path.join(self.root, self.filename)
            if not os.path.isfile(path):
                return False
            if verify:
                verify_file(path, self.split_list[self.split][2], "svhn")
            return True

        svhn = type("SVHN", (datasets.SVHN,), {"_check_integrity": checked})
        return lambda root, train=True, transform=None, download=False: svhn(
            root, split="train" if train else "test", transform=transform, download=download)

    parent = datasets.CIFAR10 if name == "cifar10" else datasets.CIFAR100
    return lambda root, train=True, transform=None, download=False: _CIFAR(
        parent, name, root, train=train, transform=transform, download=download, verify=verify)


# --------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Preset:
    """A source's transform as the paper applies it: square ``size``, 3 channels, per-channel normalisation."""

    size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


HALF = (0.5, 0.5, 0.5)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class LoaderSpec:
    """A registered loader: where its files go, what they look like, how to get them, and (images) its preset."""

    name: str
    open: Callable[..., Dataset]  # (root, train=True, transform=None, download=False, **options) -> Dataset
    folder: str  # subfolder of the data root
    layout: str  # the files expected under <data_dir>/<folder>
    source: str  # where to get it
    download: bool = False  # torchvision can fetch it (data.download=true)
    #: an image source's size and channel statistics (fedhpro.data.benchmarks.PRESETS); None for text
    preset: Preset | None = None


def _lazy_torchvision(name: str) -> Callable[..., Dataset]:
    def open_(root: str | os.PathLike, train: bool = True, transform: Callable | None = None,
              download: bool = False, verify: bool = True) -> Dataset:
        return _torchvision(name, verify)(str(root), train=train, transform=transform, download=download)

    return open_


#: a new source is one line here (with its preset: the paper's image size and the usual channel statistics)
LOADERS: dict[str, LoaderSpec] = {spec.name: spec for spec in (
    # Digits: 32 x 32 RGB in [-1, 1], as the Digits domain-skew code (and digits-offline)
    LoaderSpec("mnist", _lazy_torchvision("mnist"), "mnist", "MNIST/raw/*-ubyte", "torchvision", True,
               Preset(32, HALF, HALF)),
    LoaderSpec("usps", _lazy_torchvision("usps"), "usps", "usps.bz2 and usps.t.bz2", "torchvision", True,
               Preset(32, HALF, HALF)),
    LoaderSpec("svhn", _lazy_torchvision("svhn"), "svhn", "train_32x32.mat and test_32x32.mat", "torchvision", True,
               Preset(32, HALF, HALF)),
    LoaderSpec("cifar10", _lazy_torchvision("cifar10"), "cifar10", "cifar-10-batches-py/", "torchvision", True,
               Preset(32, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))),
    LoaderSpec("cifar100", _lazy_torchvision("cifar100"), "cifar100", "cifar-100-python/", "torchvision", True,
               Preset(32, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))),
    # the paper does not give SUN397's size; 64 px keeps 108k images in a few GB (data.image_size=224 for more)
    LoaderSpec("sun397", _lazy_torchvision("sun397"), "sun397", "SUN397/ClassName.txt and SUN397/<letter>/<class>/",
               "torchvision (37 GB)", True, Preset(64, IMAGENET_MEAN, IMAGENET_STD)),
    LoaderSpec("syn", SynDigits, "syn", "train/<0-9>/*.png and val/<0-9>/*.png",
               "the SynDigits images of the FedBN/FPL Digits release (e.g. its syn/ folder)",
               preset=Preset(32, HALF, HALF)),
    LoaderSpec("office-caltech", OfficeCaltech, "", "office_caltech_10/{amazon,caltech,dslr,webcam}/<class>/*.jpg",
               "the Office-Caltech-10 release (Gong et al., 2012)", preset=Preset(32, IMAGENET_MEAN, IMAGENET_STD)),
    LoaderSpec("tinyimagenet", TinyImageNet, "tiny-imagenet-200",
               "wnids.txt, train/<wnid>/images/, val/images/ and val/val_annotations.txt",
               "http://cs231n.stanford.edu/tiny-imagenet-200.zip (unzip into the data folder)",
               preset=Preset(64, (0.4802, 0.4481, 0.3975), (0.2302, 0.2265, 0.2262))),
    LoaderSpec("ham10000", HAM10000, "ham10000", "HAM10000_metadata.csv and the <image_id>.jpg files",
               "https://doi.org/10.7910/DVN/DBW86T (Harvard Dataverse)",
               preset=Preset(224, IMAGENET_MEAN, IMAGENET_STD)),
    LoaderSpec("ag_news", AGNews, "ag_news", "train.csv and test.csv (class, title, description)",
               "the ag_news_csv release of Zhang et al. (2015), e.g. from the fastText/torchtext mirrors"),
)}


def missing(name: str, folder: Path) -> DataError:
    """The one-line error for a data set that is not where it was looked for."""
    spec = LOADERS[name]
    if spec.download:
        how = "add data.download=true to fetch it with torchvision, or put the files there"
    else:
        how = f"get it from {spec.source} (no automatic download)"
    holds = spec.folder or spec.layout.split("/")[0]
    return DataError(f"{name}: data not found in {folder} (expected {spec.layout}); {how}, "
                     f"or set data_dir= to the folder that holds {holds}/")


def open_loader(name: str, data_dir: Path, train: bool, download: bool = False, **options: Any) -> Dataset:
    """Open the registered loader ``name`` under ``data_dir``; a missing data set raises a one-line DataError."""
    spec = LOADERS[name]
    root = data_dir / spec.folder if spec.folder else data_dir
    kwargs = dict(options)
    if spec.download:
        kwargs["download"] = download
        if download:
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise DataError(f"{name}: cannot create {root} ({error.strerror or error}); "
                                "set data_dir= to a writable folder") from None
    try:
        return spec.open(root, train=train, **kwargs)
    except DataError:
        raise
    except RuntimeError as error:  # torchvision: "Dataset not found ..."
        if download:
            raise DataError(f"{name}: download into {root} failed ({error}); check the network or fetch the files "
                            f"by hand (expected {spec.layout})") from None
        raise missing(name, root) from None
    except (OSError, ValueError) as error:
        if download and ("urlopen" in repr(error) or "URLError" in type(error).__name__):
            raise DataError(f"{name}: download into {root} failed ({error}); fetch the files by hand "
                            f"(expected {spec.layout})") from None
        if isinstance(error, FileNotFoundError):
            raise missing(name, root) from None
        raise DataError(f"{name}: cannot read the data in {root} ({error}); expected {spec.layout}") from None


# --------------------------------------------------------------------------- pixels as arrays


def image_arrays(dataset: Dataset, size: int | None = None, cache: Path | None = None,
                 progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(images, labels)``: ``uint8`` ``N x C x H x W`` (C = 1 or 3) and ``int64`` ``N``.

    torchvision's MNIST/USPS/SVHN/CIFAR already hold their pixels: they are
    returned as they are (resizing happens later, on the samples used). An
    image-file data set is decoded to ``size x size`` RGB; with ``cache`` the
    array is written once to that ``.npy`` (atomically) and memory-mapped, so
    a large set is never held in memory twice and later runs skip decoding.
    """
    data = getattr(dataset, "data", None)
    if data is not None and not isinstance(dataset, _FileImages):
        array = data.numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
        labels = getattr(dataset, "targets", None)
        if labels is None:
            labels = cast(_SVHNLabels, dataset).labels
        labels = np.asarray(labels.numpy() if isinstance(labels, torch.Tensor) else labels, dtype=np.int64)
        if array.ndim == 3:  # MNIST, USPS: N x H x W
            array = array[:, None]
        elif array.shape[-1] == 3 and array.shape[1] != 3:  # CIFAR: N x H x W x C
            array = array.transpose(0, 3, 1, 2)
        return np.ascontiguousarray(array, dtype=np.uint8), labels
    if getattr(dataset, "files", None) is None:  # torchvision's SUN397
        sun397 = cast(_SUN397Files, dataset)
        files = list(sun397._image_files)
        labels = np.asarray(sun397._labels, dtype=np.int64)
    else:
        listed = cast(_LabelledFiles, dataset)
        files = list(listed.files)
        labels = np.asarray(listed.targets, dtype=np.int64)
    if size is None:
        raise ValueError("image_arrays: an image-file data set needs a size")
    key = files_key(files) if cache is not None else None
    path = cache / f"{key}-{size}px.npy" if cache is not None and key is not None else None
    if path is not None and path.is_file():
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
            if array.shape == (len(files), 3, size, size) and array.dtype == np.uint8:
                return array, labels
        except (OSError, ValueError):
            pass  # an unreadable cache file: decode again (and replace it)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return _decode_to(path, files, size, progress), labels
        except OSError:
            pass  # a read-only data folder: decode into memory instead
    out = np.empty((len(files), 3, size, size), dtype=np.uint8)
    _decode_into(out, files, size, progress)
    return out, labels


def _decode_into(out: np.ndarray, files: Sequence[Path], size: int, progress: bool) -> None:
    from PIL import Image

    iterator: Any = files
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(files, desc=f"decoding images to {size}px", unit="img", leave=False)
    for i, path in enumerate(iterator):
        try:
            image = _pil_rgb(path)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise DataError(f"cannot decode the image {path} ({reason}); replace or remove the file") from None
        if image.size != (size, size):
            image = image.resize((size, size), Image.Resampling.BILINEAR)
        out[i] = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)


def _decode_to(path: Path, files: Sequence[Path], size: int, progress: bool) -> np.ndarray:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp.npy")
    try:
        out = np.lib.format.open_memmap(temporary, mode="w+", dtype=np.uint8, shape=(len(files), 3, size, size))
        _decode_into(out, files, size, progress)
        out.flush()
        del out
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()
    return np.load(path, mmap_mode="r", allow_pickle=False)


#: a file whose ctime is this close to now (ns) is keyed by its bytes too: file systems stamp times from a
#: coarse clock (a few ms), so two writes within one tick could otherwise leave every time unchanged
RECENT_NS = 2_000_000_000


def file_identity(path: str | os.PathLike, now_ns: int | None = None) -> str:
    """What changes whenever a file's bytes do: its path, size, mtime, inode and ctime (ns).

    ``os.utime`` can put an mtime back but not the ctime (the kernel sets it
    to now on every write, rename and ``utime``), and a file replaced by
    another has a new inode: a rewritten image never keeps its key. A file
    changed within :data:`RECENT_NS` of ``now_ns`` is keyed by a hash of its
    bytes as well, which closes the one gap left (a second write within the
    same tick of the file system's clock).
    """
    stat = os.stat(path)
    identity = f"{os.path.abspath(path)}\t{stat.st_size}\t{stat.st_mtime_ns}\t{stat.st_ino}\t{stat.st_ctime_ns}"
    now = time.time_ns() if now_ns is None else now_ns
    if now - stat.st_ctime_ns < RECENT_NS:
        with open(path, "rb") as handle:
            identity += "\t" + hashlib.sha1(handle.read(), usedforsecurity=False).hexdigest()
    return identity


def files_key(files: Sequence[str | os.PathLike], salt: str = "") -> str | None:
    """A 16-hex-digit key of ``files`` (in order) by :func:`file_identity`; None when one cannot be read."""
    digest = hashlib.sha1(salt.encode(), usedforsecurity=False)
    now = time.time_ns()
    for file in files:
        try:
            digest.update(f"{file_identity(file, now)}\n".encode())
        except OSError:
            return None  # decoding will name the file
    return digest.hexdigest()[:16]


__all__ = ["AGNews", "HAM10000", "LOADERS", "LoaderSpec", "OfficeCaltech", "Preset", "SynDigits", "TinyImageNet",
           "build_vocab", "encode", "file_identity", "files_key", "image_arrays", "missing", "open_loader",
           "read_pickle", "split_indices", "tokenize", "verify_file"]
