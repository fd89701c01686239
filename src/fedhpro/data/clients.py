"""``dataset=clients data_dir=PATH``: a federation that arrives split, one folder per client, as real sites hold data.

Every non-hidden subfolder of ``PATH`` is a client; clients are ordered by
folder name. A client folder holds either

* images: ``train/<class>/<image>`` and, optionally, ``test/<class>/<image>``
  (split folders in any case and the usual spellings: ``Train/``,
  ``training/``; ``val/``/``validation/`` is the test split where there is
  no ``test/``; images found at any depth below a class folder; decoded and
  normalised by :mod:`fedhpro.data.images` at ``data.image_size``), or
* tensors: ``train.pt``, ``train.npz`` or ``train.csv`` and, optionally,
  ``test.pt``, ``test.npz`` or ``test.csv``, each holding ``x`` (N x F
  features, or any N x ...) and ``y`` (N integer labels): ``np.savez(path,
  x=x, y=y)`` or ``torch.save({"x": x, "y": y}, path)``; a CSV (read by
  :mod:`fedhpro.data.tables`) holds a label column (``data.label_column``,
  default ``label``) of class indices or class names, every other column a
  numeric feature (float32). Float ``N x F`` features are standardised by default
  (``data.standardize=client``): each client scales every feature by its own
  training mean and std, the statistics a site may compute without sharing
  anything, and applies the same map to its test data;
  ``data.standardize=none`` keeps them as saved.

A client without a test split is not tested: it has no accuracy of its own
and is named in the federation's ``notes`` (:func:`client_notes`); so are
class folders without images (no class) and classes no client has a test
image of.

A client's domain is the stripped text of ``<client>/domain.txt`` if present,
else the prefix of a folder named ``<prefix>-<digits>`` or
``<prefix>_<digits>`` (``mnist-0`` -> ``mnist``), else none. Evaluation is
federated: each client tests on its own split, and the counts are pooled per
domain (clients without one: ``all``); AVG is the unweighted mean over those
test sets, which a note says (:func:`~fedhpro.data.federation.avg_note`).

Labels of image clients: the class names of ``data.classes`` (in label
order), else the ``classes.txt`` the clients carry (one name a line; all
that carry one must agree), else the sorted union of every client's class
folders, so clients with different classes share one label space. Tensor
clients' labels are the integers in ``y``; ``num_classes`` is
``data.num_classes``, else the largest label + 1. Labels given as names (a
CSV's label column of text) are classes as image folders are: ``data.classes``
(in label order), else ``classes.txt``, else the sorted union of every
client's names; every client must then name its labels.

``data_dir`` may also be one table of several sites (:func:`build`): a CSV
file with a site column (``data.site_column``, default ``site``) and a split
column (``data.split_column``, default ``split``: ``train`` or ``test`` per
row), or a folder holding ``train.csv`` and, optionally, ``test.csv``, each
with the site column. Sites are then ordered by name as client folders are,
and each one's domain is the ``<prefix>`` of a name ``<prefix>-<digits>``.

The same functions serve a Flower node, which holds only its own folder:
:func:`scan_client` (cheap, JSON-able with :func:`dataclasses.asdict`), then
:func:`resolve_classes` over every client's :class:`ClientInfo`, then
:func:`load_client`, which gives the same tensors as client k of
:func:`build`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedhpro.data.client_scaling import (
    applied_mode,
    apply_statistics,
    feature_statistics,
    federation_scaling,
    given_scaling,
    scales,
    skewed_scaling_warning,
    standardized,
)
from fedhpro.data.clients_options import DECLARATION, UNTRAINED_CHOICES, ClientsOptions
from fedhpro.data.decode_options import DETECTED, scaling_depth
from fedhpro.data.feature_statistics import (
    CLIENT,
    FEDERATED,
    STANDARDIZE_CHOICES,
    FeatureSums,
    feature_sums,
)
from fedhpro.data.federation import Federation, avg_note, untested_domains_note, untested_note
from fedhpro.data.images import (
    CACHE_FOLDER,
    class_files,
    decode_files,
    detected_depth,
    split_folders,
    subfolders,
    to_float,
)
from fedhpro.data.spec import DatasetSpec, half_range_image
from fedhpro.data.tables import (
    SiteRows,
    close_name,
    close_path,
    frame_rows,
    is_table,
    label_names,
    name_codes,
    read_csv,
    read_csv_header,
    table_sites,
)
from fedhpro.data.tensor_files import as_float, read_tensor_file, rows_tensors
from fedhpro.errors import ConfigError, DataError

#: ``<prefix>-<digits>`` or ``<prefix>_<digits>``: the prefix is the client's domain
_NUMBERED = re.compile(r"^(?P<prefix>.+)[-_]\d+$")
TENSOR_SUFFIXES = (".pt", ".npz", ".csv")


@dataclass
class ClientInfo:
    """What one client folder holds, found without decoding an image; JSON-able with :func:`dataclasses.asdict`."""

    name: str  # the folder's name
    domain: str | None
    kind: str  # "images" or "tensors"
    class_names: list[str] | None  # image clients: the class folders under train/ and test/, sorted
    declared_classes: list[str] | None  # the folder's classes.txt, if any
    max_label: int | None  # tensor clients: the largest label in train/test (None if empty)
    input_shape: list[int]  # images: [3, S, S] with S = data.image_size; tensors: x.shape[1:]
    train_size: int
    test_size: int
    # the classes with samples in each split (class names, or labels by index as text): what tells a class
    # some site tests but no site trains (data.untrained_classes) where the sites are apart (Flower)
    train_classes: list[str] | None = None
    test_classes: list[str] | None = None


# --------------------------------------------------------------------------- one folder


def client_domain(folder: Path) -> str | None:
    """``domain.txt`` (stripped) if present, else the ``<prefix>`` of ``<prefix>-<digits>``, else None."""
    declared = folder / "domain.txt"
    if declared.is_file():
        return _read_text(declared).strip() or None
    match = _NUMBERED.match(folder.name)
    return match.group("prefix") if match else None


def scan_client(folder: str | Path, options: ClientsOptions) -> ClientInfo:
    """What client folder ``folder`` holds (its kind, classes, sizes, shape); decodes no image."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "no such folder"
        raise DataError(f"client folder {folder}: {what}; give the folder that holds the client's train/ images or "
                        f"train.pt/train.npz/train.csv{_did_you_mean_path(folder)}")
    kind = _kind(folder)
    declared = _declared_classes(folder)
    if kind == "images":
        splits = _image_splits(folder)
        names = sorted({name for classes in splits.values() for name, files in classes.items() if files})
        size = int(options.image_size)
        train, test = ([name for name, files in sorted(splits.get(split, {}).items()) if files]
                       for split in ("train", "test"))
        return ClientInfo(folder.name, client_domain(folder), "images", names, declared, None, [3, size, size],
                          sum(len(files) for files in splits.get("train", {}).values()),
                          sum(len(files) for files in splits.get("test", {}).values()), train, test)
    pairs = {split: _read_split(path, options) for split, path in _tensor_files(folder).items()}
    shapes = {split: list(x.shape[1:]) for split, (x, _) in pairs.items()}
    if len({tuple(s) for s in shapes.values()}) > 1:
        raise DataError(f"client folder {folder}: train and test inputs differ in shape ({shapes['train']} vs "
                        f"{shapes['test']}); give both the same features")
    class_names, max_label = _label_summary(folder.name, [labels for _, labels in pairs.values()])
    sizes = {split: int(pairs[split][1].shape[0]) if split in pairs else 0 for split in ("train", "test")}
    held = {split: split_classes(pairs[split][1]) if split in pairs else [] for split in ("train", "test")}
    return ClientInfo(folder.name, client_domain(folder), "tensors", class_names, declared, max_label,
                      shapes["train"], sizes["train"], sizes["test"], held["train"], held["test"])


