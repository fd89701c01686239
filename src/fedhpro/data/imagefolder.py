"""``dataset=imagefolder data_dir=PATH``: your images in torchvision's ImageFolder layout, split among K clients.

``PATH`` holds one of

* ``train/<class>/<image>`` and ``test/<class>/<image>`` (``val/`` is taken
  for ``test/``; without either, ``data.test_fraction`` of ``train/`` is held
  out);
* ``<class>/<image>``: one folder of class subfolders, with a seeded
  per-class held-out ``data.test_fraction`` as the test set;
* ``<domain>/...``: several domains, each subfolder one of the two layouts
  above (domain skew). Clients are spread over the domains:
  ``data.clients_per_domain`` (``{photos: 3, sketches: 2}``), else
  ``clients=K`` (default 10) round robin in sorted domain order; the label
  partition is applied within each domain's clients, and every domain keeps
  its own test set, so a run reports each domain's accuracy and their AVG.

The training images are split by ``partition=dirichlet`` (the default),
``nid2``, ``iid`` or ``longtail`` with the ``partition.*`` knobs (e.g.
``partition.alpha``). Class labels index the sorted union of the class
folder names of every domain and split. Images are decoded, resized to
``data.image_size`` and normalised to ``[-1, 1]`` by
:mod:`fedhpro.data.images` (cached in ``PATH/.fedhpro-cache``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedhpro.data.federation import Federation
from fedhpro.data.images import CACHE_FOLDER, class_files, decode_files, image_files, subfolders, to_float
from fedhpro.data.loaders import split_indices
from fedhpro.data.partition import (
    Partition,
    PartitionError,
    PartitionOptions,
    chosen_scheme,
    label_partition,
    within_domains,
)
from fedhpro.data.spec import DatasetSpec
from fedhpro.errors import ConfigError, DataError
from fedhpro.options import option

SCHEMES = ("dirichlet", "nid2", "iid", "longtail")
#: clients when neither ``clients=K`` nor ``data.clients_per_domain`` says (spread round robin over the domains)
DEFAULT_CLIENTS = 10


@dataclass
class ImageFolderOptions:
    """``data.*`` of ``dataset=imagefolder``."""

    image_size: int = option(32, min=1, help="side of the square images every image is resized to")
    test_fraction: float = option(0.2, gt=0.0, max=0.9, help="share of each class held out for testing where a "
                                                             "folder has no test/ split")
    split_seed: int = option(0, min=0, help="seed of that held-out split (fixed, not the run seed)")
    clients_per_domain: dict[str, int] = option(default_factory=dict,
                                                help="several domains: clients of each domain (default: clients=K, "
                                                     "else 10, spread round robin over the sorted domains)")
    cache: bool = option(True, help="keep the decoded pixels in data_dir/.fedhpro-cache (keyed by the files' "
                                    "names, sizes, mtimes, inodes and ctimes), so later runs skip decoding")


@dataclass
class DomainImages:
    """One domain's image files: training and test files with their class names."""

    train_files: list[Path]
    train_classes: list[str]
    test_files: list[Path]
    test_classes: list[str]
    held_out: bool  # the test files were held out of one folder with data.test_fraction


# --------------------------------------------------------------------------- the layout


def _layout(folder: Path) -> str | None:
    """``"split"`` (``train/``), ``"classes"`` (subfolders with images) or None (neither)."""
    if (folder / "train").is_dir():
        return "split"
    if any(image_files(sub) for sub in subfolders(folder)):
        return "classes"
    return None


def _flatten(classes: dict[str, list[Path]]) -> tuple[list[Path], list[str]]:
    files, names = [], []
    for name, paths in classes.items():
        files += paths
        names += [name] * len(paths)
    return files, names


def _domain_images(folder: Path, layout: str, options: ImageFolderOptions) -> tuple[DomainImages, set[str]]:
    """A domain's files (held-out split where it has no test folder) and every class folder name it has."""
    if layout == "split":
        train = class_files(folder / "train")
        test_folder = next((folder / s for s in ("test", "val") if (folder / s).is_dir()), None)
        test = class_files(test_folder) if test_folder is not None else None
    else:
        train, test = class_files(folder), None
    names = set(train) | set(test or {})
    if test is not None:
        return DomainImages(*_flatten(train), *_flatten(test), held_out=False), names
    files, labels = _flatten(train)
    order = {name: i for i, name in enumerate(sorted(names))}
    keep, held = split_indices(np.array([order[n] for n in labels], dtype=np.int64), options.test_fraction,
                               options.split_seed)
    return DomainImages([files[i] for i in keep], [labels[i] for i in keep], [files[i] for i in held],
                        [labels[i] for i in held], held_out=True), names


