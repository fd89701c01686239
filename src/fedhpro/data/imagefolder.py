"""``dataset=imagefolder data_dir=PATH``: your images in torchvision's ImageFolder layout, split among K clients.

``PATH`` holds one of

* ``train/<class>/<image>`` and ``test/<class>/<image>``. Split folders are
  matched without regard to case, in the usual spellings: ``train``/
  ``training``, ``test``/``testing``, ``val``/``valid``/``validation``
  (``Train/`` + ``Test/`` is a split, not two domains). ``val/`` is the test
  split where there is no ``test/``; beside a ``test/`` it is not used (and
  the run says so). Without either, ``data.test_fraction`` of ``train/`` is
  held out;
* ``<class>/<image>``: one folder of class subfolders, with a seeded
  per-class held-out ``data.test_fraction`` as the test set;
* ``<domain>/...``: several domains, each subfolder one of the two layouts
  above (domain skew); a folder is read as domains when none of its
  subfolders holds an image directly. Clients are spread over the domains:
  a domain named in ``data.clients_per_domain`` (``{photos: 3}``) gets that
  many clients (0 leaves it out); every other domain keeps what it gets
  without that setting: ``clients=K`` (default 10) less the named domains'
  clients, spread round robin over the unnamed domains in sorted order. The
  label partition is applied within each domain's clients, and every domain
  keeps its own test set, so a run reports each domain's accuracy and AVG.

A class's images are found at any depth below its folder
(``seven/batch2/*.png``), as torchvision's ``ImageFolder`` finds them. A class
folder without any image is no class (left out, with a note); classes
without test images, or with test images but no training image, are named in
the federation's ``notes``, and its first note says which folders became
which split and which domain.

The training images are split by ``partition=dirichlet`` (the default),
``nid2``, ``iid`` or ``longtail`` with the ``partition.*`` knobs (e.g.
``partition.alpha``). Class labels index the sorted union of the class
folder names (with images) of every domain and split. Images are decoded,
scaled by their bit depth, resized to ``data.image_size`` and normalised to
``[-1, 1]`` by :mod:`fedhpro.data.images` (cached in ``PATH/.fedhpro-cache``,
the one thing a run writes into ``PATH``). 16-bit grey images keep their
precision and are scaled by the bit depth of the whole data set, detected
(a 12-bit camera's 0..4095 in 16-bit PNGs is 12-bit) or given as
``data.bit_depth``, and the run's notes say which. ``data.standardize`` has
the tabular data's meaning per channel: ``federated`` standardises the inputs
per channel by the mean and standard deviation of every client's training
images pooled (``train`` is its former name), ``none`` (and ``auto``) keeps
the fixed ``[-1, 1]`` scaling; ``client`` is refused (the clients share their
domain's test set, which one scaling per client would not fit).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedhpro.data.clients import refuse_lookalikes
from fedhpro.data.decode_options import DETECTED, scaling_depth
from fedhpro.data.feature_statistics import CLIENT, FEDERATED, FORMER_FEDERATED, NONE
from fedhpro.data.federation import Federation, domains_without_clients_note
from fedhpro.data.imagefolder_options import DECLARATION, ImageFolderOptions
from fedhpro.data.images import (
    CACHE_FOLDER,
    class_files,
    decode_files,
    depth_note,
    detected_depth,
    image_files,
    images_below,
    split_folders,
    subfolders,
    to_float,
)
from fedhpro.data.loaders import split_indices
from fedhpro.data.partition import (
    Partition,
    PartitionError,
    PartitionOptions,
    chosen_scheme,
    label_partition,
    within_domains,
)
from fedhpro.data.spec import DatasetSpec, half_range_image
from fedhpro.errors import ConfigError, DataError

SCHEMES = ("dirichlet", "nid2", "iid", "longtail")
#: clients when neither ``clients=K`` nor ``data.clients_per_domain`` says (spread round robin over the domains)
DEFAULT_CLIENTS = 10


@dataclass
class DomainImages:
    """One domain's image files: training and test files with their class names."""

    train_files: list[Path]
    train_classes: list[str]
    test_files: list[Path]
    test_classes: list[str]
    held_out: bool  # the test files were held out of one folder with data.test_fraction
    #: which folders became which split, e.g. ``Train/ -> training, Test/ -> test`` (the start line says it)
    splits: str = ""
    #: what else the run should tell about this domain's folders (an unused validation/ folder, ...)
    notes: list[str] = field(default_factory=list)
    #: class folders without any image (in any split of this domain)
    empty: set[str] = field(default_factory=set)