def split_classes(labels: Tensor | np.ndarray) -> list[str]:
    """The classes one split's labels hold, as :class:`ClientInfo` names them: the sorted names, or the
    labels by index as text in their order (``"0"``, ``"2"``)."""
    if isinstance(labels, np.ndarray):
        return label_names(labels) if len(labels) else []
    return [str(label) for label in torch.unique(labels).tolist()]


def _read_split(path: Path, options: ClientsOptions) -> tuple[Tensor, Tensor | np.ndarray]:
    """``(x, labels)`` of one split file: a ``.csv``'s rows (labels: int64 class indices, or the names of an
    object array), else a tensor file's ``x`` and ``y``."""
    if path.suffix != ".csv":
        return read_tensor_file(path, options.max_classes)
    return rows_tensors(frame_rows(read_csv(path), f"client {path.parent.name}: {path}", options.label_column),
                         options.max_classes)


def _label_summary(name: str, labels: Sequence[Tensor | np.ndarray]) -> tuple[list[str] | None, int | None]:
    """``(class names, largest label)`` of one client's splits: the sorted names where its labels are names,
    else None and its largest integer label (None: no rows); one DataError line if the splits mix both."""
    present = [values for values in labels if len(values)]  # a split without rows names nothing
    named = [values for values in present if isinstance(values, np.ndarray)]
    if named and len(named) != len(present):
        raise DataError(f"client {name}: its train and test labels mix class names and class indices; give both "
                        "splits' labels the same way (names such as 'benign', or integers 0..C-1)")
    if named:
        return label_names(np.concatenate(named)), None
    found = [y for y in labels if isinstance(y, Tensor) and y.numel()]
    return None, (max(int(y.max()) for y in found) if found else None)


def resolve_classes(infos: Sequence[ClientInfo], options: ClientsOptions) -> list[str]:
    """The federation's class names in label order (tensor clients without names: ``"0"`` ... ``"C-1"``).

    Raises a one-line :class:`DataError` naming the clients that disagree:
    mixed kinds, different input shapes, different ``classes.txt``, a class
    folder or label outside the declared classes.
    """
    if not infos:
        raise DataError("no client folders; give data_dir= a folder with one subfolder per client")
    _check_bounds(infos, options)
    refuse_lookalikes([info.name for info in infos], "client folders", "rename one of the folders")
    kinds = _group(infos, lambda info: info.kind)
    if len(kinds) > 1:
        raise DataError("the clients mix image folders and tensor files (" + _listing(kinds) + "); give every "
                        "client the same kind of data")
    shapes = _group(infos, lambda info: str(list(info.input_shape)))
    if len(shapes) > 1:
        raise DataError("the clients' inputs differ in shape (" + _listing(shapes) + "); give every client the "
                        "same features")
    declared = _group([i for i in infos if i.declared_classes is not None], lambda i: str(i.declared_classes))
    if len(declared) > 1 and options.classes is None:
        raise DataError("the clients' classes.txt files differ (" + _listing(declared) + "); give every client the "
                        "same class list (or set data.classes)")
    names: list[str] | None = None
    source = "the class folders"
    if options.classes is not None:
        names = [str(c) for c in options.classes]
        source = "data.classes"
    elif declared:
        names = next(i.declared_classes for i in infos if i.declared_classes is not None)
        source = "classes.txt"
    if names is not None:
        repeated = sorted({c for c in names if names.count(c) > 1})
        if repeated or not names:
            raise DataError(f"{source} {'repeats the classes ' + str(repeated) if repeated else 'is empty'}; "
                            "list every class once, in label order")
        refuse_lookalikes(names, source, "list every class once, in one spelling")
    if infos[0].kind == "images":
        return _named_classes(infos, names, source, options, IMAGE_CLASSES)
    named = [info for info in infos if info.class_names is not None]
    if named:
        return _named_labels(infos, named, names, source, options)
    if names is not None and options.num_classes is not None and options.num_classes != len(names):
        raise ConfigError(f"data.num_classes={options.num_classes} but {source} names {len(names)} classes; "
                          "set one of them")
    num_classes = len(names) if names is not None else options.num_classes
    found = [i.max_label for i in infos if i.max_label is not None]
    if num_classes is None:
        num_classes = max(found) + 1 if found else 1
    too_large = [i for i in infos if i.max_label is not None and i.max_label >= num_classes]
    if too_large:
        limit = source if names is not None else f"data.num_classes={num_classes}"
        raise DataError("labels out of range: " + ", ".join(f"client {i.name} (its train/test .pt/.npz) has label "
                                                              f"{i.max_label}" for i in too_large)
                        + f", but {limit} allows 0..{num_classes - 1}; fix the labels or raise the class count")
    return names if names is not None else [str(c) for c in range(num_classes)]