def discover(root: Path, options: ImageFolderOptions) -> tuple[dict[str, DomainImages], list[str]]:
    """``({domain: files}, classes)``: the domains of ``root`` (``""`` when it is one data set) and the sorted
    union of their class names; a folder that fits no layout is a one-line DataError."""
    layout = _layout(root)
    if layout is not None:
        images, names = _domain_images(root, layout, options)
        return {"": images}, sorted(names)
    candidates = [sub for sub in subfolders(root) if sub.name != CACHE_FOLDER]
    layouts = {sub: _layout(sub) for sub in candidates}
    domains = {sub: kind for sub, kind in layouts.items() if kind is not None}
    if not domains:
        raise DataError(f"{root} has no class subfolders (nor train/ or domain folders); put the images in "
                        f"{root}/<class>/, {root}/train/<class>/ and {root}/test/<class>/, or "
                        f"{root}/<domain>/<class>/")
    strays = [sub.name for sub, kind in layouts.items() if kind is None]
    if strays:
        raise DataError(f"{root}: the domain folders {strays} hold no class subfolders with images; fill them "
                        f"({root}/<domain>/<class>/<image>) or move them out of data_dir")
    found: dict[str, DomainImages] = {}
    classes: set[str] = set()
    for sub, kind in domains.items():
        found[sub.name], names = _domain_images(sub, kind, options)
        classes |= names
    return found, sorted(classes)


def _clients_layout(domains: list[str], clients: int | None, options: ImageFolderOptions) -> dict[str, int]:
    """Clients per domain: ``clients=K`` (or the default 10) round robin, else ``data.clients_per_domain``."""
    if clients is None and options.clients_per_domain:
        unknown = sorted(set(options.clients_per_domain) - set(domains))
        if unknown:
            raise ConfigError(f"data.clients_per_domain names unknown domains {unknown}; the domains are: "
                              f"{', '.join(domains)}")
        layout = {d: int(options.clients_per_domain.get(d, 0)) for d in domains}
        if any(n < 0 for n in layout.values()):
            raise ConfigError(f"data.clients_per_domain={dict(options.clients_per_domain)} has a negative count")
    else:
        layout = {d: 0 for d in domains}
        for k in range(clients if clients is not None else DEFAULT_CLIENTS):
            layout[domains[k % len(domains)]] += 1
    layout = {d: n for d, n in layout.items() if n > 0}
    if not layout:
        raise ConfigError("dataset=imagefolder needs at least one client; set clients=K or data.clients_per_domain")
    return layout


# --------------------------------------------------------------------------- the federation