# --------------------------------------------------------------------------- the layout


def _layout(folder: Path) -> str | None:
    """``"split"`` (a ``train/`` folder, any spelling of :data:`SPLIT_NAMES`), ``"classes"`` (subfolders
    holding images directly) or None (neither: domain folders, or nothing)."""
    splits = split_folders(folder)
    if "train" in splits:
        return "split"
    if splits:
        found = ", ".join(f"{path.name}/" for path in splits.values())
        raise DataError(f"{folder} has {found} but no train/ folder; put the training images in "
                        f"{folder}/train/<class>/ (or train/, training/ in any case)")
    if any(image_files(sub) for sub in subfolders(folder) if sub.name != CACHE_FOLDER):
        return "classes"
    return None


def _flatten(classes: dict[str, list[Path]]) -> tuple[list[Path], list[str]]:
    files, names = [], []
    for name, paths in classes.items():
        files += paths
        names += [name] * len(paths)
    return files, names


def _shown(path: Path, root: Path) -> str:
    """``path`` as the start line names it: below ``root`` (``photos/Train/``), or its name."""
    try:
        relative = path.relative_to(root)
    except ValueError:
        relative = Path(path.name)
    return f"{relative.as_posix()}/" if relative.parts else f"{root.name}/"


def _domain_images(folder: Path, layout: str, options: ImageFolderOptions, root: Path) -> DomainImages:
    """A domain's files (held-out split where it has no test folder); how its folders became splits."""
    notes: list[str] = []
    if layout == "split":
        splits = split_folders(folder)
        train = class_files(splits["train"])
        test_folder = splits.get("test", splits.get("val"))
        test = class_files(test_folder) if test_folder is not None else None
        if "test" in splits and "val" in splits:
            notes.append(f"{_shown(splits['val'], root)} is not used: {_shown(splits['test'], root)} is the test split "
                         "(validation images are neither trained nor tested on; move them into the training folder "
                         "to train on them)")
        others = [sub for sub in subfolders(folder) if sub not in splits.values() and sub.name != CACHE_FOLDER]
        if others:
            notes.append(f"{', '.join(_shown(sub, root) for sub in others)} ignored: beside "
                         f"{_shown(splits['train'], root)} only test/ and val/ folders are read")
        described = f"{_shown(splits['train'], root)} -> training, " + (
            f"{_shown(test_folder, root)} -> test" if test_folder is not None
            else f"{options.test_fraction:g} of each class held out -> test")
    else:
        train, test = class_files(folder), None
        described = (f"{_shown(folder, root)}<class>/ -> training, {options.test_fraction:g} of each class held out "
                     "-> test")
    empty = {name for name, files in train.items() if not files} | {name for name, files in (test or {}).items()
                                                                      if not files}
    empty -= {name for name, files in [*train.items(), *(test or {}).items()] if files}
    if test is not None:
        return DomainImages(*_flatten(train), *_flatten(test), held_out=False, splits=described, notes=notes,
                            empty=empty)
    files, labels = _flatten(train)
    order = {name: i for i, name in enumerate(sorted(set(labels)))}
    keep, held = split_indices(np.array([order[n] for n in labels], dtype=np.int64), options.test_fraction,
                               options.split_seed)
    return DomainImages([files[i] for i in keep], [labels[i] for i in keep], [files[i] for i in held],
                        [labels[i] for i in held], held_out=True, splits=described, notes=notes, empty=empty)