def _named_labels(infos: Sequence[ClientInfo], named: Sequence[ClientInfo], names: list[str] | None, source: str,
                  options: ClientsOptions) -> list[str]:
    """The classes of tensor clients whose labels are names (a CSV's label column of text): ``names`` (from
    data.classes or classes.txt), else the sorted union of the clients' names, as image clients' folders."""
    unnamed = [info.name for info in infos if info.class_names is None and info.max_label is not None]
    if unnamed:
        raise DataError(f"clients {', '.join(i.name for i in named)} name their labels (such as "
                        f"{(named[0].class_names or ['?'])[0]!r}) but {', '.join(unnamed)} give class indices; give "
                        "every client's labels the same way")
    return _named_classes(named, names, source, options, LABEL_CLASSES)


@dataclass(frozen=True)
class _ClassWords:
    """How the messages of :func:`_named_classes` name a kind of client's classes and their fixes."""

    what: str  # what holds the names: "class folders", "label"
    spelling_fix: str
    found: str  # the union's source when nothing lists the classes
    unknown: str  # "has {unknown} ..."
    unknown_fix: str
    counted: str  # "data.num_classes=N but {counted} N classes"
    union_check: bool  # the listed names and the found ones must not be two spellings of one class


IMAGE_CLASSES = _ClassWords("class folders", "rename one of them (the same class needs one spelling on every client)",
                            "the class folders", "class folders", "rename the folders", "the image clients have",
                            True)
LABEL_CLASSES = _ClassWords("label", "give each class one spelling on every client", "the labels", "labels",
                            "fix the labels", "the clients' labels name", False)


def _named_classes(named: Sequence[ClientInfo], names: list[str] | None, source: str, options: ClientsOptions,
                   words: _ClassWords) -> list[str]:
    """The classes of clients that name theirs (image class folders, tables' label names): ``names`` (from
    data.classes or classes.txt), else the sorted union of the clients' names; one DataError line for two
    spellings of one class, or a client naming a class ``names`` does not list; a ConfigError line for a
    ``data.num_classes`` other than their count."""
    where = {c: info.name for info in named for c in info.class_names or []}
    refuse_lookalikes(sorted(where), words.what, words.spelling_fix, where=lambda c: f"client {where[c]}")
    if names is None:
        names, source = sorted(where), words.found
    if words.union_check:
        refuse_lookalikes(sorted(set(names) | set(where)), f"{source} and the class folders",
                          "give each class one spelling everywhere",
                          where=lambda c: f"client {where[c]}" if c in where else source)
    for info in named:
        unknown = sorted(set(info.class_names or []) - set(names))
        if unknown:
            raise DataError(f"client {info.name} has {words.unknown} {unknown[:10]} that {source} does not list"
                            f"{_did_you_mean(unknown, names)}; add them to it or {words.unknown_fix}")
    if options.num_classes is not None and options.num_classes != len(names):
        raise ConfigError(f"data.num_classes={options.num_classes} but {words.counted} {len(names)} classes "
                          f"({', '.join(names[:20])}); leave data.num_classes unset or list the classes in "
                          "data.classes")
    return names


def folded(name: str) -> str:
    """``name`` as two spellings of one name compare: case-folded, runs of whitespace made one space, stripped."""
    return " ".join(name.casefold().split())


def refuse_lookalikes(names: Sequence[str], what: str, fix: str, where: Any = None) -> None:
    """One DataError line if two different ``names`` are one name up to case and whitespace (:func:`folded`):
    they would silently become two classes (or two sites). ``where(name)`` says where a spelling comes from."""
    seen: dict[str, str] = {}
    for name in names:
        other = seen.setdefault(folded(name), name)
        if other != name:
            def shown(n: str) -> str:
                return f"{n!r} ({where(n)})" if where is not None else repr(n)

            raise DataError(f"the {what} name {shown(other)} and {shown(name)}, which differ only in case or "
                            f"whitespace and would be two different ones; {fix}")