def build(options: ImageFolderOptions, clients: int | None, seed: int, data_dir: Any = None,
          progress: bool = False, partition: PartitionOptions | None = None) -> Federation:
    """The federation: the training images split among the clients, test sets per domain (or ``all``)."""
    partition = partition or PartitionOptions()
    scheme = chosen_scheme(partition, "dirichlet", SCHEMES, "dataset=imagefolder",
                           " (several domains: the scheme is applied within each domain)")
    if not data_dir:
        raise ConfigError("dataset=imagefolder needs data_dir=PATH, the folder of class subfolders "
                          "(PATH/<class>/, PATH/train/<class>/ or PATH/<domain>/<class>/)")
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise DataError(f"data_dir={data_dir}: no such folder; give the folder of class subfolders")
    found, classes = discover(root, options)
    index = {name: label for label, name in enumerate(classes)}
    num_classes = len(classes)
    multi = "" not in found
    layout = _clients_layout(sorted(found), clients, options) if multi else {
        "": clients if clients is not None else DEFAULT_CLIENTS}
    size = int(options.image_size)
    cache = root / CACHE_FOLDER if options.cache else None
    labels = {d: np.array([index[n] for n in found[d].train_classes], dtype=np.int64) for d in found}
    _check_tests(found, layout, data_dir, options)
    split = _partition(partition, scheme, labels, layout, multi, seed, num_classes)
    used = [d for d in sorted(found) if d in set(split.client_domains or [""])]
    _check_tests(found, used, data_dir, options)
    train_pixels = {d: decode_files(found[d].train_files, size, cache, progress) for d in used}
    train = []
    for k, rows in enumerate(split.client_indices):
        domain = split.client_domains[k] if split.client_domains is not None else ""
        train.append((to_float(train_pixels[domain][rows]), torch.from_numpy(labels[domain][rows]).clone()))
    tests = {d or "all": (to_float(decode_files(found[d].test_files, size, cache, progress)),
                          torch.tensor([index[n] for n in found[d].test_classes], dtype=torch.int64)) for d in used}

    record = {"dataset": "imagefolder",
              **split.to_json(labels if multi else labels[""], num_classes,
                              partition.seed if partition.seed is not None else seed),
              "data_dir": str(root), "classes": classes, "image_size": size,
              "test_sizes": {name: int(y.shape[0]) for name, (_, y) in tests.items()}}
    if partition.load:
        record["loaded_from"] = str(partition.load)
    where = ", ".join(f"{d} {n}" for d, n in layout.items()) if multi else f"{layout['']}"
    notes = [f"imagefolder: {split.scheme} partition over {split.num_clients} clients ({where}), {num_classes} "
             f"classes, {size}x{size} images"]
    held = [d or "all" for d in used if found[d].held_out]
    if held:
        notes.append(f"test sets held out ({options.test_fraction:g} of each class, split_seed "
                     f"{options.split_seed}): {', '.join(held)}")
    domains = split.client_domains if split.client_domains is not None else None
    return Federation.from_tensors(train, tests, num_classes=num_classes, domains=domains, name="imagefolder",
                                   partition=record, notes=notes)


def _check_tests(found: dict[str, DomainImages], domains: Any, data_dir: Any, options: ImageFolderOptions) -> None:
    """Every domain that has clients needs test images."""
    empty = [d or "all" for d in domains if not found[d].test_files]
    if empty:
        raise DataError(f"{data_dir}: no test images for {', '.join(empty)} (data.test_fraction={options.test_fraction}"
                        " holds out none of so few images); add a test/<class>/ folder or raise data.test_fraction")


def _partition(options: PartitionOptions, scheme: str, labels: dict[str, np.ndarray], layout: dict[str, int],
               multi: bool, seed: int, num_classes: int) -> Partition:
    """The clients' training indices: drawn (within each domain when there are several) or loaded."""
    if options.load:
        path = Path(options.load).expanduser()
        if not path.is_file():
            raise ConfigError(f"partition.load={options.load!r}: no such file; give the partition.json of an "
                              "earlier run")
        split = Partition.load(path, num_samples={d: len(y) for d, y in labels.items()} if multi
                               else len(labels[""]))
        if multi and (split.client_domains is None or not set(split.client_domains) <= set(labels)):
            raise ConfigError(f"partition.load={options.load!r} does not name this data set's domains "
                              f"({', '.join(labels)}); give the partition.json of an earlier imagefolder run on it")
        if not multi and split.client_domains is not None:
            raise ConfigError(f"partition.load={options.load!r} has client domains, but {', '.join(labels)} is one "
                              "data set; give the partition.json of an earlier imagefolder run on it")
        return split
    rng = np.random.default_rng(seed if options.seed is None else options.seed)
    try:
        if multi:
            return within_domains(labels, layout, scheme, options, rng, num_classes)
        return label_partition(options, scheme, labels[""], layout[""], rng, num_classes)
    except PartitionError as error:
        raise ConfigError(f"dataset=imagefolder: {error}") from None


DATASET = DatasetSpec(
    name="imagefolder",
    options=ImageFolderOptions,
    build=build,
    description="your images in ImageFolder layout (data_dir=PATH: <class>/, train/ + test/, or <domain>/...), "
                "split by partition=dirichlet|nid2|iid|longtail",
)

__all__ = ["DATASET", "DEFAULT_CLIENTS", "DomainImages", "ImageFolderOptions", "build", "discover"]