def discover(root: Path, options: ImageFolderOptions) -> tuple[dict[str, DomainImages], list[str]]:
    """``({domain: files}, classes)``: the domains of ``root`` (``""`` when it is one data set) and the sorted
    union of their classes that hold images (a class folder without any image is no class); a folder that
    fits no layout is a one-line DataError."""
    layout = _layout(root)
    if layout is not None:
        found = {"": _domain_images(root, layout, options, root)}
    else:
        candidates = [sub for sub in subfolders(root) if sub.name != CACHE_FOLDER]
        layouts = {sub: _layout(sub) for sub in candidates}
        domains = {sub: kind for sub, kind in layouts.items() if kind is not None}
        if not domains:
            nested = " (images in nested folders count only below a class folder: <class>/<any>/<image>)" if any(
                images_below(sub) for sub in candidates) else ""
            raise DataError(f"{root} has no class subfolders (nor train/ or domain folders){nested}; put the images "
                            f"in {root}/<class>/, {root}/train/<class>/ and {root}/test/<class>/, or "
                            f"{root}/<domain>/<class>/")
        strays = [sub.name for sub, kind in layouts.items() if kind is None]
        if strays:
            raise DataError(f"{root}: the domain folders {strays} hold no class subfolders with images; fill them "
                            f"({root}/<domain>/<class>/<image>) or move them out of data_dir")
        found = {sub.name: _domain_images(sub, kind, options, root) for sub, kind in domains.items()}
    classes = {name for images in found.values() for name in (*images.train_classes, *images.test_classes)}
    # "Blue Square" beside "blue square" would silently be two classes (and two domains likewise)
    refuse_lookalikes(sorted(classes), "class folders", "rename one of them so that every class has one spelling")
    refuse_lookalikes(sorted(found), "domain folders", "rename one of them so that every domain has one spelling")
    return found, sorted(classes)


def _clients_layout(domains: list[str], clients: int | None, options: ImageFolderOptions) -> dict[str, int]:
    """Clients per domain: a domain ``data.clients_per_domain`` names gets its count;
    the others get what they get without it: ``clients=K`` less the named domains' clients (else
    :data:`DEFAULT_CLIENTS`) spread round robin over them, in sorted order. Too few clients leave the last
    domains without one, as on the built-in domain data sets (the build notes it:
    :func:`~fedhpro.data.federation.domains_without_clients_note`)."""
    given = dict(options.clients_per_domain)
    unknown = sorted(set(given) - set(domains))
    if unknown:
        raise ConfigError(f"data.clients_per_domain names unknown domains {unknown}; the domains are: "
                          f"{', '.join(domains)}")
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in given.values()):
        raise ConfigError(f"data.clients_per_domain={given} must give each domain a whole number >= 0 of clients "
                          "(0 leaves a domain out)")
    rest = [d for d in domains if d not in given]
    named = sum(given.values())
    if clients is None:
        spread = _round_robin(domains, DEFAULT_CLIENTS)
        layout = {d: given[d] if d in given else spread[d] for d in domains}
    elif not rest:
        if clients != named:
            raise ConfigError(f"clients={clients} but data.clients_per_domain gives every domain its clients, "
                              f"{named} in all; leave clients unset or make them agree")
        layout = dict(given)
    else:
        layout = {**given, **_round_robin(rest, max(clients - named, 0))}
    layout = {d: int(layout[d]) for d in domains if layout[d] > 0}
    if not layout:
        raise ConfigError("dataset=imagefolder needs at least one client; set clients=K or data.clients_per_domain")
    return layout