def _check_bounds(infos: Sequence[ClientInfo], options: ClientsOptions) -> None:
    """Refuse, before anything of that size is built, a class count above ``data.max_classes``: a label, a
    class list, ``data.num_classes`` or ``data.classes`` (a node's description may come from anywhere)."""
    limit = int(options.max_classes)
    fix = ("fix the labels, or, if the data really has that many classes, raise data.max_classes (and set "
           "data.num_classes)")
    if options.num_classes is not None and options.num_classes > limit:
        raise ConfigError(f"data.num_classes={options.num_classes} is above data.max_classes={limit}; raise "
                          "data.max_classes too if the data really has that many classes")
    if options.classes is not None and len(options.classes) > limit:
        raise ConfigError(f"data.classes lists {len(options.classes)} classes, above data.max_classes={limit}; "
                          "raise data.max_classes if the data really has that many classes")
    for info in infos:
        label = info.max_label
        if label is not None and (type(label) is not int or not 0 <= label < limit):
            what = (f"label {label}" if type(label) is int else f"a label of type {type(label).__name__}")
            raise DataError(f"client {info.name}: its train/test .pt/.npz has {what}, outside 0..{limit - 1} "
                            f"(data.max_classes={limit}); {fix}")
        for kind, names in (("class folders", info.class_names), ("classes.txt", info.declared_classes)):
            if names is not None and len(names) > limit:
                raise DataError(f"client {info.name}: its {kind} name {len(names)} classes, above "
                                f"data.max_classes={limit}; raise data.max_classes if the data really has that many "
                                "classes")
    union = {c for info in infos for c in info.class_names or []}
    if len(union) > limit:
        raise DataError(f"the clients' class folders name {len(union)} classes together, above "
                        f"data.max_classes={limit}; raise data.max_classes if the data really has that many classes")


def load_client(folder: str | Path, options: ClientsOptions,
                classes: Sequence[str]) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor], ClientInfo]:
    """``((train_x, train_y), (test_x, test_y), info)`` of one client folder, labels indexing ``classes``.

    Images become float ``N x 3 x S x S`` in ``[-1, 1]``; tensors keep their
    shape (floats as float32). A client without a test split gets empty test
    tensors. The same tensors whether a node or :func:`build` calls it.
    """
    folder = Path(folder).expanduser()
    info = scan_client(folder, options)
    classes = [str(c) for c in classes]
    if info.kind == "images":
        return (*_load_images(folder, info, options, classes), info)
    train, test = _load_tensors(folder, info, classes, options)
    return (*standardized(train, test, applied_mode(options.standardize), given_scaling(options)), info)


# --------------------------------------------------------------------------- the federation


def client_folders(data_dir: str | Path | None) -> list[Path]:
    """The client folders of ``data_dir``: its non-hidden subfolders, sorted by name."""
    if not data_dir:
        raise ConfigError("dataset=clients needs data_dir=PATH, the folder with one subfolder per client")
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        wanted = ("a .csv file (one table of several sites)" if root.suffix.lower() == ".csv" else
                  "a folder with one subfolder per client, or a .csv file of several sites")
        what = f"is a file, not {wanted}" if root.exists() else f"no such file or folder; give {wanted}"
        raise DataError(f"data_dir={data_dir}: {what}{_did_you_mean_path(root)}")
    folders = [f for f in subfolders(root) if f.name != CACHE_FOLDER]
    if not folders:
        raise DataError(f"{root} has no client folders; put each client's data in its own subfolder "
                        f"({root}/<client>/train/<class>/... or {root}/<client>/train.npz)")
    return folders


def build(options: ClientsOptions, clients: int | None, seed: int, data_dir: Any = None, progress: bool = False,
          partition: Any = None) -> Federation:
    """The federation of ``data_dir``'s client folders, or of the sites of one table (:func:`is_table`) (the
    :class:`DatasetSpec` build; ``seed`` is unused: the split is the folders' or the table's)."""
    if partition is not None and (partition.scheme != "auto" or partition.load):
        what = f"partition={partition.scheme}" if partition.scheme != "auto" else "partition.load"
        raise ConfigError(f"{what} does not apply to dataset=clients: the data is already split, one client per "
                          "folder; leave partition unset (or use dataset=imagefolder to split one data set)")
    if is_table(data_dir):
        sites = table_sites(data_dir, options.label_column, options.site_column, options.split_column)
        return sites_federation(sites, options, clients, str(Path(data_dir).expanduser()))
    folders = client_folders(data_dir)
    if clients is not None and clients != len(folders):
        raise ConfigError(f"clients={clients} but {data_dir} holds {len(folders)} client folders; leave clients "
                          "unset (each folder is a client)")
    infos = [scan_client(folder, options) for folder in folders]
    bound = _label_bound(infos, options)
    for folder, info in zip(folders, infos):
        if info.kind == "tensors" and bound is not None and info.max_label is not None and info.max_label >= bound:
            # the DataError naming the file with the label
            _load_tensors(folder, info, [str(c) for c in range(bound)], options)
    classes = resolve_classes(infos, options)
    if not any(info.test_size for info in infos):
        raise DataError(f"no client in {data_dir} has test data; give at least one client test/<class>/ images "
                        "or a test.pt/test.npz/test.csv")
    train, tests = [], []
    for folder, info in zip(folders, infos):
        loaded = (_load_images(folder, info, options, classes) if info.kind == "images"
                  else _load_tensors(folder, info, classes, options))
        train.append(loaded[0])
        tests.append(loaded[1])
    untrained = untrained_classes(classes, train, tests, [_test_source(folder, info) for folder, info in
                                                          zip(folders, infos)], infos[0], options)
    converted = _features_as_floats(folders, infos, train, tests)
    columns = _csv_columns(folders, infos, options)
    notes = [f"clients: {len(infos)} client folders of {data_dir} ({infos[0].kind}), {len(classes)} classes"]
    if converted:
        notes.append(f"clients: the integer x of {', '.join(converted)} converted to float32 (exactly), as the other "
                     "clients hold float features")
    return _federation(infos, classes, train, tests, options, str(Path(data_dir).expanduser()), notes,
                       _class_folder_notes(folders, infos, classes, tests) + untrained, columns)


def sites_federation(sites: Sequence[SiteRows], options: ClientsOptions, clients: int | None,
                     source: str, statistics: bool = False) -> Federation:
    """The federation of a table's sites (one CSV with a site column, or DataFrames given from Python): the
    same tensors, standardisation, classes and record as client folders holding each site's ``train.csv``
    and ``test.csv`` (:func:`build`). ``statistics``: the record also holds the standardisation statistics
    (:func:`standardization_statistics`' content) as ``"statistics"``, for data that no file can rebuild."""
    if clients is not None and clients != len(sites):
        raise ConfigError(f"clients={clients} but {source} holds {len(sites)} sites; leave clients unset (each site "
                          "is a client)")
    refuse_lookalikes([site.name for site in sites], "site", "give each site one spelling")
    columns = sites[0].train.columns
    for site in sites:
        for rows in (site.train, site.test):
            if rows is not None and rows.columns != columns:
                raise DataError(f"{rows.where} has the feature columns {rows.columns[:20]}, not those of site "
                                f"{sites[0].name} ({columns[:20]}); give every site the same columns in the same "
                                "order (e.g. frame[columns])")
    limit = int(options.max_classes)
    parts = [[rows_tensors(rows, limit) for rows in (site.train, site.test) if rows is not None] for site in sites]
    infos = []
    for site, loaded in zip(sites, parts):
        class_names, max_label = _label_summary(site.name, [labels for _, labels in loaded])
        match = _NUMBERED.match(site.name)
        infos.append(ClientInfo(site.name, match.group("prefix") if match else None, "tensors", class_names, None,
                                max_label, [len(columns)], site.train.x.shape[0],
                                0 if site.test is None else site.test.x.shape[0]))
    classes = resolve_classes(infos, options)
    if not any(info.test_size for info in infos):
        raise DataError(f"no site of {source} has test rows; give at least one site test rows")
    train, tests = [], []
    for site, loaded in zip(sites, parts):
        given = [rows for rows in (site.train, site.test) if rows is not None]
        pairs = [(x, class_indices(labels, classes, rows.where)) for (x, labels), rows in zip(loaded, given)]
        train.append(pairs[0])
        empty = (torch.empty((0, len(columns))), torch.empty(0, dtype=torch.int64))
        tests.append(pairs[1] if len(pairs) > 1 else empty)
    untrained = untrained_classes(classes, train, tests, [f"site {site.name} of {source}" for site in sites],
                                  infos[0], options)
    notes = [f"clients: {len(sites)} sites of {source} (tensors), {len(classes)} classes"]
    found = _statistics(infos, train) if statistics and options.standardize == "client" else None
    federation = _federation(infos, classes, train, tests, options, source, notes, untrained, columns)
    if found is not None:
        federation.partition["statistics"] = found
    return federation


def _federation(infos: Sequence[ClientInfo], classes: Sequence[str], train: list[tuple[Tensor, Tensor]],
                tests: list[tuple[Tensor, Tensor]], options: ClientsOptions, source: str, notes: list[str],
                more_notes: list[str], columns: list[str] | None) -> Federation:
    """The federation of loaded clients: standardised (``data.standardize``), with its record and notes."""
    scaled = []
    mode = applied_mode(options.standardize)
    shared = federation_scaling(infos, train, options, columns) if mode == FEDERATED else None
    for k in range(len(train)):
        before = train[k][0]
        pair = None if shared is None else (shared.mean, shared.std)
        train[k], tests[k] = standardized(train[k], tests[k], mode, pair)
        scaled += [infos[k].name] if train[k][0] is not before else []
    num_classes = len(classes)
    record: dict[str, Any] = {
        "dataset": "clients", "scheme": "given", "data_dir": source,
        "kind": infos[0].kind, "num_classes": num_classes, "classes": list(classes),
        "clients": [{"client": k, "name": info.name, "domain": info.domain, "size": info.train_size,
                     "test_size": info.test_size,
                     "class_counts": torch.bincount(train[k][1], minlength=num_classes).tolist()}
                    for k, info in enumerate(infos)],
    }
    if scaled and mode == FEDERATED:
        notes.append(f"clients: features standardised by one scaling shared by every site (data.standardize="
                     f"federated): the pooled training mean and std of {len(shared.sites) if shared else 0} "
                     f"sites{'' if shared is None or shared.given is None else ' (' + shared.given + ')'}")
        notes += [f"warning: client {name}'s feature sums are left out of the shared scaling: {why}"
                  for name, why in sorted((shared.left_out if shared else {}).items())]
    elif scaled:
        notes.append(f"clients: features standardised with each client's own training mean and std "
                     f"(data.standardize=client; data.standardize=none keeps them as saved): {', '.join(scaled)}")
        notes += skewed_scaling_warning([infos[k].name for k in range(len(train))], [y for _, y in train],
                                        len(classes))
    notes += client_notes(infos)
    notes += more_notes
    if infos[0].kind == "tensors":
        record["standardize"] = mode
        if shared is not None:
            record["scaling"] = shared.as_record()
    if columns is not None:
        # the tables' feature columns, in order, and the label column: what predict takes from a CSV of rows
        record["columns"] = list(columns)
        record["label_column"] = options.label_column
    return Federation.from_tensors(train, tests, num_classes=num_classes, domains=[i.domain for i in infos],
                                   names=[i.name for i in infos], name="clients", partition=record, notes=notes)