def _round_robin(domains: list[str], clients: int) -> dict[str, int]:
    """``clients`` spread over ``domains`` round robin: the first ``clients mod len(domains)`` get one more."""
    return {d: clients // len(domains) + (1 if i < clients % len(domains) else 0) for i, d in enumerate(domains)}


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
    standardize = {"auto": NONE, FORMER_FEDERATED: FEDERATED}.get(options.standardize, options.standardize)
    if standardize == CLIENT:
        raise ConfigError("data.standardize=client scales each site's own tabular features; image-folder clients "
                          "share their domain's test set, which one scaling per client would not fit: use "
                          "data.standardize=federated (every client's training images pooled) or none")
    found, classes = discover(root, options)
    index = {name: label for label, name in enumerate(classes)}
    num_classes = len(classes)
    multi = "" not in found
    if not multi and options.clients_per_domain:
        raise ConfigError(f"data.clients_per_domain applies to several domains, but {root} is one data set (no "
                          "domain folders); set clients=K instead")
    layout = _clients_layout(sorted(found), clients, options) if multi else {
        "": clients if clients is not None else DEFAULT_CLIENTS}
    size = int(options.image_size)
    cache = root / CACHE_FOLDER if options.cache else None
    labels = {d: np.array([index[n] for n in found[d].train_classes], dtype=np.int64) for d in found}
    _check_tests(found, layout, data_dir, options)
    split = _partition(partition, scheme, labels, layout, multi, seed, num_classes)
    used = [d for d in sorted(found) if d in set(split.client_domains or [""])]
    _check_tests(found, used, data_dir, options)
    train_pixels = {d: decode_files(found[d].train_files, size, cache, progress, depth=True) for d in used}
    test_pixels = {d: decode_files(found[d].test_files, size, cache, progress, depth=True) for d in used}
    # one depth for the whole data set (training and test images, every domain): a depth per image would
    # stretch a dark 16-bit image as if it were a bright 12-bit one
    arrays = [*train_pixels.values(), *test_pixels.values()]
    detected = detected_depth(arrays)
    bits = scaling_depth(options.bit_depth, detected)
    depth_notes = []
    if detected is not None and bits is not None:
        depth_notes.append(f"imagefolder: {depth_note(arrays, bits, options.bit_depth != DETECTED)}")
    elif options.bit_depth != DETECTED:
        depth_notes.append(f"imagefolder: data.bit_depth={options.bit_depth} not used: every image is 8-bit")
    train = []
    for k, rows in enumerate(split.client_indices):
        domain = split.client_domains[k] if split.client_domains is not None else ""
        train.append((to_float(train_pixels[domain][rows], bits), torch.from_numpy(labels[domain][rows]).clone()))
    tests = {d or "all": (to_float(test_pixels[d], bits),
                          torch.tensor([index[n] for n in found[d].test_classes], dtype=torch.int64)) for d in used}
    statistics = None
    if standardize == FEDERATED:
        statistics = _standardize(train, tests)
        depth_notes.append(statistics.pop("note"))

    record = {"dataset": "imagefolder",
              **split.to_json(labels if multi else labels[""], num_classes,
                              partition.seed if partition.seed is not None else seed),
              "data_dir": str(root), "classes": classes, "image_size": size,
              "test_sizes": {name: int(y.shape[0]) for name, (_, y) in tests.items()}}
    if partition.load:
        record["loaded_from"] = str(partition.load)
    if detected is not None:  # how a new 16-bit image must be scaled to be what the model learned on
        record["bit_depth"] = int(bits or 16)
    if statistics is not None:
        record["standardize"] = statistics
    where = ", ".join(f"{d} {n}" for d, n in layout.items()) if multi else f"{layout['']}"
    notes = [_start_line(root, found, used),
             f"imagefolder: {split.scheme} partition over {split.num_clients} clients ({where}), {num_classes} "
             f"classes, {size}x{size} images"]
    held = [d or "all" for d in used if found[d].held_out]
    if held:
        notes.append(f"test sets held out ({options.test_fraction:g} of each class, split_seed "
                     f"{options.split_seed}): {', '.join(held)}")
    notes += _class_notes(found, used, classes) + depth_notes
    if multi:  # a domain too few clients left without one: said, never silent (the built-in data sets' rule)
        dropped = domains_without_clients_note("imagefolder", sorted(found), layout, clients,
                                               [d for d, n in options.clients_per_domain.items() if n == 0])
        notes += [dropped] if dropped else []
    domains = split.client_domains if split.client_domains is not None else None
    return Federation.from_tensors(train, tests, num_classes=num_classes, domains=domains, name="imagefolder",
                                   partition=record, notes=notes)


def _standardize(train: list[tuple[torch.Tensor, torch.Tensor]],
                 tests: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """``data.standardize=federated``: every input, training and test, as ``(x - mean) / std`` per channel,
    with the statistics of every client's training images pooled (each client's count, sum and sum of
    squares per channel, in float64); in place. Returns the statistics in ``0..1`` units (torchvision's
    ``Normalize`` of pixels in ``0..1``) and the run's note."""
    total, squares, count = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), 0
    for images, _ in train:
        for start in range(0, len(images), 4096):  # in chunks: no float64 copy of a client's images at once
            chunk = images[start:start + 4096].double()
            total += chunk.sum(dim=(0, 2, 3))
            squares += chunk.square().sum(dim=(0, 2, 3))
            count += chunk.shape[0] * chunk.shape[2] * chunk.shape[3]
    mean = total / max(count, 1)
    std = ((squares - count * mean.square()).clamp(min=0) / max(count - 1, 1)).sqrt()
    std = torch.where(std > 1e-12, std, torch.ones_like(std))  # a constant channel is only centred
    shape = (1, -1, 1, 1)
    for t in [x for x, _ in train] + [x for x, _ in tests.values()]:
        t.sub_(mean.float().view(shape)).div_(std.float().view(shape))
    # x in [-1, 1] is 2p - 1 for p in 0..1: (x - m) / s = (p - (m + 1) / 2) / (s / 2)
    unit_mean, unit_std = ((mean + 1) / 2).tolist(), (std / 2).tolist()
    shown = ", ".join(f"{m:.4g}/{s:.4g}" for m, s in zip(unit_mean, unit_std, strict=True))
    note = (f"imagefolder: inputs standardised per channel (data.standardize=federated) by the mean/std of the "
            f"{sum(len(images) for images, _ in train)} training images of every client pooled, of pixels in "
            f"0..1: {shown}")
    return {"mean": unit_mean, "std": unit_std, "note": note}


def _start_line(root: Path, found: dict[str, DomainImages], used: list[str]) -> str:
    """The one line that says which folders became which split and which domain."""
    if "" in found:
        return f"imagefolder: {root}: {found[''].splits}; one data set, no domains"
    parts = [f"{d} ({found[d].splits})" if d in used else f"{d} (no clients: left out)" for d in sorted(found)]
    return f"imagefolder: {root}: {len(found)} domains: " + "; ".join(parts)


def _class_notes(found: dict[str, DomainImages], used: list[str], classes: list[str]) -> list[str]:
    """What the run must tell about the classes: class folders without images (no class), classes without
    test images (their accuracy is not measured) or without training images (never learned), and every
    folder note of the domains (an unused validation/ folder, ignored folders)."""
    notes = [f"imagefolder: {note}" for d in sorted(found) for note in found[d].notes]
    empty = sorted(set().union(*(found[d].empty for d in found)) - set(classes))
    if empty:
        notes.append(f"imagefolder: class folders without images left out (no class): {', '.join(empty)}")
    untested = {d or "all": sorted(set(found[d].train_classes) - set(found[d].test_classes)) for d in used}
    untested = {d: names for d, names in untested.items() if names}
    if untested:
        listed = "; ".join(f"{d}: {', '.join(n)}" if len(untested) > 1 or d != "all" else ", ".join(n)
                           for d, n in untested.items())
        notes.append(f"imagefolder: classes without test images (their accuracy is not measured): {listed}")
    trained = {name for d in used for name in found[d].train_classes}
    never = sorted({name for d in used for name in found[d].test_classes} - trained)
    if never:
        notes.append(f"imagefolder: classes with test images but no training image (never learned): "
                     f"{', '.join(never)}")
    return notes


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


def image_input(options: ImageFolderOptions, partition: Mapping[str, Any], size: int) -> dict[str, Any]:
    """A new image as this data set's input: resized to ``size``, scaled to [-1, 1] as the run's partition.json
    recorded: by its bit depth (16-bit images by ``2**bits - 1``) and, with ``data.standardize=federated``, by the
    training images' per-channel mean and std (of pixels in 0..1), which a new image must get too."""
    image = half_range_image("imagefolder", size, resize=True)
    if isinstance(partition.get("bit_depth"), int):
        image["bit_depth"] = int(partition["bit_depth"])
    standardize = partition.get("standardize")
    if isinstance(standardize, Mapping):
        image["standardize"] = {"mean": list(standardize.get("mean", [])), "std": list(standardize.get("std", []))}
    return image


DATASET = DatasetSpec.of(DECLARATION, build, image_input)

__all__ = ["DATASET", "DEFAULT_CLIENTS", "DomainImages", "ImageFolderOptions", "build", "discover"]