def untrained_classes(classes: Sequence[str], train: Sequence[tuple[Tensor, Tensor]],
                      tests: Sequence[tuple[Tensor, Tensor]], sources: Sequence[str], first: ClientInfo,
                      options: ClientsOptions) -> list[str]:
    """The classes with test samples but no training sample at any client: the model never learns them, so
    their test samples can only count as errors. Refused in one DataError line naming each (its test samples,
    where) and the fix, unless ``data.untrained_classes=keep``: then a note naming them (a list of one note,
    else empty). ``sources[k]`` names where client k's test samples are; ``first`` tells the kind of data."""
    trained = {int(label) for _, y in train for label in torch.unique(y).tolist()}
    found: dict[int, list[tuple[str, int]]] = {}
    for (_, y), source in zip(tests, sources):
        labels, counts = torch.unique(y, return_counts=True)
        for label, count in zip(labels.tolist(), counts.tolist()):
            if int(label) not in trained:
                found.setdefault(int(label), []).append((source, int(count)))
    if not found:
        return []
    unit, one = ("images", "image") if first.kind == "images" else ("rows", "row")
    named = first.kind == "images" or first.class_names is not None

    def described(label: int) -> str:
        places = found[label]
        shown = ", ".join(f"{count} at {source}" for source, count in places[:5]) + (", ..." if len(places) > 5
                                                                                     else "")
        name = repr(str(classes[label])) if named else str(label)
        return f"{name} ({sum(count for _, count in places)} test {unit}: {shown})"

    listed = "; ".join(described(label) for label in sorted(found)[:10]) + ("; ..." if len(found) > 10 else "")
    what = f"class{'es' if len(found) > 1 else ''} {listed}"
    if options.untrained_classes == "keep":
        return [f"clients: {what} with test {unit} but no training {one} at any site, never learned: their test "
                f"{unit} count as errors (data.untrained_classes=keep)"]
    several = len(found) > 1
    raise DataError(f"{what} {'have' if several else 'has'} test {unit} but no training {one} at any site: the model "
                    f"never learns {'them' if several else 'it'}, so those {unit} can only count as errors; give some "
                    f"site training {unit} of {'each' if several else 'it'}, drop {'their' if several else 'its'} "
                    f"test {unit}, or set data.untrained_classes=keep to test on them anyway")


def _test_source(folder: Path, info: ClientInfo) -> str:
    """Where a client folder's test samples are: its test file, or its test image folder."""
    if info.kind == "images":
        test = split_folders(folder)
        return f"client {info.name} ({test.get('test', test.get('val', folder / 'test'))})"
    files = _tensor_files(folder)
    return f"client {info.name} ({files.get('test', folder / 'test')})"


def _csv_columns(folders: Sequence[Path], infos: Sequence[ClientInfo], options: ClientsOptions) -> list[str] | None:
    """The feature columns every CSV client file holds (the same in each, else one DataError line), or None
    where the clients hold no CSV."""
    if infos[0].kind != "tensors":
        return None
    found: dict[str, list[str]] = {}
    for folder in folders:
        for path in _tensor_files(folder).values():
            if path.suffix == ".csv":
                header = [str(c) for c in read_csv_header(path)]
                found[str(path)] = [c for c in header if c != options.label_column]
    if not found:
        return None
    first, columns = next(iter(found.items()))
    for where, other in found.items():
        if other != columns:
            raise DataError(f"{where} has the feature columns {other[:20]}, not those of {first} ({columns[:20]}); "
                            "give every client the same columns in the same order (e.g. frame[columns].to_csv)")
    return columns


def _features_as_floats(folders: Sequence[Path], infos: Sequence[ClientInfo], train: list[tuple[Tensor, Tensor]],
                        tests: list[tuple[Tensor, Tensor]]) -> list[str]:
    """Where some tensor clients hold float x and others integer x, the integer ones become float32 (exactly,
    else a DataError naming the file): the names of the clients converted."""
    if infos[0].kind != "tensors" or not any(x.is_floating_point() for x, _ in train):
        return []
    converted = []
    for k, folder in enumerate(folders):
        if not train[k][0].is_floating_point():
            path = _tensor_files(folder)["train"]
            train[k] = (as_float(train[k][0], path), train[k][1])
            tests[k] = (as_float(tests[k][0], _tensor_files(folder).get("test", path)), tests[k][1])
            converted.append(infos[k].name)
    return converted


# --------------------------------------------------------------------------- helpers


def _did_you_mean_path(path: Path) -> str:
    """``; did you mean SIBLING?`` for a sibling of ``path`` whose name is close, else nothing."""
    close = close_path(path)
    return f"; did you mean {close}?" if close is not None else ""


def _did_you_mean(names: Sequence[str], known: Sequence[str]) -> str:
    """`` (did you mean 'Dear'?)`` where the first of ``names`` is close to one of ``known``, else nothing."""
    close = close_name(names[0], known) if names else None
    return f" (did you mean {close!r}?)" if close is not None else ""


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"cannot read {path} ({error}); save it as UTF-8 text") from None


def _declared_classes(folder: Path) -> list[str] | None:
    path = folder / "classes.txt"
    if not path.is_file():
        return None
    return [line.strip() for line in _read_text(path).splitlines() if line.strip()]


def _label_bound(infos: Sequence[ClientInfo], options: ClientsOptions) -> int | None:
    """The class count that labels must stay below where one is given (data.classes, classes.txt, num_classes)."""
    if options.classes is not None:
        return len(options.classes)
    declared = next((i.declared_classes for i in infos if i.declared_classes is not None), None)
    return len(declared) if declared is not None else options.num_classes


def _tensor_files(folder: Path) -> dict[str, Path]:
    """``{"train": path, "test": path}`` (test only if present); one of .pt / .npz per split."""
    found = {}
    for split in ("train", "test"):
        present = [folder / f"{split}{suffix}" for suffix in TENSOR_SUFFIXES if (folder / f"{split}{suffix}").is_file()]
        if len(present) > 1:
            raise DataError(f"client folder {folder} holds {' and '.join(p.name for p in present)}; keep one of them")
        if present:
            found[split] = present[0]
    return found


def _kind(folder: Path) -> str:
    """``"images"`` (a ``train/`` folder) or ``"tensors"`` (``train.pt``/``train.npz``); else a DataError."""
    splits = split_folders(folder)
    has_images = "train" in splits
    tensor_files = _tensor_files(folder)
    if has_images and tensor_files:
        names = " and ".join(path.name for path in tensor_files.values())
        raise DataError(f"client folder {folder} holds both a train/ folder and {names}; give a client either "
                        "images or tensor files")
    if has_images:
        return "images"
    if "train" in tensor_files:
        test_folder = splits.get("test", splits.get("val"))
        if test_folder is not None:
            suffix = tensor_files["train"].suffix
            raise DataError(f"client folder {folder} holds train{suffix} and a {test_folder.name}/ folder; save its "
                            f"test data as test{suffix} instead")
        return "tensors"
    raise DataError(f"client folder {folder} has no training data; give it train/<class>/<image> files, "
                    "train.pt / train.npz (x, y) or train.csv (a label column), or move it out of data_dir")


def _image_splits(folder: Path) -> dict[str, dict[str, list[Path]]]:
    """``{"train": {class: files}, "test": {...}}`` of an image client: its split folders in any case and the
    usual spellings (:func:`~fedhpro.data.images.split_folders`); test is ``test/``, else ``val/``, else none."""
    found = split_folders(folder)
    splits = {"train": class_files(found["train"])}
    test = found.get("test", found.get("val"))
    if test is not None:
        splits["test"] = class_files(test)
    return splits


def client_notes(infos: Sequence[ClientInfo], claimed: bool = False) -> list[str]:
    """What a run must say about the clients' test splits, from their :class:`ClientInfo` alone (a Flower
    server has nothing else): the clients without a test split (not tested: no accuracy of their own, left
    out of the fairness statistics), the domains none of whose clients is tested, and what AVG is over the
    tested clients' test sets (:func:`~fedhpro.data.federation.avg_note`; ``claimed``: no roster vouches for
    the clients)."""
    notes = []
    untested = [info.name for info in infos if not info.test_size]
    if untested:
        notes.append(untested_note(untested))
    empty = sorted({info.domain or "all" for info in infos} - {info.domain or "all" for info in infos
                                                               if info.test_size})
    if empty:
        notes.append(untested_domains_note(empty))
    avg = avg_note([(info.name, info.domain or "all") for info in infos if info.test_size], claimed)
    return notes + ([avg] if avg is not None else [])


def _class_folder_notes(folders: Sequence[Path], infos: Sequence[ClientInfo], classes: Sequence[str],
                        tests: Sequence[tuple[Tensor, Tensor]]) -> list[str]:
    """Image clients: class folders without any image (left out), and the classes no tested client has a
    test image of (their accuracy is not measured)."""
    if infos[0].kind != "images":
        return []
    notes = []
    empty = []
    for folder, info in zip(folders, infos):
        for split, found in _image_splits(folder).items():
            empty += [f"{info.name}/{split}/{name}" for name, files in found.items() if not files]
    if empty:
        notes.append(f"clients: class folders without images left out: {', '.join(empty)}")
    tested = {int(c) for _, y in tests for c in torch.unique(y).tolist()}
    untested = [name for c, name in enumerate(classes) if c not in tested]
    if untested and any(y.numel() for _, y in tests):
        notes.append(f"clients: classes without test images (their accuracy is not measured): {', '.join(untested)}")
    return notes


def site_feature_sums(folder: str | Path, options: ClientsOptions) -> FeatureSums | None:
    """What a Flower node releases for ``data.standardize=federated``: the :func:`feature_sums` of its own
    training features as :func:`load_client` reads them (before any scaling); None when the run gives the
    scaling already (``data.feature_mean``), another mode, or data without float ``N x F`` features."""
    if applied_mode(options.standardize) != FEDERATED or options.feature_mean is not None:
        return None
    x = site_training_features(folder, options)
    return None if x is None else feature_sums(x)


def site_training_features(folder: str | Path, options: ClientsOptions) -> Tensor | None:
    """A client folder's training features as :func:`load_client` reads them, before any scaling (integer
    features as float32), or None when they are not float ``N x F`` features (images, token ids)."""
    folder = Path(folder).expanduser()
    info = scan_client(folder, options)
    if info.kind != "tensors":
        return None
    own = resolve_classes([info], options)
    (x, _), _ = _load_tensors(folder, info, own, options)
    x = x.float() if not x.is_floating_point() and x.dim() == 2 else x
    return x if scales(x) else None


def standardization_statistics(options: ClientsOptions, data_dir: Any) -> dict[str, Any] | None:
    """The statistics ``data.standardize=client`` scaled each client's features with, JSON-ready, or None
    when nothing was scaled: ``{"sites": {name: {"mean": [...], "std": [...]}}, "pooled": {...}}``, the
    pooled pair over every scaled client's training rows (for a site that was not in the federation).
    Rebuilt from ``data_dir`` as :func:`build` reads it (the same files, conversions and map)."""
    if options.standardize == "none":
        return None
    if is_table(data_dir):
        sites = table_sites(data_dir, options.label_column, options.site_column, options.split_column)
        infos = [ClientInfo(site.name, None, "tensors", None, None, None, [site.train.x.shape[1]], 0, 0)
                 for site in sites]
        train = [(torch.from_numpy(site.train.x), torch.empty(0)) for site in sites]
        return _statistics(infos, train)
    folders = client_folders(data_dir)
    infos = [scan_client(folder, options) for folder in folders]
    if infos[0].kind != "tensors":
        return None
    classes = resolve_classes(infos, options)
    train, tests = [], []
    for folder, info in zip(folders, infos):
        loaded = _load_tensors(folder, info, classes, options)
        train.append(loaded[0])
        tests.append(loaded[1])
    _features_as_floats(folders, infos, train, tests)
    return _statistics(infos, train)


def _statistics(infos: Sequence[ClientInfo], train: Sequence[tuple[Tensor, Tensor]]) -> dict[str, Any] | None:
    """:func:`standardization_statistics` of the clients' raw training features."""
    sites: dict[str, Any] = {}
    rows = []
    for info, (x, _) in zip(infos, train):
        if scales(x):
            mean, std = feature_statistics(x)
            sites[info.name] = {"mean": mean.tolist(), "std": std.tolist()}
            rows.append(x)
    if not sites:
        return None
    mean, std = feature_statistics(torch.cat(rows))
    return {"features": int(rows[0].shape[1]), "sites": sites, "pooled": {"mean": mean.tolist(), "std": std.tolist()}}


def _load_images(folder: Path, info: ClientInfo, options: ClientsOptions,
                 classes: Sequence[str]) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    index = {name: label for label, name in enumerate(classes)}
    unknown = sorted(set(info.class_names or []) - set(index))
    if unknown:
        raise DataError(f"client {folder} has class folders {unknown} outside the federation's classes"
                        f"{_did_you_mean(unknown, classes)}; add them to data.classes / classes.txt or rename the "
                        "folders")
    size = int(options.image_size)
    cache = folder.parent / CACHE_FOLDER if options.cache else None
    splits = _image_splits(folder)
    decoded = []
    for split in ("train", "test"):
        files, labels = [], []
        for name, paths in splits.get(split, {}).items():
            if paths:  # a class folder without images is no class (the run notes it)
                files += paths
                labels += [index[name]] * len(paths)
        pixels = decode_files(files, size, cache, depth=True) if files else np.empty((0, 3, size, size), np.uint8)
        decoded.append((pixels, torch.tensor(labels, dtype=torch.int64)))
    detected = detected_depth([pixels for pixels, _ in decoded])
    if detected is not None and detected < 16 and options.bit_depth == DETECTED:
        # a site cannot see the others' images: a depth detected per site could scale the sites differently
        raise DataError(f"client {folder}: its 16-bit images all hold values within 0..{2 ** detected - 1} "
                        f"({detected}-bit); set data.bit_depth={detected} for every site (or data.bit_depth=16 if "
                        "they are dark 16-bit images)")
    bits = scaling_depth(options.bit_depth, detected)
    return (to_float(decoded[0][0], bits), decoded[0][1]), (to_float(decoded[1][0], bits), decoded[1][1])


def _load_tensors(folder: Path, info: ClientInfo, classes: Sequence[str],
                  options: ClientsOptions) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    files = _tensor_files(folder)
    pairs = []
    for split in ("train", "test"):
        if split not in files:
            pairs.append((torch.empty((0, *info.input_shape), dtype=torch.float32), torch.empty(0, dtype=torch.int64)))
            continue
        x, labels = _read_split(files[split], options)
        pairs.append((x, class_indices(labels, classes, str(files[split]))))
    if pairs[1][0].dtype != pairs[0][0].dtype and pairs[1][1].numel():  # int64 and float32: features as floats
        return (as_float(pairs[0][0], files["train"]), pairs[0][1]), (as_float(pairs[1][0], files["test"]),
                                                                      pairs[1][1])
    return pairs[0], (pairs[1][0].to(pairs[0][0].dtype), pairs[1][1])


def class_indices(labels: Tensor | np.ndarray, classes: Sequence[str], where: str) -> Tensor:
    """int64 labels indexing ``classes``: names looked up, class indices checked to be below their count;
    one DataError line naming ``where`` otherwise."""
    if isinstance(labels, np.ndarray):
        codes = name_codes(labels, [str(name) for name in classes])
        if bool((codes < 0).any()):
            unknown = label_names(labels[codes < 0])
            raise DataError(f"{where}: labels {unknown[:10]} are not among the federation's classes "
                            f"({', '.join(map(str, classes[:20]))}){_did_you_mean(unknown, classes)}; fix the labels "
                            "or list them in data.classes")
        return torch.from_numpy(codes)
    if labels.numel() and int(labels.max()) >= len(classes):
        raise DataError(f"{where}: label {int(labels.max())} is out of range for {len(classes)} classes; fix "
                        "the labels or set data.num_classes")
    return labels


def _group(infos: Sequence[ClientInfo], key: Any) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for info in infos:
        groups.setdefault(str(key(info)), []).append(info.name)
    return groups


def _listing(groups: dict[str, list[str]]) -> str:
    return "; ".join(f"{value}: {', '.join(names)}" for value, names in groups.items())


def image_input(options: ClientsOptions, partition: Mapping[str, Any], size: int) -> dict[str, Any] | None:
    """A new image as this data set's input, for sites of images (None for tensors): resized to ``size``,
    scaled to [-1, 1] by the bit depth every site was told (``data.bit_depth`` above 8). The kind is the
    partition record's, or on Flower the kind the first node reported."""
    reported = partition.get("clients") or [{}]
    kind = partition.get("kind", reported[0].get("kind") if isinstance(reported[0], Mapping) else None)
    if kind != "images":
        return None
    image = half_range_image("clients", size, resize=True)
    if int(options.bit_depth or 0) > 8:
        image["bit_depth"] = int(options.bit_depth)
    return image


DATASET = DatasetSpec.of(DECLARATION, build, image_input)

__all__ = ["CLIENT", "ClientInfo", "ClientsOptions", "DATASET", "STANDARDIZE_CHOICES",
           "UNTRAINED_CHOICES", "apply_statistics", "build", "client_domain", "client_folders", "client_notes",
           "feature_statistics", "federation_scaling", "folded", "given_scaling", "load_client", "resolve_classes",
           "scan_client", "site_feature_sums", "site_training_features", "skewed_scaling_warning",
           "standardization_statistics", "standardized", "untrained_classes"]
